#include "qlora/ops/softmax_ops.h"

#include <ATen/ATen.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/softmax_cpu.h"

namespace qlora::ops {

namespace {

bool cpu_float(const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; }

// Whether t is [heads, nq] or [heads, nq, 1], fp32 on the CPU, its rows of unit stride.
bool row_values(const at::Tensor& t, int64_t heads, int64_t nq) {
  if (!cpu_float(t) || t.dim() < 2 || t.dim() > 3 || (t.dim() == 3 && t.size(2) != 1)) return false;
  return t.size(0) == heads && t.size(1) == nq && (nq == 1 || t.stride(1) == 1);
}

void check_block(const char* op, const at::Tensor& s) {
  if (s.dim() != 3 || s.size(1) > s.size(2))
    throw std::invalid_argument(std::string(op) + ": scores must be [heads, nq, keys] with nq <= keys");
}

}  // namespace

void causal_softmax_(const at::Tensor& s, const at::Tensor& lse) {
  check_block("causal_softmax_", s);
  const int64_t heads = s.size(0), nq = s.size(1), keys = s.size(2);
  if (!cpu_float(s) || !s.is_contiguous() || (lse.defined() && !row_values(lse, heads, nq))) {
    const at::Tensor future = at::ones({nq, keys}, s.options().dtype(at::kBool)).triu_(keys - nq + 1);
    s.masked_fill_(future, -std::numeric_limits<double>::infinity());
    if (lse.defined()) lse.copy_(at::logsumexp(s, -1).view(lse.sizes()));
    s.copy_(at::_softmax(s, -1, false));
    return;
  }
  kernels::causal_softmax_cpu(heads, nq, keys, s.mutable_data_ptr<float>(),
                              lse.defined() ? lse.mutable_data_ptr<float>() : nullptr,
                              lse.defined() ? lse.stride(0) : 0);
}

void softmax_backward_(const at::Tensor& ds, const at::Tensor& p, const at::Tensor& delta) {
  check_block("softmax_backward_", ds);
  const int64_t heads = ds.size(0), nq = ds.size(1), keys = ds.size(2);
  if (p.sizes() != ds.sizes()) throw std::invalid_argument("softmax_backward_: p and ds must have one shape");
  if (!cpu_float(ds) || !cpu_float(p) || !ds.is_contiguous() || !p.is_contiguous() || !row_values(delta, heads, nq)) {
    ds.sub_(delta.reshape({heads, nq, 1})).mul_(p);
    return;
  }
  kernels::softmax_backward_cpu(heads, nq, keys, ds.mutable_data_ptr<float>(), p.const_data_ptr<float>(),
                                delta.const_data_ptr<float>(), delta.stride(0));
}

at::Tensor online_softmax_(const at::Tensor& z, const at::Tensor& p, at::Tensor& m, at::Tensor& s) {
  if (z.dim() != 2 || p.sizes() != z.sizes() || m.sizes() != at::IntArrayRef{z.size(0), 1} || s.sizes() != m.sizes())
    throw std::invalid_argument("online_softmax_: z and p must be [T, n], m and s [T, 1]");
  const int64_t T = z.size(0), n = z.size(1);
  const bool kernel = cpu_float(z) && cpu_float(p) && cpu_float(m) && cpu_float(s) && z.stride(1) == 1 &&
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
  kernels::online_softmax_cpu(T, n, z.const_data_ptr<float>(), z.stride(0), p.mutable_data_ptr<float>(), p.stride(0),
                              m.mutable_data_ptr<float>(), s.mutable_data_ptr<float>(),
                              rescale.mutable_data_ptr<float>());
  return rescale;
}

}  // namespace qlora::ops
