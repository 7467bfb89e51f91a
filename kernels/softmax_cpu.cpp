// The row passes of kernels/softmax_cpu.h: 8 floats at a time with AVX2 and FMA, the scalar tail
// and CPUs without AVX2 through std::exp.
#include "kernels/softmax_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu_dispatch.h"
#include "kernels/exp_avx2.h"

namespace qlora::kernels {

namespace {

// Elements per parallel chunk: enough work that a second thread pays for its wake-up.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n)); }

// The largest of x[0, n) (-inf for n == 0). A NaN may or may not win; the exp pass propagates it.
float row_max_scalar(int64_t i, int64_t n, const float* x, float mx) {
  for (; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  return mx;
}

// out[i] = exp(x[i] - m) for i in [i0, n); returns their sum added to `sum`.
float exp_sum_scalar(int64_t i, int64_t n, const float* x, float m, float* out, float sum) {
  for (; i < n; ++i) {
    out[i] = std::exp(x[i] - m);
    sum += out[i];
  }
  return sum;
}

#if defined(__x86_64__)
QLORA_AVX2 float row_max_avx2(int64_t n, const float* x) {
  __m256 acc = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  return row_max_scalar(i, n, x, max8(acc));
}

// exp(d), d = x - m, with NaN kept (exp8 clamps it away).
QLORA_AVX2 inline __m256 exp_keep_nan(__m256 d) {
  return _mm256_blendv_ps(exp8(d), d, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
}

QLORA_AVX2 float exp_sum_avx2(int64_t n, const float* x, float m, float* out) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 p = exp_keep_nan(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(out + i, p);
    acc = _mm256_add_ps(acc, p);
  }
  return exp_sum_scalar(i, n, x, m, out, sum8(acc));
}
#endif

float row_max(int64_t n, const float* x) {
#if defined(__x86_64__)
  if (kHaveAvx2Fma) return row_max_avx2(n, x);
#endif
  return row_max_scalar(0, n, x, -std::numeric_limits<float>::infinity());
}

float exp_sum(int64_t n, const float* x, float m, float* out) {
#if defined(__x86_64__)
  if (kHaveAvx2Fma) return exp_sum_avx2(n, x, m, out);
#endif
  return exp_sum_scalar(0, n, x, m, out, 0.0f);
}

QLORA_VECTOR_CLONES void scale_row(int64_t n, float* x, float c) {
  for (int64_t i = 0; i < n; ++i) x[i] *= c;
}

QLORA_VECTOR_CLONES void grad_row(int64_t n, float* ds, const float* p, float delta) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - delta);
}

}  // namespace

void causal_softmax_cpu(int64_t heads, int64_t nq, int64_t keys, float* s, float* lse, int64_t lse_ld) {
  at::parallel_for(0, heads * nq, grain_rows(keys), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t h = row / nq, r = row % nq, valid = keys - nq + r + 1;
      float* x = s + row * keys;
      const float m = row_max(valid, x);
      const float sum = exp_sum(valid, x, m, x);
      scale_row(valid, x, 1.0f / sum);
      std::fill(x + valid, x + keys, 0.0f);
      if (lse) lse[h * lse_ld + r] = m + std::log(sum);
    }
  });
}

void softmax_backward_cpu(int64_t heads, int64_t nq, int64_t keys, float* ds, const float* p, const float* delta,
                          int64_t delta_ld) {
  at::parallel_for(0, heads * nq, grain_rows(keys), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row)
      grad_row(keys, ds + row * keys, p + row * keys, delta[(row / nq) * delta_ld + row % nq]);
  });
}

void online_softmax_cpu(int64_t rows, int64_t n, const float* z, int64_t ldz, float* p, int64_t ldp, float* m,
                        float* s, float* rescale) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float mx = row_max(n, z + r * ldz), m_new = mx > m[r] ? mx : m[r];
      rescale[r] = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
      s[r] = s[r] * rescale[r] + exp_sum(n, z + r * ldz, m_new, p + r * ldp);
      m[r] = m_new;
    }
  });
}

}  // namespace qlora::kernels
