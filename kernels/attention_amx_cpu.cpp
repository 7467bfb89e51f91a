// AMX flash-attention forward for kernels/attention_amx_cpu.h. Tiles 0-3 hold C (16 x 16 fp32),
// 4-5 A and 6-7 B (configure_tiles); their numbers are literals (GCC's tile intrinsics are
// assembler text).
#include "kernels/attention_amx_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#include <stdexcept>

#include "kernels/cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// GCC 12 warns that the intrinsics' own _mm512_undefined_ps() operands may be used uninitialized
// (GCC bug 105593): nothing of ours.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace qlora::kernels {

bool attention_amx_available() {
#if defined(__x86_64__)
  return cpu_features().amx_bf16 && active_isa() >= CpuIsa::kAvx512Bf16;
#else
  return false;
#endif
}

#if defined(__x86_64__)
namespace {

#define QLORA_AMX_TARGET "avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16"
#define QLORA_AMX __attribute__((target(QLORA_AMX_TARGET)))
#define QLORA_AMX_LAMBDA __attribute__((always_inline, target(QLORA_AMX_TARGET)))

constexpr int64_t kRows = 32;    // queries per block: two tiles' rows
constexpr int64_t kKeys = 512;   // keys per block, a multiple of 64
constexpr int64_t kPairs = 256;  // bf16 pairs (uint32) in one tile
constexpr int64_t kMaxD = 256;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A segment's shapes in the tiles' layouts: n rows, padded to a block of queries (rows_padded) and
// of keys (keys64); for v's columns d padded to dvt tiles of 16. The depth of q k^T (d, padded to
// dq) goes in nc chunks of kc (even, <= 32: one A tile's columns, a B tile's rows in pairs): d split
// evenly where it can be (the towers' 72 = 3 x 24: AMX's time follows the depth), else padded to 32s.
struct Dims {
  int64_t n, rows_padded, keys64, dq, nc, kc, dvt;
};

Dims dims_of(int64_t n, int64_t d) {
  const int64_t nc = (d + 31) / 32, even = d % nc == 0 && (d / nc) % 2 == 0 ? d / nc : 32;
  return {n, round_up(n, kRows), round_up(n, 64), nc * even, nc, even, round_up(d, 16) / 16};
}

// One head's operands in the tiles' layouts (padding zero), on the thread that computes it:
//   q [rows_padded][dq];
//   k [keys64 / 16][nc][kc / 2 d pairs][16 keys]: B tiles of q k^T;
//   v [keys64 / 32][dvt][16 key pairs][16 columns]: B tiles of p v.
// k and v hold bf16 pairs (low half first) as uint32. Kept per thread between calls (1.7 MB for a
// 3072-patch image at head dim 72): fresh pages each call cost more than the packing.
struct HeadPack {
  std::vector<uint16_t> q;
  std::vector<uint32_t> k, v;
};

// dst[0, width) = row `row` of head h of t (its d elements, then zeros), or zeros where absent.
void padded_row(const RowsHeads& t, int64_t row, bool present, int64_t h, int64_t d, int64_t width, uint16_t* dst) {
  if (present) std::memcpy(dst, t.data + row * t.row_stride + h * t.head_stride, static_cast<size_t>(d) * 2);
  std::fill(dst + (present ? d : 0), dst + width, uint16_t{0});
}

uint32_t pair_at(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void pack_head(const RowsHeads& q, const RowsHeads& k, const RowsHeads& v, int64_t start, int64_t h, int64_t d,
               const Dims& p, HeadPack& hp) {
  hp.q.resize(static_cast<size_t>(p.rows_padded * p.dq));
  hp.k.resize(static_cast<size_t>(p.keys64 * p.dq / 2));
  hp.v.resize(static_cast<size_t>(p.keys64 / 2 * p.dvt * 16));
  for (int64_t r = 0; r < p.rows_padded; ++r) padded_row(q, start + r, r < p.n, h, d, p.dq, hp.q.data() + r * p.dq);
  alignas(64) uint16_t rows[16][kMaxD];
  for (int64_t g = 0; g < p.keys64 / 16; ++g) {
    for (int64_t j = 0; j < 16; ++j) padded_row(k, start + g * 16 + j, g * 16 + j < p.n, h, d, p.dq, rows[j]);
    for (int64_t c = 0; c < p.nc; ++c) {
      uint32_t* tile = hp.k.data() + (g * p.nc + c) * p.kc * 8;  // [kc / 2 d pairs][16 keys]
      for (int64_t i = 0; i < p.kc / 2; ++i)
        for (int64_t j = 0; j < 16; ++j) tile[i * 16 + j] = pair_at(rows[j] + c * p.kc + 2 * i);
    }
  }
  const int64_t width = p.dvt * 16;
  for (int64_t pair = 0; pair < p.keys64 / 2; ++pair) {
    const int64_t k0 = 2 * pair;
    padded_row(v, start + k0, k0 < p.n, h, d, width, rows[0]);
    padded_row(v, start + k0 + 1, k0 + 1 < p.n, h, d, width, rows[1]);
    for (int64_t t = 0; t < p.dvt; ++t) {
      uint32_t* dst = hp.v.data() + ((pair / 16) * p.dvt + t) * kPairs + (pair % 16) * 16;  // [16 key pairs][16 columns]
      for (int64_t c = 0; c < 16; ++c) dst[c] = uint32_t{rows[0][t * 16 + c]} | uint32_t{rows[1][t * 16 + c]} << 16;
    }
  }
}

// One thread's buffers for a block of 32 queries.
struct alignas(64) Scratch {
  float s[kRows * kKeys];            // scores of one key block
  uint16_t p[kRows * kKeys];         // their probabilities, bf16
  float t[kRows * kMaxD];            // p v of one key block, [32][dvt * 16]
  float o[kRows * kMaxD];            // the output's running sums, [32][dvt * 16]
  float m[kRows], l[kRows], alpha[kRows];
};

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3 (C) 16 x 16 fp32; A (4-5) 16 rows of kc bf16, B (6-7) kc / 2 rows of 16 pairs: kc = 32
// for p v, the chunk depth for q k^T. (Loading a configuration zeroes every tile.)
QLORA_AMX void configure_tiles(int64_t kc) {
  TileConfig c{};
  c.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = static_cast<uint16_t>(i == 4 || i == 5 ? kc * 2 : 64);
    c.rows[i] = static_cast<uint8_t>(i >= 6 ? kc / 2 : 16);
  }
  _tile_loadconfig(&c);
}

// s [32][kKeys] = q rows (32 x dq) times the bk keys' B tiles (tile (g, c) at kt + (g * nc + c) * kc * 8):
// 2 x 2 tiles of C (tiles 0-3: rows 0-15 and 16-31 times keys g and g + 1), A in 4-5, B in 6-7.
QLORA_AMX void scores(const uint16_t* q, int64_t dq, int64_t nc, int64_t kc, const uint32_t* kt, int64_t bk, float* s) {
  const int64_t lda = dq * 2, ldc = kKeys * 4;
  for (int64_t g = 0; g < bk / 16; g += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < nc; ++c) {
      const uint32_t* b = kt + (g * nc + c) * kc * 8;
      _tile_loadd(4, q + c * kc, lda);
      _tile_loadd(6, b, 64);
      _tile_loadd(5, q + 16 * dq + c * kc, lda);
      _tile_loadd(7, b + nc * kc * 8, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, s + g * 16, ldc);
    _tile_stored(1, s + g * 16 + 16, ldc);
    _tile_stored(2, s + 16 * kKeys + g * 16, ldc);
    _tile_stored(3, s + 16 * kKeys + g * 16 + 16, ldc);
  }
}

// t [32][dvt * 16] = p [32][bk] times the bk keys' value tiles (tile (j, t) at vt + (j * dvt + t) * kPairs),
// two column tiles at a time: C in 0-3, A (p's rows 0-15 and 16-31) in 4-5, B in 6-7.
QLORA_AMX void values(const uint16_t* p, const uint32_t* vt, int64_t dvt, int64_t bk, float* t) {
  const int64_t lda = kKeys * 2, ldc = dvt * 16 * 4;
  for (int64_t c = 0; c < dvt; c += 2) {
    const bool two = c + 1 < dvt;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < bk / 32; ++j) {
      const uint32_t* b = vt + (j * dvt + c) * kPairs;
      _tile_loadd(4, p + j * 32, lda);
      _tile_loadd(6, b, 64);
      _tile_loadd(5, p + 16 * kKeys + j * 32, lda);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if (two) {
        _tile_loadd(7, b + kPairs, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* o = t + c * 16;
    _tile_stored(0, o, ldc);
    _tile_stored(2, o + 16 * dvt * 16, ldc);
    if (two) {
      _tile_stored(1, o + 16, ldc);
      _tile_stored(3, o + 16 * dvt * 16 + 16, ldc);
    }
  }
}

// 2^x for x <= 64 and not -inf (x = n + f, |f| <= 1/2: 2^f by a degree-4 polynomial fitted to it in
// relative error, 2.6e-6, far below the bf16 rounding of the probabilities; scaled by 2^n, which
// gives 0 below -150 however far). NaN stays NaN.
QLORA_AMX __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.5700943887e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917859729e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024745014e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312181485e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999926139e-1f));
  return _mm512_scalef_ps(p, n);
}

