// The narrow products of kernels/narrow_cpu.h, written once over the N-lane vectors of
// kernels/simd.h and compiled per ISA (dispatch_isa: N = 16 on AVX-512, 8 on AVX2, 4 on SSE2):
// - product: dot products along K, a tile of rows of x against 4 rows of w^T (packed once);
// - reduction: up to 8 rank rows x N feature columns per tile, streaming over the tokens;
// - update: 4 rows x 3N columns of y per tile, the rank loop innermost.
// bf16 operands are widened as they are loaded; every sum is fp32, rounded once when stored.
#include "kernels/narrow_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

using simd::Vec;

// Enough multiply-adds per parallel chunk that waking a second thread pays off.
int64_t grain_for(int64_t flops_per_item) { return std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, flops_per_item)); }

constexpr int64_t kCols = 4;  // product: rows of w^T per tile

// Rows of the product tile: 4 with AVX-512's 32 registers (16 accumulators), 2 with 16.
template <int N> constexpr int64_t kProductRows = N >= 16 ? 4 : 2;

// w [K, R] (strides wk, wr) as w^T [Rp, K], Rp = R rounded up to kCols, zero rows past R.
template <class T> std::vector<T> pack_transposed(int64_t K, int64_t R, const T* w, int64_t wk, int64_t wr) {
  const int64_t rp = (R + kCols - 1) / kCols * kCols;
  std::vector<T> p(static_cast<size_t>(rp * K), T{});
  for (int64_t j = 0; j < R; ++j)
    for (int64_t k = 0; k < K; ++k) p[static_cast<size_t>(j * K + k)] = w[k * wk + j * wr];
  return p;
}

// u[i, j] = alpha * dot(x row i, wt row j) for i < rows, j < cols, along K. x rows past `rows`
// repeat the last one (computed, not written).
template <int N, class T>
QLORA_INLINE void product_tile(int64_t K, const T* x, int64_t ldx, int64_t rows, const T* wt, int64_t cols,
                               float alpha, T* u, int64_t ldu) {
  using V = Vec<N>;
  constexpr int64_t MR = kProductRows<N>;
  typename V::F acc[MR][kCols] = {};
  const T* xr[MR];
  for (int64_t i = 0; i < MR; ++i) xr[i] = x + std::min(i, rows - 1) * ldx;
  auto step = [&](int64_t k, auto load) QLORA_LAMBDA_INLINE {
    typename V::F w[kCols];
    for (int64_t j = 0; j < kCols; ++j) w[j] = load(wt + j * K + k);
    for (int64_t i = 0; i < MR; ++i) {
      const typename V::F xv = load(xr[i] + k);
      for (int64_t j = 0; j < kCols; ++j) acc[i][j] += xv * w[j];
    }
  };
  int64_t k = 0;
  for (; k + N <= K; k += N) step(k, [](const T* p) QLORA_LAMBDA_INLINE { return V::load(p); });
  if (k < K) step(k, [n = K - k](const T* p) QLORA_LAMBDA_INLINE { return V::load_part(p, n, 0.0f); });
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) simd::store_scalar(u + i * ldu + j, alpha * V::sum(acc[i][j]));
}

template <int N, class T>
QLORA_INLINE void product_rows(int64_t t0, int64_t t1, int64_t K, int64_t R, const T* x, int64_t ldx, const T* wt,
                               float alpha, T* u, int64_t ldu) {
  constexpr int64_t MR = kProductRows<N>;
  for (int64_t t = t0; t < t1; t += MR)
    for (int64_t c = 0; c < R; c += kCols)
      product_tile<N>(K, x + t * ldx, ldx, std::min(MR, t1 - t), wt + c * K, std::min(kCols, R - c), alpha,
                      u + t * ldu + c, ldu);
}

