#include "qlora/ops/softmax_ops.h"

#include <ATen/ATen.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/softmax_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

namespace {

bool cpu_float(const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; }

// Whether t is [heads, nq] or [heads, nq, 1] on the CPU (fp32 or bf16), its rows of unit stride.
bool row_values(const at::Tensor& t, int64_t heads, int64_t nq) {
  if (!kernel_dtype(t) || t.dim() < 2 || t.dim() > 3 || (t.dim() == 3 && t.size(2) != 1)) return false;
  return t.size(0) == heads && t.size(1) == nq && (nq == 1 || t.stride(1) == 1);
}

// Row values as the kernels take them: t itself if fp32, else an fp32 copy [heads, nq].
at::Tensor fp32_rows(const at::Tensor& t, int64_t heads, int64_t nq) {
  return t.scalar_type() == at::kFloat ? t : t.reshape({heads, nq}).to(at::kFloat);
}

void check_block(const char* op, const at::Tensor& s) {
  if (s.dim() != 3 || s.size(1) > s.size(2))
    throw std::invalid_argument(std::string(op) + ": scores must be [heads, nq, keys] with nq <= keys");
}

}  // namespace

void causal_softmax_(const at::Tensor& s, const at::Tensor& lse) {
  check_block("causal_softmax_", s);
  const int64_t heads = s.size(0), nq = s.size(1), keys = s.size(2);
  if (!kernel_dtype(s) || !s.is_contiguous() || (lse.defined() && !row_values(lse, heads, nq))) {
    const at::Tensor future = at::ones({nq, keys}, s.options().dtype(at::kBool)).triu_(keys - nq + 1);
    s.masked_fill_(future, -std::numeric_limits<double>::infinity());
    if (lse.defined()) lse.copy_(at::logsumexp(s, -1).view(lse.sizes()));
    s.copy_(at::_softmax(s, -1, false));
    return;
  }
  const at::Tensor lse32 = lse.defined() ? fp32_rows(lse, heads, nq) : at::Tensor();
  with_element(s, [&](auto e) {
    kernels::causal_softmax_cpu(heads, nq, keys, out_ptr<decltype(e)>(s),
                                lse32.defined() ? lse32.mutable_data_ptr<float>() : nullptr,
                                lse32.defined() ? lse32.stride(0) : 0);
  });
  if (lse32.defined() && !lse32.is_same(lse)) lse.copy_(lse32.view(lse.sizes()));
}

void softmax_backward_(const at::Tensor& ds, const at::Tensor& p, const at::Tensor& delta) {
  check_block("softmax_backward_", ds);
  const int64_t heads = ds.size(0), nq = ds.size(1), keys = ds.size(2);
  if (p.sizes() != ds.sizes()) throw std::invalid_argument("softmax_backward_: p and ds must have one shape");
  if (!kernel_dtype(ds) || p.scalar_type() != ds.scalar_type() || !ds.is_contiguous() || !p.is_contiguous() ||
      !row_values(delta, heads, nq)) {
    ds.sub_(delta.reshape({heads, nq, 1})).mul_(p);
    return;
  }
  const at::Tensor delta32 = fp32_rows(delta, heads, nq);
  with_element(ds, [&](auto e) {
    using T = decltype(e);
    kernels::softmax_backward_cpu(heads, nq, keys, out_ptr<T>(ds), in_ptr<T>(p), delta32.const_data_ptr<float>(),
                                  delta32.stride(0));
  });
}

at::Tensor online_softmax_(const at::Tensor& z, const at::Tensor& p, at::Tensor& m, at::Tensor& s) {
  if (z.dim() != 2 || p.sizes() != z.sizes() || m.sizes() != at::IntArrayRef{z.size(0), 1} || s.sizes() != m.sizes())
    throw std::invalid_argument("online_softmax_: z and p must be [T, n], m and s [T, 1]");
  const int64_t T = z.size(0), n = z.size(1);
  const bool kernel = kernel_dtype(z) && p.scalar_type() == z.scalar_type() && p.is_cpu() && cpu_float(m) &&
                      cpu_float(s) && z.stride(1) == 1 &&
                      p.stride(1) == 1 && m.is_contiguous() && s.is_contiguous() && n > 0;
  if (!kernel) {
    const at::Tensor m_new = at::maximum(m, at::amax(z, 1, /*keepdim=*/true));  // [T, 1]
    const at::Tensor rescale = (m - m_new).exp_();
    p.copy_((z - m_new).exp_());
    s.mul_(rescale).add_(p.sum(1, /*keepdim=*/true));
    m.copy_(m_new);
    return rescale;
  }
  at::Tensor rescale = at::empty({T, 1}, m.options());
  with_element(z, [&](auto e) {
    using E = decltype(e);
    kernels::online_softmax_cpu(T, n, in_ptr<E>(z), z.stride(0), out_ptr<E>(p), p.stride(0), m.mutable_data_ptr<float>(),
                                s.mutable_data_ptr<float>(), rescale.mutable_data_ptr<float>());
  });
  return rescale;
}

}  // namespace qlora::ops