QLORA_AMX __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16{0xFFFF} : n <= 0 ? __mmask16{0} : static_cast<__mmask16>((1u << n) - 1u);
}

// A row's largest score among its first `valid` of bk.
QLORA_AMX float row_max(const float* s, int64_t bk, int64_t valid) {
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = none;
  for (int64_t c = 0; c < bk; c += 16) mx = _mm512_max_ps(_mm512_mask_loadu_ps(none, first_lanes(valid - c), s + c), mx);
  return _mm512_reduce_max_ps(mx);
}

// Masked-off lanes (keys past the segment) load this: finite (exp2_ps takes no -inf), so far below
// any score that its probability is 0.
constexpr float kNoKey = -1e30f;

// One pass of a row: p = 2^(s scale log2 e - ref) in bf16 (keys from `valid` on: 0); returns their sum.
QLORA_AMX float exp_row(const float* s, uint16_t* p, int64_t bk, int64_t valid, float scale_log2, float ref) {
  const __m512 none = _mm512_set1_ps(kNoKey);
  const __m512 sc = _mm512_set1_ps(scale_log2), r = _mm512_set1_ps(ref);
  __m512 sum = _mm512_setzero_ps();
  const auto step = [&](int64_t c, __m512 x0, __m512 x1) QLORA_AMX_LAMBDA {
    const __m512 p0 = exp2_ps(_mm512_fmsub_ps(x0, sc, r)), p1 = exp2_ps(_mm512_fmsub_ps(x1, sc, r));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    _mm512_storeu_si512(p + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
  };
  int64_t c = 0;
  for (; c + 32 <= std::min(bk, valid); c += 32) step(c, _mm512_loadu_ps(s + c), _mm512_loadu_ps(s + c + 16));
  for (; c < bk; c += 32)  // the segment's last keys, then padding
    step(c, _mm512_mask_loadu_ps(none, first_lanes(valid - c), s + c),
         _mm512_mask_loadu_ps(none, first_lanes(valid - c - 16), s + c + 16));
  return _mm512_reduce_add_ps(sum);
}

// The online softmax of one key block, row by row, against a reference m per row (log2 units; 0
// at the first block): kept while the row's sum so far stays within 2^-48 .. 2^48 (the
// probabilities and sums, fp32, are exact to a scale), else moved to the block's max and the
// earlier sums scaled by alpha. Attention logits within +-33 of 0 never move it: no pass for the
// max. A NaN score gives NaN probabilities, and so NaN outputs, in its row.
QLORA_AMX void softmax_block(Scratch& w, int64_t bk, int64_t valid, float scale_log2) {
  constexpr float kHigh = 281474976710656.0f, kLow = 1.0f / kHigh;  // 2^48, 2^-48
  for (int64_t r = 0; r < kRows; ++r) {
    const float* s = w.s + r * kKeys;
    uint16_t* p = w.p + r * kKeys;
    float& m = w.m[r];
    float sum = exp_row(s, p, bk, valid, scale_log2, m);
    w.alpha[r] = 1.0f;
    const float total = w.l[r] + sum;
    if (total >= kHigh || total < kLow) {  // (not for NaN)
      // Too high: a score far above m; the block's max exceeds it. Too low: every score so far far
      // below m; the block's max the better reference, but not below the sum already there (earlier
      // keys may have scored above this block's: their sum, rescaled, stays <= 1). No sum yet: none to scale.
      float top = row_max(s, bk, valid) * scale_log2;
      if (total > 0.0f && total < kLow) top = std::max(top, m + std::log2(total));
      w.alpha[r] = w.l[r] > 0.0f ? std::exp2(m - top) : 0.0f;
      m = top;
      sum = exp_row(s, p, bk, valid, scale_log2, m);
    }
    w.l[r] = w.l[r] * w.alpha[r] + sum;
  }
}

// o[r] = o[r] alpha[r] + t[r], rows of ldo.
QLORA_AMX void accumulate(Scratch& w, int64_t ldo) {
  for (int64_t r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(w.alpha[r]);
    float* o = w.o + r * ldo;
    const float* t = w.t + r * ldo;
    for (int64_t c = 0; c < ldo; c += 16)
      _mm512_storeu_ps(o + c, _mm512_fmadd_ps(_mm512_loadu_ps(o + c), a, _mm512_loadu_ps(t + c)));
  }
}

// The block's first `rows` outputs, o / l rounded to bf16, at out + r * out_ld.
QLORA_AMX void finish(const Scratch& w, int64_t rows, int64_t d, int64_t ldo, uint16_t* out, int64_t out_ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / w.l[r]);
    for (int64_t c = 0; c < d; c += 16) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w.o + r * ldo + c), inv));
      _mm256_mask_storeu_epi16(out + r * out_ld + c, first_lanes(d - c), reinterpret_cast<__m256i>(b));
    }
  }
}

