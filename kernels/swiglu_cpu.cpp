// The SwiGLU passes of kernels/swiglu_cpu.h: 8 floats at a time with AVX2 and FMA (exp8 of
// kernels/exp_avx2.h, within 2 ulp of expf), the scalar tail and CPUs without AVX2 through std::exp.
#include "kernels/swiglu_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu_dispatch.h"
#include "kernels/exp_avx2.h"

namespace qlora::kernels {

namespace {

// Elements per parallel chunk: enough work that a second thread pays for its wake-up.
constexpr int64_t kGrainElements = 1 << 15;

inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

void forward_scalar(int64_t n0, int64_t n, const float* g, const float* u, float* out) {
  for (int64_t i = n0; i < n; ++i) out[i] = g[i] * sigmoid(g[i]) * u[i];
}

void backward_scalar(int64_t n0, int64_t n, const float* grad, const float* g, const float* u, float* dg, float* du) {
  for (int64_t i = n0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    du[i] = grad[i] * (g[i] * s);
    dg[i] = grad[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
  }
}

#if defined(__x86_64__)
QLORA_AVX2 inline __m256 sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

QLORA_AVX2 void forward_avx2(int64_t n, const float* g, const float* u, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid8(gv)), _mm256_loadu_ps(u + i)));
  }
  forward_scalar(i, n, g, u, out);
}

QLORA_AVX2 void backward_avx2(int64_t n, const float* grad, const float* g, const float* u, float* dg, float* du) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), gr = _mm256_loadu_ps(grad + i), s = sigmoid8(gv);
    _mm256_storeu_ps(du + i, _mm256_mul_ps(gr, _mm256_mul_ps(gv, s)));
    const __m256 dsilu = _mm256_mul_ps(s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(gr, _mm256_loadu_ps(u + i)), dsilu));
  }
  backward_scalar(i, n, grad, g, u, dg, du);
}
#endif

void forward_row(int64_t n, const float* g, const float* u, float* out) {
#if defined(__x86_64__)
  if (kHaveAvx2Fma) return forward_avx2(n, g, u, out);
#endif
  forward_scalar(0, n, g, u, out);
}

void backward_row(int64_t n, const float* grad, const float* g, const float* u, float* dg, float* du) {
#if defined(__x86_64__)
  if (kHaveAvx2Fma) return backward_avx2(n, grad, g, u, dg, du);
#endif
  backward_scalar(0, n, grad, g, u, dg, du);
}

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n)); }

}  // namespace

void swiglu_forward_cpu(int64_t rows, int64_t n, const float* g, int64_t ldg, const float* u, int64_t ldu, float* out,
                        int64_t ldo) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) forward_row(n, g + r * ldg, u + r * ldu, out + r * ldo);
  });
}

void swiglu_backward_cpu(int64_t rows, int64_t n, const float* grad, int64_t ldgrad, const float* g, int64_t ldg,
                         const float* u, int64_t ldu, float* dg, int64_t lddg, float* du, int64_t lddu) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      backward_row(n, grad + r * ldgrad, g + r * ldg, u + r * ldu, dg + r * lddg, du + r * lddu);
  });
}

}  // namespace qlora::kernels
