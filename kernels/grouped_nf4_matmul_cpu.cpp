// grouped_nf4_matmul_cpu.h's kernel. Threads take work items (group, tile of W or rows of x) one
// at a time, in group order, so an expert with many rows or a busy core leaves no thread idle;
// each thread runs its items with buffers of its own:
// - forward: W's 32-row panel decoded (x's dtype), then x's rows RR at a time against the panel's
//   rows NJ at a time (the x tile stays in L1, the panel in L2);
// - transposed: fp32 accumulators [rows, K] for the item's (at most 64) rows of x; W's rows decoded
//   64 at a time (whole rows, one call), every tile of RR rows of x adding x[r, n] * W[n, c] into
//   its accumulators of 64 columns c.
// On AVX512_BF16 with bf16 operands the products are vdpbf16ps: forward as dot products of 32
// bf16 of x and W (adjacent k summed in pairs), transposed with W's rows interleaved in pairs
// (W[n, c], W[n + 1, c]) against x's pair (x[r, n], x[r, n + 1]) broadcast.
#include "kernels/grouped_nf4_matmul_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu_dispatch.h"
#include "kernels/dot_tile.h"
#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

constexpr int64_t kPanelRows = 32;  // forward: W rows an item decodes (a multiple of dot::kNJ)
constexpr int64_t kItemRows = 64;   // transposed: x rows an item owns (W decoded once for them)
constexpr int64_t kChunkRows = 64;  // transposed: W rows decoded at a time (even)
constexpr int64_t kTileCols = 64;   // transposed: W columns one tile of accumulators spans

// x rows per tile of the transposed product: RR x 4 accumulators, 4 weight vectors and x's
// broadcast in registers (AVX-512: 24 + 4 + 1 of 32; AVX2: 8 + 4 + 1 of 16).
template <int L> constexpr int kAxpyRR = L >= 16 ? 6 : 2;
constexpr int kAxpyVectors = 4;

struct Item {
  int64_t group, start;  // start: the item's first W row (forward) or x row of the group (transposed)
};

// A transposed item's rows of x: [start, start + item_rows).
int64_t item_rows(const GroupedNf4Matmul& p, Item it) { return std::min(kItemRows, p.counts[it.group] - it.start); }

// The work buffers of one thread.
template <class T> struct Scratch {
  std::vector<T> panel;  // forward: [kPanelRows, K]; transposed: [kChunkRows, K]
  std::vector<T> tile;  // transposed: one column tile of the panel, [kChunkRows, kTileCols]
  std::vector<float> acc;  // transposed: [K / kTileCols, item_rows, kTileCols], a tile's contiguous
  std::vector<uint16_t> pairs;  // transposed on AVX512_BF16: [kChunkRows / 2, kTileCols, 2]
};

// W's rows [r0, r1), columns [c0, c0 + kc) (whole blocks), as T (fp32, or bf16 bits) into out,
// row stride ld: nf4_dequantize_cpu's values.
template <class T>
void decode(const Nf4Operand& w, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t kc, T* out, int64_t ld) {
  constexpr nf4::Dtype kOut = std::is_same_v<T, float> ? nf4::Dtype::F32 : nf4::Dtype::BF16;
  const int64_t bs = w.layout.block_size, per_row = K / bs;
  if (kc == K && ld == K) return nf4_dequantize_blocks_cpu(w, kOut, r0 * per_row, r1 * per_row, out);
  for (int64_t r = r0; r < r1; ++r)
    nf4_dequantize_blocks_cpu(w, kOut, r * per_row + c0 / bs, r * per_row + (c0 + kc) / bs, out + (r - r0) * ld);
}

template <class T> const T* rows_of(const GroupedNf4Matmul& p, const void* base, int64_t ld, int64_t g) {
  return static_cast<const T*>(base) + p.offsets[g] * ld;
}