// Queries qb * 32 .. + 31 of the packed head against every key of the segment.
QLORA_AMX void attend_block(const Dims& p, const HeadPack& hp, int64_t qb, int64_t d, float scale_log2, Scratch& w,
                            uint16_t* out, int64_t out_ld) {
  const uint16_t* q = hp.q.data() + qb * kRows * p.dq;
  const int64_t ldo = p.dvt * 16;
  std::fill(w.m, w.m + kRows, 0.0f);
  std::fill(w.l, w.l + kRows, 0.0f);
  std::fill(w.o, w.o + kRows * ldo, 0.0f);
  for (int64_t kb = 0; kb < p.keys64; kb += kKeys) {
    const int64_t bk = std::min(kKeys, p.keys64 - kb);
    if (p.kc != 32) configure_tiles(p.kc);
    scores(q, p.dq, p.nc, p.kc, hp.k.data() + (kb / 16) * p.nc * p.kc * 8, bk, w.s);
    softmax_block(w, bk, p.n - kb, scale_log2);
    if (p.kc != 32) configure_tiles(32);
    values(w.p, hp.v.data() + (kb / 32) * p.dvt * kPairs, p.dvt, bk, w.t);
    accumulate(w, ldo);
  }
  finish(w, std::min(kRows, p.n - qb * kRows), d, ldo, out, out_ld);
}