// Calls f(std::integral_constant<int, M>{}) for the runtime m in 1..8.
template <class F> QLORA_INLINE void with_rows(int64_t m, F&& f) {
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

// RB rows of g, `width` <= N columns, summed over all T tokens: acc[j] += u[t, j] * x[t, :].
template <int N, int RB, class T>
QLORA_INLINE void reduction_tile(int64_t T_, const T* u, int64_t ldu, const T* x, int64_t ldx, int64_t width,
                                 float alpha, T* g, int64_t ldg) {
  using V = Vec<N>;
  typename V::F acc[RB] = {};
  for (int64_t t = 0; t < T_; ++t) {
    const typename V::F xv = width == N ? V::load(x + t * ldx) : V::load_part(x + t * ldx, width, 0.0f);
    for (int j = 0; j < RB; ++j) acc[j] += V::splat(V::scalar(u[t * ldu + j])) * xv;
  }
  for (int j = 0; j < RB; ++j) {
    if (width == N) V::store(g + j * ldg, acc[j] * alpha);
    else V::store_part(g + j * ldg, acc[j] * alpha, width);
  }
}

template <int N, class T>
QLORA_INLINE void reduction_cols(int64_t c0, int64_t c1, int64_t T_, int64_t R, int64_t K, const T* u, int64_t ldu,
                                 const T* x, int64_t ldx, float alpha, T* g, int64_t ldg) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t width = std::min<int64_t>(N, K - c * N);
    for (int64_t j = 0; j < R; j += 8)
      with_rows(std::min<int64_t>(8, R - j), [&](auto rb) QLORA_LAMBDA_INLINE {
        reduction_tile<N, rb()>(T_, u + j, ldu, x + c * N, ldx, width, alpha, g + j * ldg + c * N, ldg);
      });
  }
}

// MR rows x NV vectors of y += alpha * u v; the last vector holds `width` <= N columns.
template <int N, int MR, int NV, class T>
QLORA_INLINE void update_tile(int64_t R, const T* u, int64_t ldu, const T* v, int64_t ldv, int64_t width, float alpha,
                              T* y, int64_t ldy) {
  using V = Vec<N>;
  auto load = [width](const T* p, int q) QLORA_LAMBDA_INLINE {
    return q == NV - 1 && width < N ? V::load_part(p, width, 0.0f) : V::load(p);
  };
  typename V::F acc[MR][NV] = {};
  for (int64_t j = 0; j < R; ++j) {
    typename V::F vv[NV];
    for (int q = 0; q < NV; ++q) vv[q] = load(v + j * ldv + q * N, q);
    for (int i = 0; i < MR; ++i) {
      const typename V::F b = V::splat(V::scalar(u[i * ldu + j]));
      for (int q = 0; q < NV; ++q) acc[i][q] += b * vv[q];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NV; ++q) {
      T* p = y + i * ldy + q * N;
      const typename V::F r = load(p, q) + acc[i][q] * alpha;
      if (q == NV - 1 && width < N) V::store_part(p, r, width);
      else V::store(p, r);
    }
}

template <int N, class T>
QLORA_INLINE void update_rows(int64_t t0, int64_t t1, int64_t R, int64_t Nc, const T* u, int64_t ldu, const T* v,
                              int64_t ldv, float alpha, T* y, int64_t ldy) {
  constexpr int64_t kRows = 4, kWide = 3 * N;
  for (int64_t t = t0; t < t1; t += kRows)
    with_rows(std::min(kRows, t1 - t), [&](auto mr) QLORA_LAMBDA_INLINE {
      if constexpr (mr() <= kRows) {
        const T* ut = u + t * ldu;
        T* yt = y + t * ldy;
        int64_t n = 0;
        for (; n + kWide <= Nc; n += kWide) update_tile<N, mr(), 3>(R, ut, ldu, v + n, ldv, N, alpha, yt + n, ldy);
        for (; n < Nc; n += N)
          update_tile<N, mr(), 1>(R, ut, ldu, v + n, ldv, std::min<int64_t>(N, Nc - n), alpha, yt + n, ldy);
      }
    });
}

template <class T>
void product(int64_t T_, int64_t K, int64_t R, const T* x, int64_t ldx, const T* w, int64_t wk, int64_t wr,
             float alpha, T* u, int64_t ldu) {
  if (T_ == 0 || R == 0) return;
  const std::vector<T> wt = pack_transposed(K, R, w, wk, wr);
  constexpr int64_t kBlock = 4;  // rows per parallel item: a multiple of every kProductRows
  at::parallel_for(0, (T_ + kBlock - 1) / kBlock, std::max<int64_t>(1, grain_for(2 * K * R) / kBlock),
                   [&](int64_t b0, int64_t b1) {
                     dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
                       product_rows<lanes<isa()>>(b0 * kBlock, std::min(T_, b1 * kBlock), K, R, x, ldx, wt.data(),
                                                  alpha, u, ldu);
                     });
                   });
}

