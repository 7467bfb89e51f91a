// The narrow products of kernels/narrow_cpu.h. Each is a register-tiled loop over 8-float AVX2
// vectors with FMA (a scalar loop without AVX2), one vector along the wide side of the output:
// - product: 8 rows x 8 rank columns per tile, w packed once into [K, 8] panels;
// - reduction: 8 rank rows x 8 feature columns per tile, streaming over the tokens;
// - update: 4 rows x 24 columns of y per tile, the rank loop innermost.
#include "kernels/narrow_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu_dispatch.h"

namespace qlora::kernels {

namespace {

constexpr int64_t kLanes = 8;

// Enough multiply-adds per parallel chunk that waking a second thread pays off.
int64_t grain_for(int64_t flops_per_item) { return std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, flops_per_item)); }

// w [K, R] (strides wk, wr) as ceil(R / 8) panels of [K, 8], zero past R.
std::vector<float> pack_panels(int64_t K, int64_t R, const float* w, int64_t wk, int64_t wr) {
  const int64_t panels = (R + kLanes - 1) / kLanes;
  std::vector<float> p(static_cast<size_t>(panels * K * kLanes), 0.0f);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < R; ++j) p[static_cast<size_t>(((j / kLanes) * K + k) * kLanes + j % kLanes)] = w[k * wk + j * wr];
  return p;
}

void product_rows_scalar(int64_t t0, int64_t t1, int64_t K, int64_t R, const float* x, int64_t ldx, const float* w,
                         int64_t wk, int64_t wr, float alpha, float* u, int64_t ldu) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t j = 0; j < R; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[t * ldx + k] * w[k * wk + j * wr];
      u[t * ldu + j] = alpha * s;
    }
}

void reduction_cols_scalar(int64_t k0, int64_t k1, int64_t T, int64_t R, const float* u, int64_t ldu, const float* x,
                           int64_t ldx, float alpha, float* g, int64_t ldg) {
  for (int64_t j = 0; j < R; ++j)
    for (int64_t k = k0; k < k1; ++k) {
      float s = 0.0f;
      for (int64_t t = 0; t < T; ++t) s += u[t * ldu + j] * x[t * ldx + k];
      g[j * ldg + k] = alpha * s;
    }
}

void update_rows_scalar(int64_t t0, int64_t t1, int64_t n0, int64_t R, int64_t N, const float* u, int64_t ldu,
                        const float* v, int64_t ldv, float alpha, float* y, int64_t ldy) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t n = n0; n < N; ++n) {
      float s = 0.0f;
      for (int64_t j = 0; j < R; ++j) s += u[t * ldu + j] * v[j * ldv + n];
      y[t * ldy + n] += alpha * s;
    }
}

#if defined(__x86_64__)
// acc[i] = sum over steps l < L of bc[i * bi + l * bl] * vec[l * vl .. + 8): M broadcast scalars
// times one vector per step, the shape of both the product and the reduction tiles.
template <int M>
QLORA_AVX2 inline void broadcast_fma(int64_t L, const float* bc, int64_t bi, int64_t bl, const float* vec, int64_t vl,
                                     __m256 (&acc)[M]) {
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t l = 0; l < L; ++l) {
    const __m256 v = _mm256_loadu_ps(vec + l * vl);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(bc + i * bi + l * bl), v, acc[i]);
  }
}

// MR rows of u (cols <= 8 of them written) from one [K, 8] panel.
template <int MR>
QLORA_AVX2 void product_tile(int64_t K, const float* x, int64_t ldx, const float* panel, float alpha, float* u,
                             int64_t ldu, int64_t cols) {
  __m256 acc[MR];
  broadcast_fma<MR>(K, x, ldx, 1, panel, kLanes, acc);
  const __m256 a = _mm256_set1_ps(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    alignas(32) float out[kLanes];
    _mm256_store_ps(out, _mm256_mul_ps(a, acc[i]));
    std::copy(out, out + cols, u + i * ldu);
  }
}

// RB rows of g, 8 columns, summed over all T tokens.
template <int RB>
QLORA_AVX2 void reduction_tile(int64_t T, const float* u, int64_t ldu, const float* x, int64_t ldx, float alpha,
                               float* g, int64_t ldg) {
  __m256 acc[RB];
  broadcast_fma<RB>(T, u, 1, ldu, x, ldx, acc);
  const __m256 a = _mm256_set1_ps(alpha);
#pragma GCC unroll 8
  for (int j = 0; j < RB; ++j) _mm256_storeu_ps(g + j * ldg, _mm256_mul_ps(a, acc[j]));
}

// MR rows x NV vectors of y += alpha * u v.
template <int MR, int NV>
QLORA_AVX2 void update_tile(int64_t R, const float* u, int64_t ldu, const float* v, int64_t ldv, float alpha, float* y,
                            int64_t ldy) {
  __m256 acc[MR][NV];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int q = 0; q < NV; ++q) acc[i][q] = _mm256_setzero_ps();
  for (int64_t j = 0; j < R; ++j) {
    __m256 vv[NV];
#pragma GCC unroll 3
    for (int q = 0; q < NV; ++q) vv[q] = _mm256_loadu_ps(v + j * ldv + q * kLanes);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 b = _mm256_broadcast_ss(u + i * ldu + j);
#pragma GCC unroll 3
      for (int q = 0; q < NV; ++q) acc[i][q] = _mm256_fmadd_ps(b, vv[q], acc[i][q]);
    }
  }
  const __m256 a = _mm256_set1_ps(alpha);
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int q = 0; q < NV; ++q) {
      float* p = y + i * ldy + q * kLanes;
      _mm256_storeu_ps(p, _mm256_fmadd_ps(a, acc[i][q], _mm256_loadu_ps(p)));
    }
}