// Work items i0 .. i1 - 1 (item = head * blocks + query block) of the segment at `start`, on this
// thread's tiles, packing each head it reaches.
QLORA_AMX void attend_items(const RowsHeads& q, const RowsHeads& k, const RowsHeads& v, int64_t start, const Dims& p,
                            int64_t i0, int64_t i1, int64_t heads, int64_t d, float scale_log2, uint16_t* out) {
  static thread_local HeadPack hp;
  static thread_local std::unique_ptr<Scratch> w;
  if (!w) w = std::make_unique<Scratch>();
  const int64_t blocks = p.rows_padded / kRows;
  int64_t packed = -1;
  configure_tiles(32);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t h = i / blocks, qb = i % blocks;
    if (h != packed) {
      pack_head(q, k, v, start, h, d, p, hp);
      packed = h;
    }
    attend_block(p, hp, qb, d, scale_log2, *w, out + (qb * kRows * heads + h) * d, heads * d);
  }
  _tile_release();
}

}  // namespace

void segment_attention_amx(RowsHeads q, RowsHeads k, RowsHeads v, int64_t heads, int64_t d, const int64_t* segments,
                           int64_t n_segments, float scale, uint16_t* out) {
  if (!attention_amx_available()) throw std::logic_error("segment_attention_amx: AMX-BF16 is not available");
  if (d < 1 || d > kMaxD) throw std::invalid_argument("segment_attention_amx: head dim must be 1..256");
  const float scale_log2 = scale * static_cast<float>(M_LOG2E);
  int64_t start = 0;
  for (int64_t s = 0; s < n_segments; ++s) {
    const int64_t n = segments[s];
    if (n <= 0) continue;
    const Dims p = dims_of(n, d);
    uint16_t* seg_out = out + start * heads * d;
    at::parallel_for(0, heads * (p.rows_padded / kRows), 1, [&](int64_t i0, int64_t i1) {
      attend_items(q, k, v, start, p, i0, i1, heads, d, scale_log2, seg_out);
    });
    start += n;
  }
}

#else  // not x86-64: attention_amx_available() is false

void segment_attention_amx(RowsHeads, RowsHeads, RowsHeads, int64_t, int64_t, const int64_t*, int64_t, float,
                           uint16_t*) {
  throw std::logic_error("segment_attention_amx: AMX-BF16 is not available");
}

#endif

}  // namespace qlora::kernels
