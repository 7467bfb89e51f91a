// CPU products with one narrow side: LoRA's rank-r factors (r up to a few dozen columns)
// against token-by-feature matrices. These are the shapes where MKL's sgemm runs far below its
// large-GEMM rate (on a 2-core EPYC, [512, 2048]^T @ [512, 8]: 8 GFLOP/s vs 180), and where every
// product is bound by one pass over its large operand. Row-major with leading dimensions in
// elements; the large operands need unit stride along their rows.
//
// Each has an fp32 and a bf16 overload (uint16_t: bf16 bit patterns; every operand bf16, products
// and sums in fp32, each output rounded once to bf16). Vectorized for the active ISA
// (kernels/cpu_isa.h: AVX-512, AVX2 or SSE2 vectors).
//
// Threaded with ATen's parallel_for over independent outputs: each output element is summed in
// one fixed order whatever the thread count, so the results do not depend on it.
// Argument checks live in the binding (src/qlora/ops/narrow_ops.cpp).
#pragma once

#include <cstdint>

namespace qlora::kernels {

// u[t, j] = alpha * sum_k x[t, k] * w[k, j], t < T, j < R: x [T, K] (row stride ldx), w [K, R]
// with any strides (wk, wr), u [T, R] (row stride ldu). x @ A^T (w = A^T) and g @ B (w = B).
void narrow_product_cpu(int64_t T, int64_t K, int64_t R, const float* x, int64_t ldx, const float* w, int64_t wk,
                        int64_t wr, float alpha, float* u, int64_t ldu);
void narrow_product_cpu(int64_t T, int64_t K, int64_t R, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t wk,
                        int64_t wr, float alpha, uint16_t* u, int64_t ldu);

// g[j, k] = alpha * sum_t u[t, j] * x[t, k], j < R, k < K: u [T, R] (row stride ldu), x [T, K]
// (row stride ldx), g [R, K] (row stride ldg). The adapters' gradients, u^T x.
void narrow_reduction_cpu(int64_t T, int64_t R, int64_t K, const float* u, int64_t ldu, const float* x, int64_t ldx,
                          float alpha, float* g, int64_t ldg);
void narrow_reduction_cpu(int64_t T, int64_t R, int64_t K, const uint16_t* u, int64_t ldu, const uint16_t* x,
                          int64_t ldx, float alpha, uint16_t* g, int64_t ldg);

// y[t, n] += alpha * sum_j u[t, j] * v[j, n], t < T, n < N: u [T, R] (row stride ldu), v [R, N]
// (row stride ldv), y [T, N] (row stride ldy). The low-rank update added into an output.
void narrow_update_cpu(int64_t T, int64_t R, int64_t N, const float* u, int64_t ldu, const float* v, int64_t ldv,
                       float alpha, float* y, int64_t ldy);
void narrow_update_cpu(int64_t T, int64_t R, int64_t N, const uint16_t* u, int64_t ldu, const uint16_t* v,
                       int64_t ldv, float alpha, uint16_t* y, int64_t ldy);

}  // namespace qlora::kernels
