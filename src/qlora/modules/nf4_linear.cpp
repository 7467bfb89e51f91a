#include "qlora/modules/nf4_linear.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <ATen/ops/matmul.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/ops/nf4_ops.h"

namespace qlora::modules {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void save_nf4(AutogradContext* ctx, const Nf4Tensor& w) {
  ctx->saved_data["codes"] = w.codes;
  ctx->saved_data["scalers"] = w.scalers;
  ctx->saved_data["factors"] = w.factors;
  ctx->saved_data["mean"] = w.mean;
  ctx->saved_data["shape"] = c10::IValue(w.shape);
  ctx->saved_data["numel"] = w.layout.numel;
  ctx->saved_data["block_size"] = w.layout.block_size;
  ctx->saved_data["scaler_block_size"] = w.layout.scaler_block_size;
  ctx->saved_data["padded_numel"] = w.layout.padded_numel;
}

Nf4Tensor load_nf4(AutogradContext* ctx) {
  Nf4Tensor w;
  w.codes = ctx->saved_data["codes"].toTensor();
  w.scalers = ctx->saved_data["scalers"].toTensor();
  w.factors = ctx->saved_data["factors"].toTensor();
  w.mean = ctx->saved_data["mean"].toTensor();
  w.shape = ctx->saved_data["shape"].toIntVector();
  w.layout.numel = ctx->saved_data["numel"].toInt();
  w.layout.block_size = ctx->saved_data["block_size"].toInt();
  w.layout.scaler_block_size = ctx->saved_data["scaler_block_size"].toInt();
  w.layout.padded_numel = ctx->saved_data["padded_numel"].toInt();
  return w;
}

// A weight of more elements than this is dequantized and multiplied by chunks of rows, so a 7B's
// MLP weight (11008 x 4096: 180 MB in fp32) is never whole in memory, only 64 MB of it; a
// smaller one (every weight of a small model) in one piece, as one GEMM.
constexpr int64_t kChunkElements = int64_t{16} << 20;

namespace {

// Rows per chunk: whole scaler groups (so a chunk is an NF4 tensor of its own over the same
// bytes) of about kChunkElements; all rows when W is small.
int64_t chunk_rows(const Nf4Tensor& w) {
  const int64_t out = w.shape[0], in = w.shape[1], group = w.layout.group_numel();
  const int64_t align = group / std::gcd(in, group);  // rows that fill whole groups
  const int64_t rows = kChunkElements / in / align * align;
  return out * in <= kChunkElements || rows < 1 ? out : rows;
}

// Rows [r0, r0 + n) of w, dequantized to `dtype`; r0 is a multiple of chunk_rows(w).
at::Tensor dequantize_rows(const Nf4Tensor& w, int64_t r0, int64_t n, at::ScalarType dtype) {
  if (r0 == 0 && n == w.shape[0]) return ops::nf4_dequantize(w, dtype);
  const int64_t in = w.shape[1], start = r0 * in;  // a whole number of groups
  Nf4Tensor rows;
  rows.layout = nf4::Layout::make(n * in, w.layout.block_size, w.layout.scaler_block_size);
  rows.codes = w.codes.narrow(0, start / 2, rows.layout.code_bytes());
  rows.scalers = w.scalers.narrow(0, start / w.layout.block_size, rows.layout.n_blocks());
  rows.factors = w.factors.narrow(0, start / w.layout.group_numel(), rows.layout.n_groups());
  rows.mean = w.mean;
  rows.shape = {n, in};
  return ops::nf4_dequantize(rows, dtype);  // [n, in]
}

}  // namespace

at::Tensor nf4_times_transposed(const at::Tensor& x, const Nf4Tensor& weight) {
  RECORD_USER_SCOPE("qlora::base_linear");  // a phase of bench_train_step's profile
  const int64_t out = weight.shape[0], chunk = chunk_rows(weight);
  if (chunk >= out) return at::linear(x, ops::nf4_dequantize(weight, x.scalar_type()));  // [..., out]
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty(sizes, x.options());  // [..., out]
  for (int64_t r0 = 0; r0 < out; r0 += chunk) {
    const int64_t n = std::min(chunk, out - r0);
    y.narrow(-1, r0, n).copy_(at::linear(x, dequantize_rows(weight, r0, n, x.scalar_type())));  // [..., n]
  }
  return y;
}

at::Tensor grad_times_nf4(const at::Tensor& grad_y, const Nf4Tensor& weight) {
  RECORD_USER_SCOPE("qlora::base_linear");
  const int64_t out = weight.shape[0], chunk = chunk_rows(weight);
  at::Tensor grad_x;  // [..., in]
  for (int64_t r0 = 0; r0 < out; r0 += chunk) {
    const int64_t n = std::min(chunk, out - r0);
    at::Tensor part = at::matmul(grad_y.narrow(-1, r0, n), dequantize_rows(weight, r0, n, grad_y.scalar_type()));
    grad_x = grad_x.defined() ? grad_x.add_(part) : part;
  }
  return grad_x;
}

at::Tensor Nf4LinearFunction::forward(AutogradContext* ctx, const at::Tensor& x, const Nf4Tensor& weight) {
  save_nf4(ctx, weight);
  return nf4_times_transposed(x, weight);  // [..., out]
}

variable_list Nf4LinearFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  // Dequantize again rather than having kept W alive between forward and backward.
  return {grad_times_nf4(grad_outputs[0], load_nf4(ctx)), at::Tensor()};  // the NF4 weight is frozen: no gradient
}

at::Tensor nf4_linear(const at::Tensor& x, const Nf4Tensor& weight) {
  if (weight.shape.size() != 2) {
    throw std::invalid_argument("nf4_linear: weight must be 2-D [out, in]");
  }
  if (x.dim() < 1 || x.size(-1) != weight.shape[1]) {
    throw std::invalid_argument("nf4_linear: input's last dim " +
                                (x.dim() ? std::to_string(x.size(-1)) : std::string("(scalar)")) +
                                " does not match weight in_features " + std::to_string(weight.shape[1]));
  }
  if (x.device() != weight.device()) {
    throw std::invalid_argument("nf4_linear: input and NF4 weight are on different devices");
  }
  return Nf4LinearFunction::apply(x, weight);
}

}  // namespace qlora::modules