// Forward: W_g's panel [rows, K] decoded into s.panel, zero rows up to a multiple of nj_max.
template <class T> int64_t decode_panel(const GroupedNf4Matmul& p, Item it, int nj_max, Scratch<T>& s) {
  const int64_t K = p.K, rows = std::min(kPanelRows, p.N - it.start);
  s.panel.resize(static_cast<size_t>(kPanelRows * K));
  decode<T>(p.weights[it.group], K, it.start, it.start + rows, 0, K, s.panel.data(), K);
  const int64_t padded = (rows + nj_max - 1) / nj_max * nj_max;
  std::fill(s.panel.begin() + rows * K, s.panel.begin() + padded * K, T{0});
  return rows;
}

template <int L, class T> QLORA_INLINE void forward_item(const GroupedNf4Matmul& p, Item it, Scratch<T>& s) {
  constexpr int NJ = dot::kNJ<L>;
  const int64_t K = p.K, rows = decode_panel(p, it, NJ, s);
  const T* x = rows_of<T>(p, p.x, p.ldx, it.group);
  T* y = const_cast<T*>(rows_of<T>(p, p.y, p.ldy, it.group)) + it.start;
  dot::row_tiles<dot::kRR<L>>(p.counts[it.group], [&](auto rr, int64_t m) QLORA_LAMBDA_INLINE {
    for (int64_t j = 0; j < rows; j += NJ)
      dot::tile<L, decltype(rr)::value>(K, x + m * p.ldx, p.ldx, s.panel.data() + j * K, K,
                                         static_cast<int>(std::min<int64_t>(NJ, rows - j)), y + m * p.ldy + j, p.ldy);
  });
}

// acc [RR, kTileCols] (row stride lda) += x [RR, nc] (row stride ldx) @ w [nc, kTileCols] (row stride ldw).
template <int L, int RR, class T>
QLORA_INLINE void axpy_tile(int64_t nc, const T* x, int64_t ldx, const T* w, int64_t ldw, float* acc, int64_t lda) {
  using V = simd::Vec<L>;
  using F = typename V::F;
  constexpr int KB = kAxpyVectors;
  for (int64_t c0 = 0; c0 < kTileCols; c0 += KB * L) {
    F a[RR][KB];
#pragma GCC unroll 6
    for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < KB; ++v) a[r][v] = V::load(acc + r * lda + c0 + v * L);
    for (int64_t n = 0; n < nc; ++n) {
      F wv[KB];
#pragma GCC unroll 4
      for (int v = 0; v < KB; ++v) wv[v] = V::load(w + n * ldw + c0 + v * L);
#pragma GCC unroll 6
      for (int r = 0; r < RR; ++r) {
        // x - 0 is x for every x (-0 too), and one broadcast: V::splat's lane loop on a value
        // just loaded becomes 16 masked broadcasts here (GCC 12).
        const F xs = V::scalar(x[r * ldx + n]) - F{};
#pragma GCC unroll 4
        for (int v = 0; v < KB; ++v) a[r][v] = xs * wv[v] + a[r][v];
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < KB; ++v) V::store(acc + r * lda + c0 + v * L, a[r][v]);
  }
}

// A transposed item's rows of y [rows, K] from its fp32 accumulators (Scratch::acc), one rounding to T.
template <int L, class T> QLORA_INLINE void store_acc(const GroupedNf4Matmul& p, Item it, const float* acc) {
  using V = simd::Vec<L>;
  const int64_t M = item_rows(p, it);
  T* y = const_cast<T*>(rows_of<T>(p, p.y, p.ldy, it.group)) + it.start * p.ldy;
  for (int64_t c0 = 0; c0 < p.K; c0 += kTileCols, acc += M * kTileCols)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < kTileCols; c += L) V::store(y + m * p.ldy + c0 + c, V::load(acc + m * kTileCols + c));
}