template <class T>
void reduction(int64_t T_, int64_t R, int64_t K, const T* u, int64_t ldu, const T* x, int64_t ldx, float alpha, T* g,
               int64_t ldg) {
  const int64_t n = lanes_of(active_isa());
  at::parallel_for(0, (K + n - 1) / n, std::max<int64_t>(1, grain_for(2 * T_ * R * n)), [&](int64_t c0, int64_t c1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      reduction_cols<lanes<isa()>>(c0, c1, T_, R, K, u, ldu, x, ldx, alpha, g, ldg);
    });
  });
}

template <class T>
void update(int64_t T_, int64_t R, int64_t Nc, const T* u, int64_t ldu, const T* v, int64_t ldv, float alpha, T* y,
            int64_t ldy) {
  at::parallel_for(0, (T_ + 3) / 4, std::max<int64_t>(1, grain_for(2 * R * Nc) / 4), [&](int64_t b0, int64_t b1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      update_rows<lanes<isa()>>(b0 * 4, std::min(T_, b1 * 4), R, Nc, u, ldu, v, ldv, alpha, y, ldy);
    });
  });
}

}  // namespace

void narrow_product_cpu(int64_t T, int64_t K, int64_t R, const float* x, int64_t ldx, const float* w, int64_t wk,
                        int64_t wr, float alpha, float* u, int64_t ldu) {
  product(T, K, R, x, ldx, w, wk, wr, alpha, u, ldu);
}
void narrow_product_cpu(int64_t T, int64_t K, int64_t R, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t wk,
                        int64_t wr, float alpha, uint16_t* u, int64_t ldu) {
  product(T, K, R, x, ldx, w, wk, wr, alpha, u, ldu);
}

void narrow_reduction_cpu(int64_t T, int64_t R, int64_t K, const float* u, int64_t ldu, const float* x, int64_t ldx,
                          float alpha, float* g, int64_t ldg) {
  reduction(T, R, K, u, ldu, x, ldx, alpha, g, ldg);
}
void narrow_reduction_cpu(int64_t T, int64_t R, int64_t K, const uint16_t* u, int64_t ldu, const uint16_t* x,
                          int64_t ldx, float alpha, uint16_t* g, int64_t ldg) {
  reduction(T, R, K, u, ldu, x, ldx, alpha, g, ldg);
}

void narrow_update_cpu(int64_t T, int64_t R, int64_t N, const float* u, int64_t ldu, const float* v, int64_t ldv,
                       float alpha, float* y, int64_t ldy) {
  update(T, R, N, u, ldu, v, ldv, alpha, y, ldy);
}
void narrow_update_cpu(int64_t T, int64_t R, int64_t N, const uint16_t* u, int64_t ldu, const uint16_t* v,
                       int64_t ldv, float alpha, uint16_t* y, int64_t ldy) {
  update(T, R, N, u, ldu, v, ldv, alpha, y, ldy);
}

}  // namespace qlora::kernels
