#include "qlora/ops/segment_attention_ops.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#include "kernels/attention_amx_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

namespace {

kernels::RowsHeads operand(const at::Tensor& t) { return {in_ptr<uint16_t>(t), t.stride(0), t.stride(1)}; }

at::Tensor sdpa_per_segment(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& segments, double scale) {
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (const int64_t n : segments) {
    // [n, heads, d] -> [1, heads, n, d]
    const auto part = [&](const at::Tensor& t) { return t.narrow(0, start, n).transpose(0, 1).unsqueeze(0); };
    at::Tensor o = at::scaled_dot_product_attention(part(q), part(k), part(v), std::nullopt, 0.0, false, scale);
    outs.push_back(o.squeeze(0).transpose(0, 1));  // [n, heads, d]
    start += n;
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

}  // namespace

bool segment_attention_uses_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto fits = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 && t.is_cpu() && t.dim() == 3 && t.sizes() == q.sizes() && t.stride(2) == 1;
  };
  const bool differentiated = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  return !differentiated && fits(q) && fits(k) && fits(v) && q.size(2) <= 256 && q.numel() > 0 &&
         kernels::attention_amx_available();
}

at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<int64_t>& segments, double scale) {
  if (q.dim() != 3 || k.sizes() != q.sizes() || v.sizes() != q.sizes())
    throw std::invalid_argument("segment_attention: q, k and v must be [rows, heads, d] of one shape");
  int64_t total = 0;
  for (const int64_t n : segments) {
    if (n < 0) throw std::invalid_argument("segment_attention: a negative segment length");
    total += n;
  }
  if (total != q.size(0))
    throw std::invalid_argument("segment_attention: segments sum to " + std::to_string(total) + ", rows " +
                                std::to_string(q.size(0)));
  if (!segment_attention_uses_amx(q, k, v)) return sdpa_per_segment(q, k, v, segments, scale);
  at::Tensor out = at::empty(q.sizes(), q.options());
  kernels::segment_attention_amx(operand(q), operand(k), operand(v), q.size(1), q.size(2), segments.data(),
                                 static_cast<int64_t>(segments.size()), static_cast<float>(scale),
                                 out_ptr<uint16_t>(out));
  return out;
}

}  // namespace qlora::ops