// Transposed: the item's accumulators [rows, K] zeroed, then per chunk of nc rows of W (decoded
// whole in one call) every 64-column tile of it: tile(w [nc, 64] at row stride K, nc, x's rows at
// the chunk's first column, the tile's accumulators [rows, 64], rows).
template <class T, class TileFn>
QLORA_INLINE void transposed_chunks(const GroupedNf4Matmul& p, Item it, Scratch<T>& s, TileFn&& tile) {
  const int64_t M = item_rows(p, it), K = p.K;
  const T* x = rows_of<T>(p, p.x, p.ldx, it.group) + it.start * p.ldx;
  s.acc.assign(static_cast<size_t>(M * K), 0.0f);
  s.panel.resize(static_cast<size_t>(kChunkRows * K));
  for (int64_t n0 = 0; n0 < p.N; n0 += kChunkRows) {
    const int64_t nc = std::min(kChunkRows, p.N - n0);
    decode<T>(p.weights[it.group], K, n0, n0 + nc, 0, K, s.panel.data(), K);
    for (int64_t c0 = 0; c0 < K; c0 += kTileCols) tile(s.panel.data() + c0, nc, x + n0, s.acc.data() + c0 * M, M);
  }
}

template <int L, class T> QLORA_INLINE void transposed_item(const GroupedNf4Matmul& p, Item it, Scratch<T>& s) {
  s.tile.resize(static_cast<size_t>(kChunkRows * kTileCols));
  transposed_chunks(p, it, s, [&](const T* w, int64_t nc, const T* x, float* acc, int64_t M) QLORA_LAMBDA_INLINE {
    // The tile's rows copied together: rows K apart in the panel would share the cache's sets.
    for (int64_t n = 0; n < nc; ++n) std::copy_n(w + n * p.K, kTileCols, s.tile.data() + n * kTileCols);
    dot::row_tiles<kAxpyRR<L>>(M, [&](auto rr, int64_t m) QLORA_LAMBDA_INLINE {
      axpy_tile<L, decltype(rr)::value>(nc, x + m * p.ldx, p.ldx, s.tile.data(), kTileCols, acc + m * kTileCols,
                                        kTileCols);
    });
  });
  store_acc<L, T>(p, it, s.acc.data());
}

#if defined(__x86_64__)
// ---- bf16 operands on AVX512_BF16 ----------------------------------------------------------

QLORA_AVX512_BF16 QLORA_INLINE __m512bh load_bf16(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// v's lanes summed in simd::Vec<16>::sum's order (halves added as vectors down to 4 lanes), here
// rather than through it: clang refuses to pass a 512-bit vector from this target's functions to a
// function without it, and the extract intrinsics start from undefined registers (GCC 12 warns).
QLORA_AVX512_BF16 QLORA_INLINE float lane_sum(__m512 v) {
  __m256 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof lo8);
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof lo8, sizeof hi8);
  const __m256 s8 = _mm256_add_ps(lo8, hi8);
  __m128 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof lo4);
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof lo4, sizeof hi4);
  float s[4];
  _mm_storeu_ps(s, _mm_add_ps(lo4, hi4));
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// y[r, j] for r < RR, j < nj of 4 weight rows (row stride ldw): K a multiple of 32.
template <int RR>
QLORA_AVX512_BF16 QLORA_INLINE void dot_tile_bf16(int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* w,
                                                  int64_t ldw, int nj, uint16_t* y, int64_t ldy) {
  __m512 acc[4][RR];
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < RR; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load_bf16(w + j * ldw + k);
    for (int r = 0; r < RR; ++r) {
      const __m512bh xv = load_bf16(x + r * ldx + k);
      for (int j = 0; j < 4; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], xv, wv[j]);
    }
  }
  for (int j = 0; j < nj; ++j)
    for (int r = 0; r < RR; ++r) y[r * ldy + j] = bf16::from_float(lane_sum(acc[j][r]));
}

