// The training step's row softmaxes on at::Tensors: the two-pass CPU kernels of
// kernels/softmax_cpu.h for float32 or bfloat16 CPU operands in the layouts below (lse and delta
// either dtype, m and s fp32), ATen's ops otherwise (the ops the callers ran before; CUDA, other
// dtypes, other strides). The kernels' exp differs from ATen's in
// the last bits (within 2 ulp).
#pragma once

#include <ATen/core/Tensor.h>

namespace qlora::ops {

// Causal attention's probabilities of one block of nq queries, in place: s [heads, nq, keys]
// contiguous holds the scaled scores of queries at positions keys - nq .. keys - 1 against keys
// 0 .. keys - 1; row r keeps keys - nq + r + 1 entries and the rest become 0 (whatever they held).
// lse: undefined, or [heads, nq] (rows of unit stride) to receive each row's log-sum-exp.
void causal_softmax_(const at::Tensor& s, const at::Tensor& lse);

// ds [heads, nq, keys] contiguous, holding dp, becomes p * (dp - delta); p like ds, delta
// [heads, nq] or [heads, nq, 1] (rows of unit stride): each row's sum of dO * O.
void softmax_backward_(const at::Tensor& ds, const at::Tensor& p, const at::Tensor& delta);

// One block z [T, n] of an online log-sum-exp over T rows: m, s [T, 1] fp32 are the running max and
// sum of exp(z - m) (-inf and 0 before the first block). Writes p = exp(z - m') into p ([T, n],
// may be z itself), updates s = s * rescale + rowsum(p) and m = m', and returns rescale
// = exp(m - m') [T, 1] (0 on the first block), m' = max(m, rowmax(z)).
at::Tensor online_softmax_(const at::Tensor& z, const at::Tensor& p, at::Tensor& m, at::Tensor& s);

}  // namespace qlora::ops
