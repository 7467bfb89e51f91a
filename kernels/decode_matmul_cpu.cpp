// decode_matmul_cpu.h's kernel. The tile: NJ weight rows x RR rows of x, one vector accumulator
// per pair, summed along k in vectors of the ISA's width (kernels/simd.h) and reduced across
// lanes at the end. Weight rows come straight from a dense W, or from a buffer of NJ rows decoded
// from NF4 (nf4_dequantize_blocks_f32_cpu) just before every row of x uses them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels/decode_matmul_cpu.h"
#include "kernels/nf4_cpu.h"
#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

// Weight rows per tile and x rows per tile: NJ * RR accumulators, NJ weight vectors and one x
// vector in registers (AVX-512: 24 + 4 + 1 of 32; AVX2: 8 + 2 + 1 of 16).
template <int L> constexpr int kNJ = L >= 16 ? 4 : 2;
template <int L> constexpr int kRR = L >= 16 ? 6 : 4;

// y[r, j] = sum_k x[r, k] * w[j, k] for r < RR, j < nj: w holds kNJ rows of K, row stride ldw
// (rows past nj are readable and never stored); K is a multiple of the vector width.
template <int L, int RR>
QLORA_INLINE void tile(int64_t K, const float* x, int64_t ldx, const float* w, int64_t ldw, int nj, float* y,
                       int64_t ldy) {
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
    for (int r = 0; r < RR; ++r) y[r * ldy + j] = out[j][r];
}

// Every row of x against the weight rows w (kNJ of them, row stride ldw; nj stored) into y.
template <int L>
QLORA_INLINE void all_rows(const DecodeMatmul& p, const float* w, int64_t ldw, int nj, float* y) {
  constexpr int RR = kRR<L>;
  int64_t m = 0;
  for (; m + RR <= p.M; m += RR) tile<L, RR>(p.K, p.x + m * p.ldx, p.ldx, w, ldw, nj, y + m * p.ldy, p.ldy);
  const float* x = p.x + m * p.ldx;
  y += m * p.ldy;
  switch (p.M - m) {  // the last rows of x, fewer than RR
    case 5: if constexpr (RR > 5) tile<L, 5>(p.K, x, p.ldx, w, ldw, nj, y, p.ldy); break;
    case 4: if constexpr (RR > 4) tile<L, 4>(p.K, x, p.ldx, w, ldw, nj, y, p.ldy); break;
    case 3: tile<L, 3>(p.K, x, p.ldx, w, ldw, nj, y, p.ldy); break;
    case 2: tile<L, 2>(p.K, x, p.ldx, w, ldw, nj, y, p.ldy); break;
    case 1: tile<L, 1>(p.K, x, p.ldx, w, ldw, nj, y, p.ldy); break;
    default: break;
  }
}

// Weight rows [n0, n1) against every row of x, kNJ at a time: a dense W's rows in place (the last,
// short group copied into buf, zero-padded), an NF4 W's decoded into buf.
template <int L>
QLORA_INLINE void rows(const DecodeMatmul& p, int64_t n0, int64_t n1, std::vector<float>& buf) {
  constexpr int NJ = kNJ<L>;
  const int64_t K = p.K;
  buf.assign(static_cast<size_t>(NJ * K), 0.0f);
  for (int64_t n = n0; n < n1; n += NJ) {
    const int nj = static_cast<int>(std::min<int64_t>(NJ, n1 - n));
    if (p.dense && nj == NJ) {
      all_rows<L>(p, p.dense + n * p.ldw, p.ldw, nj, p.y + n);
      continue;
    }
    if (p.dense) {
      for (int j = 0; j < nj; ++j) std::copy(p.dense + (n + j) * p.ldw, p.dense + (n + j) * p.ldw + K, buf.data() + j * K);
    } else {
      const int64_t per_row = K / p.layout.block_size;
      nf4_dequantize_blocks_f32_cpu(p.dtype, p.codes, p.scalers, p.factors, p.mean, p.layout, n * per_row,
                                    (n + nj) * per_row, buf.data());
    }
    if (nj < NJ) std::fill(buf.begin() + nj * K, buf.end(), 0.0f);  // the missing rows of the last group
    all_rows<L>(p, buf.data(), K, nj, p.y + n);
  }
}

}  // namespace

bool decode_matmul_takes_nf4(const nf4::Layout& layout, int64_t N, int64_t K) {
  return K > 0 && N > 0 && layout.block_size % 16 == 0 && K % layout.block_size == 0 && layout.numel == N * K;
}

void decode_matmul_cpu(const DecodeMatmul& p) {
  // At least 64k multiply-adds per chunk of weight rows before a second thread is worth waking.
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(1, p.M * p.K));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf;
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE { rows<lanes<decltype(isa)::value>>(p, n0, n1, buf); });
  });
}

}  // namespace qlora::kernels