// The panel's rows (4 at a time) against x's rows m .. m + RR.
template <int RR>
QLORA_AVX512_BF16 QLORA_INLINE void panel_rows_bf16(const GroupedNf4Matmul& p, const uint16_t* x, const uint16_t* panel,
                                                    int64_t rows, uint16_t* y) {
  for (int64_t j = 0; j < rows; j += 4)
    dot_tile_bf16<RR>(p.K, x, p.ldx, panel + j * p.K, p.K, static_cast<int>(std::min<int64_t>(4, rows - j)), y + j,
                      p.ldy);
}

QLORA_AVX512_BF16 void forward_item_bf16(const GroupedNf4Matmul& p, Item it, Scratch<uint16_t>& s) {
  const int64_t rows = decode_panel(p, it, 4, s);
  const uint16_t* x = rows_of<uint16_t>(p, p.x, p.ldx, it.group);
  uint16_t* y = const_cast<uint16_t*>(rows_of<uint16_t>(p, p.y, p.ldy, it.group)) + it.start;
  // The tails spelled out: a lambda (dot::row_tiles) would not carry this function's target to the intrinsics.
  const int64_t M = p.counts[it.group];
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) panel_rows_bf16<6>(p, x + m * p.ldx, s.panel.data(), rows, y + m * p.ldy);
  const uint16_t* xm = x + m * p.ldx;
  uint16_t* ym = y + m * p.ldy;
  switch (M - m) {
    case 5: panel_rows_bf16<5>(p, xm, s.panel.data(), rows, ym); break;
    case 4: panel_rows_bf16<4>(p, xm, s.panel.data(), rows, ym); break;
    case 3: panel_rows_bf16<3>(p, xm, s.panel.data(), rows, ym); break;
    case 2: panel_rows_bf16<2>(p, xm, s.panel.data(), rows, ym); break;
    case 1: panel_rows_bf16<1>(p, xm, s.panel.data(), rows, ym); break;
    default: break;
  }
}

