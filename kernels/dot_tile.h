// The register tile of the CPU products that take W's rows as they are (row-major, contiguous
// along K): y[r, j] = sum_k x[r, k] * w[j, k], kNJ weight rows x RR rows of x, one vector
// accumulator per pair summed along k in vectors of the ISA's width (kernels/simd.h) and reduced
// across lanes at the end (a fixed order). Elements are fp32 or bf16 (widened exactly on load; y
// rounded once). Used by decode_matmul_cpu (dense or NF4 W, few rows of x) and
// grouped_nf4_matmul_cpu (experts' NF4 W decoded a panel at a time).
#pragma once

#include <cstdint>

#include "kernels/simd.h"

namespace qlora::kernels::dot {

// Weight rows per tile and x rows per tile: NJ * RR accumulators, NJ weight vectors and one x
// vector in registers (AVX-512: 24 + 4 + 1 of 32; AVX2: 8 + 2 + 1 of 16).
template <int L> constexpr int kNJ = L >= 16 ? 4 : 2;
template <int L> constexpr int kRR = L >= 16 ? 6 : 4;

// y[r, j] for r < RR, j < nj: w holds kNJ rows of K, row stride ldw (rows past nj are readable and
// never stored); K is a multiple of the vector width L.
template <int L, int RR, class TX, class TW, class TY>
QLORA_INLINE void tile(int64_t K, const TX* x, int64_t ldx, const TW* w, int64_t ldw, int nj, TY* y, int64_t ldy) {
  using V = simd::Vec<L>;
  using F = typename V::F;
  constexpr int NJ = kNJ<L>;
  F acc[NJ][RR];
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 6
    for (int r = 0; r < RR; ++r) acc[j][r] = V::splat(0.0f);
  for (int64_t k = 0; k < K; k += L) {
    F wv[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) wv[j] = V::load(w + j * ldw + k);
#pragma GCC unroll 6
    for (int r = 0; r < RR; ++r) {
      const F xv = V::load(x + r * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[j][r] = xv * wv[j] + acc[j][r];
    }
  }
  float out[NJ][RR];  // every lane sum (straight-line code), then the nj rows stored
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 6
    for (int r = 0; r < RR; ++r) out[j][r] = V::sum(acc[j][r]);
  for (int j = 0; j < nj; ++j)
    for (int r = 0; r < RR; ++r) simd::store_scalar(y + r * ldy + j, out[j][r]);
}

// Calls f(std::integral_constant<int, R>{}, m) for the tiles of R rows covering [0, M): R = RR but
// for the last, shorter one.
template <int RR, class Fn> QLORA_INLINE void row_tail(int64_t rest, int64_t m, Fn& f) {
  if constexpr (RR > 0) {
    if (rest == RR) return f(std::integral_constant<int, RR>{}, m);
    row_tail<RR - 1>(rest, m, f);
  }
}
template <int RR, class Fn> QLORA_INLINE void row_tiles(int64_t M, Fn&& f) {
  int64_t m = 0;
  for (; m + RR <= M; m += RR) f(std::integral_constant<int, RR>{}, m);
  row_tail<RR - 1>(M - m, m, f);
}

// Every row of x [M, K] against the weight rows w (kNJ of them, row stride ldw; nj stored) into y.
template <int L, class TX, class TW, class TY>
QLORA_INLINE void all_rows(int64_t M, int64_t K, const TX* x, int64_t ldx, const TW* w, int64_t ldw, int nj, TY* y,
                           int64_t ldy) {
  row_tiles<kRR<L>>(M, [&](auto rr, int64_t m) QLORA_LAMBDA_INLINE {
    tile<L, decltype(rr)::value>(K, x + m * ldx, ldx, w, ldw, nj, y + m * ldy, ldy);
  });
}

}  // namespace qlora::kernels::dot
