#include "qlora/ops/decode_attention_ops.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "kernels/decode_attention_cpu.h"

namespace qlora::ops {

namespace {

bool suits(const at::Tensor& t, at::ScalarType dtype, int64_t D) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 4 && t.size(3) == D && t.stride(3) == 1;
}

template <class T>
at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed, double scale,
               double softcap) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  at::Tensor out = at::empty({B, H, 1, D}, q.options());
  kernels::DecodeAttention<T> p;
  p.B = B, p.H = H, p.KVH = k.size(1), p.T = k.size(2), p.D = D;
  p.q = static_cast<const T*>(q.const_data_ptr()), p.q_sb = q.stride(0), p.q_sh = q.stride(1);
  p.k = static_cast<const T*>(k.const_data_ptr()), p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_st = k.stride(2);
  p.v = static_cast<const T*>(v.const_data_ptr()), p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_st = v.stride(2);
  if (allowed.defined()) {
    p.allowed = allowed.const_data_ptr<bool>();
    p.allowed_ld = allowed.size(0) == 1 ? 0 : allowed.stride(0);
  }
  p.scale = static_cast<float>(scale), p.softcap = static_cast<float>(softcap);
  p.out = static_cast<T*>(out.data_ptr()), p.o_sb = out.stride(0), p.o_sh = out.stride(1);
  kernels::decode_attention_cpu(p);
  return out;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                            double scale, double softcap) {
  const at::ScalarType dt = q.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16) return {};
  const int64_t D = q.dim() == 4 ? q.size(3) : 0;
  if (D == 0 || D % 16 != 0 || !suits(q, dt, D) || !suits(k, dt, D) || !suits(v, dt, D) || q.size(2) != 1) return {};
  const int64_t B = q.size(0), T = k.size(2);
  if (k.size(0) != B || v.sizes() != k.sizes() || k.size(1) == 0 || q.size(1) % k.size(1) != 0) return {};
  at::Tensor a;
  if (allowed.defined()) {
    if (allowed.scalar_type() != at::kBool || allowed.dim() != 2 || allowed.size(1) != T ||
        (allowed.size(0) != B && allowed.size(0) != 1) || !allowed.device().is_cpu())
      return {};
    a = allowed.stride(1) == 1 ? allowed : allowed.contiguous();
  }
  RECORD_USER_SCOPE("qlora::decode_attention");
  return dt == at::kFloat ? run<float>(q, k, v, a, scale, softcap) : run<uint16_t>(q, k, v, a, scale, softcap);
}

}  // namespace qlora::ops