// W's rows [nc, kTileCols] (nc even, row stride ld) into pairs [nc / 2, kTileCols, 2]: (W[2i, c], W[2i + 1, c]).
QLORA_AVX512_BF16 void interleave_pairs(const uint16_t* rows, int64_t ld, int64_t nc, uint16_t* pairs) {
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = static_cast<uint16_t>(i), lo_idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    hi_idx[2 * i] = static_cast<uint16_t>(16 + i), hi_idx[2 * i + 1] = static_cast<uint16_t>(48 + i);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t i = 0; i < nc / 2; ++i)
    for (int64_t h = 0; h < kTileCols; h += 32) {
      const __m512i a = _mm512_loadu_si512(rows + 2 * i * ld + h), b = _mm512_loadu_si512(rows + (2 * i + 1) * ld + h);
      _mm512_storeu_si512(pairs + i * 2 * kTileCols + 2 * h, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(pairs + i * 2 * kTileCols + 2 * h + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// acc [RR, 64] (row stride lda) += x [RR, nc] @ W [nc, 64], W as interleave_pairs left it.
template <int RR>
QLORA_AVX512_BF16 QLORA_INLINE void pair_tile(int64_t nc, const uint16_t* x, int64_t ldx, const uint16_t* pairs,
                                              float* acc, int64_t lda) {
  __m512 a[RR][4];
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = _mm512_loadu_ps(acc + r * lda + v * 16);
  for (int64_t i = 0; i < nc / 2; ++i) {
    __m512bh wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = load_bf16(pairs + i * 2 * kTileCols + v * 32);
    for (int r = 0; r < RR; ++r) {
      uint32_t two;
      std::memcpy(&two, x + r * ldx + 2 * i, sizeof two);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(two)));
      for (int v = 0; v < 4; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], xv, wv[v]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc + r * lda + v * 16, a[r][v]);
}

// Every tile of RR rows of x [M, nc] (row stride ldx) against one 64-column tile of pairs.
QLORA_AVX512_BF16 void pair_rows(int64_t M, int64_t nc, const uint16_t* x, int64_t ldx, const uint16_t* pairs,
                                 float* acc, int64_t lda) {
  int64_t m = 0;  // the tails spelled out, as in forward_item_bf16
  for (; m + 6 <= M; m += 6) pair_tile<6>(nc, x + m * ldx, ldx, pairs, acc + m * lda, lda);
  const uint16_t* xm = x + m * ldx;
  float* am = acc + m * lda;
  switch (M - m) {
    case 5: pair_tile<5>(nc, xm, ldx, pairs, am, lda); break;
    case 4: pair_tile<4>(nc, xm, ldx, pairs, am, lda); break;
    case 3: pair_tile<3>(nc, xm, ldx, pairs, am, lda); break;
    case 2: pair_tile<2>(nc, xm, ldx, pairs, am, lda); break;
    case 1: pair_tile<1>(nc, xm, ldx, pairs, am, lda); break;
    default: break;
  }
}

QLORA_AVX512_BF16 void transposed_item_bf16(const GroupedNf4Matmul& p, Item it, Scratch<uint16_t>& s) {
  s.pairs.resize(static_cast<size_t>(kChunkRows * kTileCols));
  transposed_chunks(p, it, s, [&](const uint16_t* w, int64_t nc, const uint16_t* x, float* acc, int64_t M) {
    interleave_pairs(w, p.K, nc, s.pairs.data());
    pair_rows(M, nc, x, p.ldx, s.pairs.data(), acc, kTileCols);
  });
  store_acc<16, uint16_t>(p, it, s.acc.data());
}
#endif

// The items the calling thread takes from `next` (the first not yet taken) until none is left: a
// thread slowed down (a busy core) takes fewer, and none waits on a share fixed in advance. Which
// thread runs an item never changes what it computes.
template <class T> void run_items(const GroupedNf4Matmul& p, const std::vector<Item>& items, std::atomic<size_t>& next) {
  Scratch<T> s;
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (active_isa() == CpuIsa::kAvx512Bf16) {
      for (size_t i = next++; i < items.size(); i = next++) {
        if (p.transposed) transposed_item_bf16(p, items[i], s);
        else forward_item_bf16(p, items[i], s);
      }
      return;
    }
  }
#endif
  dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
    constexpr int L = lanes<decltype(isa)::value>;
    for (size_t i = next++; i < items.size(); i = next++) {
      if (p.transposed) transposed_item<L>(p, items[i], s);
      else forward_item<L>(p, items[i], s);
    }
  });
}

}  // namespace

bool grouped_nf4_matmul_takes(const nf4::Layout& layout, int64_t N, int64_t K) {
  const int64_t bs = layout.block_size;
  return N > 0 && K > 0 && N % 2 == 0 && K % kTileCols == 0 && bs % 16 == 0 && kTileCols % bs == 0 &&
         layout.numel == N * K;
}

void grouped_nf4_matmul_cpu(const GroupedNf4Matmul& p) {
  // Forward: W's panels of kPanelRows rows, each against all of the group's rows; transposed: the
  // group's rows kItemRows at a time, each against all of W. In group order, so that a thread
  // taking the next item mostly stays on one group's rows and weight.
  std::vector<Item> items;
  int64_t rows = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    rows += p.counts[g];
    if (p.transposed)
      for (int64_t s = 0; s < p.counts[g]; s += kItemRows) items.push_back({g, s});
    else
      for (int64_t s = 0; p.counts[g] > 0 && s < p.N; s += kPanelRows) items.push_back({g, s});
  }
  // At least ~1M multiply-adds a thread before a second one is woken.
  const int64_t threads = std::clamp<int64_t>(rows * p.N * p.K >> 20, 1, at::get_num_threads());
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if (p.dtype == nf4::Dtype::BF16) run_items<uint16_t>(p, items, next);
    else run_items<float>(p, items, next);
  });
}

}  // namespace qlora::kernels
