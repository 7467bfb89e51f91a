#include "qlora/modules/nf4_linear.h"

#include <c10/core/InferenceMode.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <ATen/ops/matmul.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/ops/decode_matmul_ops.h"
#include "qlora/ops/nf4_ops.h"

namespace qlora::modules {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void save_nf4(AutogradContext* ctx, const Nf4Tensor& w, const std::string& prefix) {
  auto& d = ctx->saved_data;
  d[prefix + "codes"] = w.codes;
  d[prefix + "scalers"] = w.scalers;
  d[prefix + "factors"] = w.factors;
  d[prefix + "mean"] = w.mean;
  d[prefix + "shape"] = c10::IValue(w.shape);
  d[prefix + "numel"] = w.layout.numel;
  d[prefix + "block_size"] = w.layout.block_size;
  d[prefix + "scaler_block_size"] = w.layout.scaler_block_size;
  d[prefix + "padded_numel"] = w.layout.padded_numel;
}

Nf4Tensor load_nf4(AutogradContext* ctx, const std::string& prefix) {
  const auto& d = ctx->saved_data;
  Nf4Tensor w;
  w.codes = d.at(prefix + "codes").toTensor();
  w.scalers = d.at(prefix + "scalers").toTensor();
  w.factors = d.at(prefix + "factors").toTensor();
  w.mean = d.at(prefix + "mean").toTensor();
  w.shape = d.at(prefix + "shape").toIntVector();
  w.layout.numel = d.at(prefix + "numel").toInt();
  w.layout.block_size = d.at(prefix + "block_size").toInt();
  w.layout.scaler_block_size = d.at(prefix + "scaler_block_size").toInt();
  w.layout.padded_numel = d.at(prefix + "padded_numel").toInt();
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

at::Tensor nf4_row_sq_norms(const Nf4Tensor& weight) {
  const int64_t out = weight.shape[0], chunk = chunk_rows(weight);
  at::Tensor sq = at::empty({out}, weight.codes.options().dtype(at::kFloat));
  for (int64_t r0 = 0; r0 < out; r0 += chunk) {
    const int64_t n = std::min(chunk, out - r0);
    sq.narrow(0, r0, n).copy_(dequantize_rows(weight, r0, n, at::kFloat).square().sum(1));
  }
  return sq;
}

bool decode_rows(const at::Tensor& x2) {
  return c10::InferenceMode::is_enabled() && x2.size(0) >= 1 && x2.size(0) <= kDecodeRows;
}

void nf4_times_transposed_out(const at::Tensor& x2, const Nf4Tensor& weight, at::Tensor y, const at::Tensor& bias) {
  RECORD_USER_SCOPE("qlora::base_linear");  // a phase of bench_train_step's profile
  // A few rows (a decode step's tokens, a short prompt): W read once as NF4 for all of them, never
  // dequantized to memory. More rows amortize dequantizing W for BLAS's faster tiles.
  if (decode_rows(x2) && ops::decode_matmul_out(x2, weight, y)) {
    if (bias.defined()) y.add_(bias);
    return;
  }
  const int64_t out = weight.shape[0], chunk = chunk_rows(weight);
  for (int64_t r0 = 0; r0 < out; r0 += chunk) {
    const int64_t n = std::min(chunk, out - r0);
    at::Tensor part = y.narrow(1, r0, n);  // [T, n]
    const at::Tensor w = dequantize_rows(weight, r0, n, x2.scalar_type()).t();
    // The bias inside the GEMM: one rounding, as nn.Linear's addmm (which first copies the bias
    // over its output: half the cost of the add it replaces).
    if (bias.defined()) at::addmm_out(part, bias.narrow(0, r0, n), x2, w);
    else at::mm_out(part, x2, w);
  }
}

void grad_times_nf4_out(const at::Tensor& g2, const Nf4Tensor& weight, at::Tensor& gx, bool accumulate) {
  RECORD_USER_SCOPE("qlora::base_linear");
  const int64_t out = weight.shape[0], chunk = chunk_rows(weight);
  for (int64_t r0 = 0; r0 < out; r0 += chunk) {
    const int64_t n = std::min(chunk, out - r0);
    // beta 0 ignores gx's old contents (even NaN in fresh memory), as BLAS does.
    gx.addmm_(g2.narrow(1, r0, n), dequantize_rows(weight, r0, n, g2.scalar_type()), accumulate || r0 > 0 ? 1.0 : 0.0);
  }
}

at::Tensor nf4_stacked(const std::vector<const Nf4Tensor*>& weights, at::ScalarType dtype) {
  int64_t rows = 0;
  for (const Nf4Tensor* w : weights) rows += w->shape[0];
  const int64_t in = weights.front()->shape[1];
  if (rows * in > kChunkElements) return {};
  at::Tensor stacked = at::empty({rows, in}, at::TensorOptions().dtype(dtype).device(weights.front()->device()));
  int64_t r0 = 0;
  for (const Nf4Tensor* w : weights) {
    at::Tensor part = stacked.narrow(0, r0, w->shape[0]);  // whole rows: contiguous
    ops::nf4_dequantize_out(*w, part);
    r0 += w->shape[0];
  }
  return stacked;
}

at::Tensor nf4_times_transposed(const at::Tensor& x, const Nf4Tensor& weight, const at::Tensor& bias) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = weight.shape[0];
  const at::Tensor x2 = x.reshape({-1, weight.shape[1]});
  at::Tensor y = at::empty(sizes, x.options());  // [..., out]
  nf4_times_transposed_out(x2, weight, y.view({-1, weight.shape[0]}), bias);
  return y;
}

at::Tensor grad_times_nf4(const at::Tensor& grad_y, const Nf4Tensor& weight) {
  std::vector<int64_t> sizes = grad_y.sizes().vec();
  sizes.back() = weight.shape[1];
  at::Tensor grad_x = at::empty(sizes, grad_y.options());  // [..., in]
  at::Tensor gx2 = grad_x.view({-1, weight.shape[1]});
  grad_times_nf4_out(grad_y.reshape({-1, weight.shape[0]}), weight, gx2, /*accumulate=*/false);
  return grad_x;
}

at::Tensor Nf4LinearFunction::forward(AutogradContext* ctx, const at::Tensor& x, const Nf4Tensor& weight,
                                      const std::optional<at::Tensor>& bias) {
  save_nf4(ctx, weight);
  return nf4_times_transposed(x, weight, bias.value_or(at::Tensor()));  // [..., out]
}

variable_list Nf4LinearFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  // Dequantize again rather than having kept W alive between forward and backward.
  // The NF4 weight and the bias are frozen: no gradients.
  return {grad_times_nf4(grad_outputs[0], load_nf4(ctx)), at::Tensor(), at::Tensor()};
}

at::Tensor nf4_linear(const at::Tensor& x, const Nf4Tensor& weight, const at::Tensor& bias) {
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
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.shape[0] || bias.scalar_type() != x.scalar_type() ||
                         bias.requires_grad()))
    throw std::invalid_argument("nf4_linear: bias must be a frozen [out] tensor in the input's dtype");
  // An optional, so that no bias is no autograd input (an undefined one would be).
  return Nf4LinearFunction::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

}  // namespace qlora::modules
