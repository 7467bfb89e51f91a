#include "qlora/ops/rope_ops.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "kernels/rope_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

namespace {

// ATen's ops: out = x * cos, then the rotate-half term added into each half in place.
at::Tensor rope_aten(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor out = x * cos;
  out.narrow(-1, 0, half).addcmul_(x.narrow(-1, half, half), sin.narrow(-1, 0, half), sign);
  out.narrow(-1, half, half).addcmul_(x.narrow(-1, 0, half), sin.narrow(-1, half, half), -sign);
  return out;
}

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign, bool heads_inner) {
  if (x.dim() != 4 || x.size(-1) % 2 != 0 || cos.sizes() != sin.sizes())
    throw std::invalid_argument("rope: x must be [B, H, S, d] with even d, cos and sin of one shape");
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), d = x.size(3);
  const bool shared = cos.dim() == 2 && cos.size(0) == S && cos.size(1) == d;
  const bool per_row = cos.dim() == 4 && cos.size(0) == B && cos.size(1) == 1 && cos.size(2) == S && cos.size(3) == d;
  if (!kernel_dtype(x) || cos.scalar_type() != x.scalar_type() || sin.scalar_type() != x.scalar_type() ||
      !cos.is_cpu() || !sin.is_cpu() || x.stride(3) != 1 || !(shared || per_row) ||
      !cos.is_contiguous() || !sin.is_contiguous() || x.numel() == 0)
    return rope_aten(x, cos, sin, sign);
  at::Tensor out = heads_inner ? at::empty({B, S, H, d}, x.options()).transpose(1, 2) : at::empty({B, H, S, d}, x.options());
  with_element(x, [&](auto e) {
    using T = decltype(e);
    kernels::rope_cpu(B, H, S, d, in_ptr<T>(x), {x.stride(0), x.stride(1), x.stride(2)}, in_ptr<T>(cos), in_ptr<T>(sin),
                      per_row ? S * d : 0, static_cast<float>(sign), out_ptr<T>(out),
                      {out.stride(0), out.stride(1), out.stride(2)});
  });
  return out;
}

at::Tensor rope_in_fp32(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool heads_inner) {
  if (x.dim() != 4 || x.size(-1) % 2 != 0 || cos.sizes() != sin.sizes())
    throw std::invalid_argument("rope_in_fp32: x must be [B, H, S, d] with even d, cos and sin of one shape");
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), d = x.size(3);
  if (x.scalar_type() != at::kBFloat16 || cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat ||
      !x.is_cpu() || !cos.is_cpu() || !sin.is_cpu() || x.stride(3) != 1 || cos.dim() != 2 || cos.size(0) != S ||
      cos.size(1) != d || !cos.is_contiguous() || !sin.is_contiguous() || x.numel() == 0) {
    const at::Tensor c = cos.to(at::kFloat), s = sin.to(at::kFloat);
    return x.scalar_type() == at::kFloat ? rope(x, c, s, -1.0, heads_inner)
                                         : rope_aten(x.to(at::kFloat), c, s, -1.0).to(x.scalar_type());
  }
  at::Tensor out = heads_inner ? at::empty({B, S, H, d}, x.options()).transpose(1, 2) : at::empty({B, H, S, d}, x.options());
  kernels::rope_cpu(B, H, S, d, in_ptr<uint16_t>(x), {x.stride(0), x.stride(1), x.stride(2)}, in_ptr<float>(cos),
                    in_ptr<float>(sin), 0, -1.0f, out_ptr<uint16_t>(out), {out.stride(0), out.stride(1), out.stride(2)});
  return out;
}

}  // namespace qlora::ops
