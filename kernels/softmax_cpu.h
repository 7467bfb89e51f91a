// The training step's row softmaxes on CPU float32, each in two passes over a row (max, then exp
// and sum, scaled in cache), where ATen's ops take four or five:
//   - causal attention's probabilities of one query block, the causal mask applied by row length
//     (no masked fill) and the masked entries written 0: causal_softmax_cpu;
//   - its gradient through the softmax, ds = p * (dp - delta): softmax_backward_cpu;
//   - one vocabulary block of the chunked loss's online log-sum-exp: online_softmax_cpu.
// Each takes fp32 or bf16 rows (uint16_t: bf16 bit patterns; the per-row values lse, delta, m,
// s and rescale are fp32 either way), vectorized for the active ISA (kernels/cpu_isa.h); exp is
// kernels/simd.h's, within 2 ulp of expf. bf16 outputs are rounded once from fp32. NaN and +inf in a row
// give NaN as ATen's ops do. Every row is done by one thread, its sums in a fixed order, so
// results do not depend on the thread count. Argument checks live in the binding
// (src/qlora/ops/softmax_ops.cpp).
#pragma once

#include <cstdint>

namespace qlora::kernels {

// s [heads, nq, keys] row-major, in place: the scaled scores of the block's queries (positions
// keys - nq .. keys - 1) against keys 0 .. keys - 1 become their causal softmax. Row r of a head
// keeps its first keys - nq + r + 1 entries; the rest (the mask) are written 0 whatever they held.
// lse (may be null): each row's log-sum-exp, row r of head h at lse[h * lse_ld + r].
void causal_softmax_cpu(int64_t heads, int64_t nq, int64_t keys, float* s, float* lse, int64_t lse_ld);
void causal_softmax_cpu(int64_t heads, int64_t nq, int64_t keys, uint16_t* s, float* lse, int64_t lse_ld);

// ds [heads, nq, keys] (holding dp = dO v^T) becomes p * (dp - delta), p the block's probabilities
// in the same layout, delta of row r of head h at delta[h * delta_ld + r].
void softmax_backward_cpu(int64_t heads, int64_t nq, int64_t keys, float* ds, const float* p, const float* delta,
                          int64_t delta_ld);
void softmax_backward_cpu(int64_t heads, int64_t nq, int64_t keys, uint16_t* ds, const uint16_t* p,
                          const float* delta, int64_t delta_ld);

// One block of n columns of an online log-sum-exp over rows of z (row stride ldz). m, s: each row's
// running max and sum of exp(z - m) over the earlier blocks (-inf and 0 before the first). Writes
// p = exp(z - m') (row stride ldp; p may be z), rescale = exp(m - m'), and updates
// s = s * rescale + sum(p), m = m', where m' = max(m, max of the row's block).
void online_softmax_cpu(int64_t rows, int64_t n, const float* z, int64_t ldz, float* p, int64_t ldp, float* m,
                        float* s, float* rescale);
void online_softmax_cpu(int64_t rows, int64_t n, const uint16_t* z, int64_t ldz, uint16_t* p, int64_t ldp, float* m,
                        float* s, float* rescale);

}  // namespace qlora::kernels