// Calls f(std::integral_constant<int, M>{}) for the runtime m in 1..8.
template <class F> void with_rows(int64_t m, F&& f) {
  switch (m) {
    case 8: return f(std::integral_constant<int, 8>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

void product_rows_avx2(int64_t t0, int64_t t1, int64_t K, int64_t R, const float* x, int64_t ldx,
                       const std::vector<float>& panels, float alpha, float* u, int64_t ldu) {
  for (int64_t t = t0; t < t1; t += kLanes) {
    const int64_t rows = std::min(kLanes, t1 - t);
    for (int64_t c = 0; c * kLanes < R; ++c) {
      const int64_t cols = std::min(kLanes, R - c * kLanes);
      with_rows(rows, [&](auto mr) {
        product_tile<mr()>(K, x + t * ldx, ldx, panels.data() + c * K * kLanes, alpha, u + t * ldu + c * kLanes, ldu, cols);
      });
    }
  }
}

void reduction_cols_avx2(int64_t c0, int64_t c1, int64_t T, int64_t R, const float* u, int64_t ldu, const float* x,
                         int64_t ldx, float alpha, float* g, int64_t ldg) {
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t j = 0; j < R; j += kLanes)
      with_rows(std::min(kLanes, R - j), [&](auto rb) {
        reduction_tile<rb()>(T, u + j, ldu, x + c * kLanes, ldx, alpha, g + j * ldg + c * kLanes, ldg);
      });
}

void update_rows_avx2(int64_t t0, int64_t t1, int64_t R, int64_t N, const float* u, int64_t ldu, const float* v,
                      int64_t ldv, float alpha, float* y, int64_t ldy) {
  constexpr int64_t kRows = 4, kWide = 3 * kLanes;
  for (int64_t t = t0; t < t1; t += kRows) {
    const int64_t rows = std::min(kRows, t1 - t);
    with_rows(rows, [&](auto mr) {
      if constexpr (mr() <= kRows) {
        const float* ut = u + t * ldu;
        float* yt = y + t * ldy;
        int64_t n = 0;
        for (; n + kWide <= N; n += kWide) update_tile<mr(), 3>(R, ut, ldu, v + n, ldv, alpha, yt + n, ldy);
        for (; n + kLanes <= N; n += kLanes) update_tile<mr(), 1>(R, ut, ldu, v + n, ldv, alpha, yt + n, ldy);
        update_rows_scalar(t, t + mr(), n, R, N, u, ldu, v, ldv, alpha, y, ldy);
      }
    });
  }
}
#endif

}  // namespace

void narrow_product_cpu(int64_t T, int64_t K, int64_t R, const float* x, int64_t ldx, const float* w, int64_t wk,
                        int64_t wr, float alpha, float* u, int64_t ldu) {
  const int64_t grain = grain_for(2 * K * R);
#if defined(__x86_64__)
  if (active_isa() >= CpuIsa::kAvx2) {  // read per call: ScopedIsaCap may lower it
    const std::vector<float> panels = pack_panels(K, R, w, wk, wr);
    const int64_t blocks = (T + kLanes - 1) / kLanes;
    at::parallel_for(0, blocks, std::max<int64_t>(1, grain / kLanes), [&](int64_t b0, int64_t b1) {
      product_rows_avx2(b0 * kLanes, std::min(T, b1 * kLanes), K, R, x, ldx, panels, alpha, u, ldu);
    });
    return;
  }
#endif
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    product_rows_scalar(t0, t1, K, R, x, ldx, w, wk, wr, alpha, u, ldu);
  });
}

void narrow_reduction_cpu(int64_t T, int64_t R, int64_t K, const float* u, int64_t ldu, const float* x, int64_t ldx,
                          float alpha, float* g, int64_t ldg) {
  int64_t k_vec = 0;  // columns done by the vector path
#if defined(__x86_64__)
  if (active_isa() >= CpuIsa::kAvx2) {  // read per call: ScopedIsaCap may lower it
    k_vec = K / kLanes * kLanes;
    at::parallel_for(0, K / kLanes, std::max<int64_t>(1, grain_for(2 * T * R * kLanes)), [&](int64_t c0, int64_t c1) {
      reduction_cols_avx2(c0, c1, T, R, u, ldu, x, ldx, alpha, g, ldg);
    });
  }
#endif
  at::parallel_for(k_vec, K, grain_for(2 * T * R), [&](int64_t k0, int64_t k1) {
    reduction_cols_scalar(k0, k1, T, R, u, ldu, x, ldx, alpha, g, ldg);
  });
}

void narrow_update_cpu(int64_t T, int64_t R, int64_t N, const float* u, int64_t ldu, const float* v, int64_t ldv,
                       float alpha, float* y, int64_t ldy) {
  // y += alpha * u @ v adds nothing without rows, ranks or columns; and an empty u or v may be a
  // null pointer, which the row offsets below must not be applied to (UBSan: pointer overflow).
  if (T == 0 || R == 0 || N == 0) return;
  const int64_t grain = grain_for(2 * R * N);
#if defined(__x86_64__)
  if (active_isa() >= CpuIsa::kAvx2) {  // read per call: ScopedIsaCap may lower it
    at::parallel_for(0, (T + 3) / 4, std::max<int64_t>(1, grain / 4), [&](int64_t b0, int64_t b1) {
      update_rows_avx2(b0 * 4, std::min(T, b1 * 4), R, N, u, ldu, v, ldv, alpha, y, ldy);
    });
    return;
  }
#endif
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    update_rows_scalar(t0, t1, 0, R, N, u, ldu, v, ldv, alpha, y, ldy);
  });
}

}  // namespace qlora::kernels
