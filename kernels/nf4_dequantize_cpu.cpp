// NF4 dequantize on CPU. Per block, the 16 possible outputs are computed once (exactly as the
// reference does, in the NF4 dtype, then converted to the output dtype); the codes then only
// index that table: on AVX-512 one permute (vpermps, vpermw) per 16 or 32 codes; otherwise
// two SSSE3 byte shuffles per 16 codes for 16-bit outputs (VEX-encoded on AVX2), AVX2 permutes
// for float.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "kernels/nf4_cpu.h"
#include "kernels/simd.h"
#include "quant/nf4_reference.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace qlora::kernels {

namespace {

using nf4::Dtype;
using nf4::Layout;

constexpr int64_t kGrainBlocks = 1024;

// out[2j] = table[codes[j] >> 4], out[2j + 1] = table[codes[j] & 15], j < nbytes.
template <class T>
void expand_scalar(const uint8_t* codes, int64_t nbytes, const T* table, T* out) {
  for (int64_t j = 0; j < nbytes; ++j) {
    out[2 * j] = table[codes[j] >> 4];
    out[2 * j + 1] = table[codes[j] & 15];
  }
}

#if defined(__x86_64__)
// Two byte shuffles per 16 codes; compiled twice (below): legacy SSE encoding and VEX encoding.
__attribute__((target("ssse3"))) QLORA_INLINE void expand16_shuffles(const uint8_t* codes, int64_t nbytes,
                                                                     const uint16_t* table, uint16_t* out) {
  alignas(16) uint8_t lo_bytes[16], hi_bytes[16];
  for (int i = 0; i < 16; ++i) {
    lo_bytes[i] = static_cast<uint8_t>(table[i] & 0xff);
    hi_bytes[i] = static_cast<uint8_t>(table[i] >> 8);
  }
  const __m128i tlo = _mm_load_si128(reinterpret_cast<const __m128i*>(lo_bytes));
  const __m128i thi = _mm_load_si128(reinterpret_cast<const __m128i*>(hi_bytes));
  const __m128i nibble = _mm_set1_epi8(0x0f);
  int64_t j = 0;
  for (; j + 16 <= nbytes; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);  // even elements
    const __m128i lo = _mm_and_si128(b, nibble);                     // odd elements
    const __m128i ev_l = _mm_shuffle_epi8(tlo, hi), ev_h = _mm_shuffle_epi8(thi, hi);
    const __m128i od_l = _mm_shuffle_epi8(tlo, lo), od_h = _mm_shuffle_epi8(thi, lo);
    const __m128i ev0 = _mm_unpacklo_epi8(ev_l, ev_h), ev1 = _mm_unpackhi_epi8(ev_l, ev_h);
    const __m128i od0 = _mm_unpacklo_epi8(od_l, od_h), od1 = _mm_unpackhi_epi8(od_l, od_h);
    auto* o = reinterpret_cast<__m128i*>(out + 2 * j);
    _mm_storeu_si128(o + 0, _mm_unpacklo_epi16(ev0, od0));
    _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(ev0, od0));
    _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(ev1, od1));
    _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(ev1, od1));
  }
  expand_scalar(codes + j, nbytes - j, table, out + 2 * j);
}
__attribute__((target("ssse3"))) void expand16_ssse3(const uint8_t* codes, int64_t nbytes, const uint16_t* table,
                                                     uint16_t* out) {
  expand16_shuffles(codes, nbytes, table, out);
}
// The AVX2 table loops leave the upper halves of the ymm registers dirty: legacy SSE code called
// between them pays an SSE/AVX state transition per block (5x the whole dequantize on Zen 3, once
// the compiler kept vector constants live across the calls). VEX-encoded, the same shuffles pay none.
QLORA_AVX2 void expand16_avx2(const uint8_t* codes, int64_t nbytes, const uint16_t* table, uint16_t* out) {
  expand16_shuffles(codes, nbytes, table, out);
}
const bool kHaveSsse3 = __builtin_cpu_supports("ssse3");

// float outputs: the 16-entry table is two 8-lane registers; permutevar picks within each by
// the low 3 index bits and a blend on bit 3 chooses between them.
QLORA_AVX2 QLORA_INLINE void lookup8_avx2(__m256 t_lo, __m256 t_hi,
                                                                         __m256i idx, float* o) {
  const __m256 lo = _mm256_permutevar8x32_ps(t_lo, idx), hi = _mm256_permutevar8x32_ps(t_hi, idx);
  const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
  _mm256_storeu_ps(o, _mm256_blendv_ps(lo, hi, upper));
}

QLORA_AVX2 QLORA_INLINE void expand32_avx2(const uint8_t* codes, int64_t nbytes, const float* table, float* out) {
  const __m256 t_lo = _mm256_loadu_ps(table), t_hi = _mm256_loadu_ps(table + 8);
  const __m128i nibble = _mm_set1_epi8(0x0f);
  int64_t j = 0;
  for (; j + 8 <= nbytes; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j));
    const __m128i idx = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), nibble),
                                          _mm_and_si128(b, nibble));  // even, odd, even, ...
    lookup8_avx2(t_lo, t_hi, _mm256_cvtepu8_epi32(idx), out + 2 * j);
    lookup8_avx2(t_lo, t_hi, _mm256_cvtepu8_epi32(_mm_srli_si128(idx, 8)), out + 2 * j + 8);
  }
  expand_scalar(codes + j, nbytes - j, table, out + 2 * j);
}

// GCC 12's AVX-512 headers start some intrinsics from an undefined register, which
// -Wmaybe-uninitialized reports as a use of an uninitialized value.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The codes of 16 bytes as 32 table indices in element order (even elements: high nibbles).
QLORA_AVX512 inline __m256i indices32(const uint8_t* codes) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)), nibble = _mm_set1_epi8(0x0f);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble), lo = _mm_and_si128(b, nibble);
  return _mm256_set_m128i(_mm_unpackhi_epi8(hi, lo), _mm_unpacklo_epi8(hi, lo));
}

// The 16-entry table in one register: each output vector is one permute of it.
QLORA_AVX512 QLORA_INLINE void expand32_avx512(const uint8_t* codes, int64_t nbytes, const float* table, float* out) {
  const __m512 t = _mm512_loadu_ps(table);
  int64_t j = 0;
  for (; j + 16 <= nbytes; j += 16) {
    const __m256i idx = indices32(codes + j);
    _mm512_storeu_ps(out + 2 * j, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(idx)), t));
    _mm512_storeu_ps(out + 2 * j + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(idx, 1)), t));
  }
  expand_scalar(codes + j, nbytes - j, table, out + 2 * j);
}

QLORA_AVX512 QLORA_INLINE void expand16_avx512_inline(const uint8_t* codes, int64_t nbytes, const uint16_t* table,
                                                     uint16_t* out) {
  const __m512i t = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(table)));
  int64_t j = 0;
  for (; j + 16 <= nbytes; j += 16)
    _mm512_storeu_si512(out + 2 * j, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(indices32(codes + j)), t));
  expand_scalar(codes + j, nbytes - j, table, out + 2 * j);
}
QLORA_AVX512 void expand16_avx512(const uint8_t* codes, int64_t nbytes, const uint16_t* table, uint16_t* out) {
  expand16_avx512_inline(codes, nbytes, table, out);
}
#pragma GCC diagnostic pop
#endif

// n blocks of nbytes codes each, block i through tables[i] (16 entries) into out (2 nbytes values
// a block): one call a batch of blocks, the ISA known at compile time (L: its vector width).
#if defined(__x86_64__)
QLORA_AVX512 void expand32_blocks_avx512(const uint8_t* codes, int64_t n, int64_t nbytes, const float* tables,
                                         float* out) {
  for (int64_t i = 0; i < n; ++i) expand32_avx512(codes + i * nbytes, nbytes, tables + i * 16, out + i * 2 * nbytes);
}
QLORA_AVX512 void expand16_blocks_avx512(const uint8_t* codes, int64_t n, int64_t nbytes, const uint16_t* tables,
                                         uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) expand16_avx512_inline(codes + i * nbytes, nbytes, tables + i * 16, out + i * 2 * nbytes);
}
QLORA_AVX2 void expand32_blocks_avx2(const uint8_t* codes, int64_t n, int64_t nbytes, const float* tables, float* out) {
  for (int64_t i = 0; i < n; ++i) expand32_avx2(codes + i * nbytes, nbytes, tables + i * 16, out + i * 2 * nbytes);
}
#endif
template <int L>
QLORA_INLINE void expand32_blocks(const uint8_t* codes, int64_t n, int64_t nbytes, const float* tables, float* out) {
#if defined(__x86_64__)
  if constexpr (L == 16) return expand32_blocks_avx512(codes, n, nbytes, tables, out);
  if constexpr (L == 8) return expand32_blocks_avx2(codes, n, nbytes, tables, out);
#endif
  for (int64_t i = 0; i < n; ++i) expand_scalar(codes + i * nbytes, nbytes, tables + i * 16, out + i * 2 * nbytes);
}

void expand16(const uint8_t* codes, int64_t nbytes, const uint16_t* table, uint16_t* out) {
#if defined(__x86_64__)
  if (active_isa() >= CpuIsa::kAvx512) return expand16_avx512(codes, nbytes, table, out);
  if (active_isa() >= CpuIsa::kAvx2) return expand16_avx2(codes, nbytes, table, out);
  if (kHaveSsse3) return expand16_ssse3(codes, nbytes, table, out);  // x86-64's baseline has no SSSE3
#endif
  expand_scalar(codes, nbytes, table, out);
}

// As expand32_blocks, for 16-bit outputs: one call a batch of blocks on AVX-512 (a call per block
// of 32 code bytes cost more than its permutes), expand16 per block otherwise.
template <int L>
QLORA_INLINE void expand16_blocks(const uint8_t* codes, int64_t n, int64_t nbytes, const uint16_t* tables, uint16_t* out) {
#if defined(__x86_64__)
  if constexpr (L == 16) return expand16_blocks_avx512(codes, n, nbytes, tables, out);
#endif
  for (int64_t i = 0; i < n; ++i) expand16(codes + i * nbytes, nbytes, tables + i * 16, out + i * 2 * nbytes);
}

// v rounded to D as the reference rounds it (bf16::round's rounding, lane by lane).
template <int L, Dtype D> QLORA_INLINE typename simd::Vec<L>::F round_to(typename simd::Vec<L>::F v) {
  if constexpr (D == Dtype::BF16) {
    uint16_t r[L];
    simd::Vec<L>::store(r, v);
    return simd::Vec<L>::load(r);
  }
  return v;
}

// Block i's table: cb * s rounded to D (vectors of L lanes: the rounding bf16::round does), then
// stored as O (exact for O = D; one rounding for fp32 storage and bf16 output).
template <int L, Dtype D, class OutT> QLORA_INLINE void block_table(const float* cb, float s, OutT* table) {
  using V = simd::Vec<L>;
  for (int c = 0; c < nf4::kNumCodes; c += L) V::store(table + c, round_to<L, D>(V::load(cb + c) * s));
}

// s[i] for blocks bb + i, i < nb (<= kBatch, a multiple of L): the dequantized scaler
// round(round(scaler / factor) + mean) in D, L blocks at a time (the lanes past nb unused).
template <int L, Dtype D>
QLORA_INLINE void block_scales(const int8_t* scalers, const typename Storage<D>::T* factors, float mean,
                               int64_t scaler_block_size, int64_t bb, int64_t nb, float* s) {
  using V = simd::Vec<L>;
  int64_t fi = bb / scaler_block_size, next = (fi + 1) * scaler_block_size;  // factor of block bb; next's first
  for (int64_t i = 0; i < nb; i += L) {
    float sc[L], fa[L];
    for (int j = 0; j < L; ++j) {
      const int64_t b = bb + i + j;
      if (i + j >= nb) {
        sc[j] = fa[j] = 1.0f;
        continue;
      }
      if (b == next) ++fi, next += scaler_block_size;
      sc[j] = static_cast<float>(scalers[b]);
      fa[j] = Storage<D>::load(factors[fi]);
    }
    V::store(s + i, round_to<L, D>(round_to<L, D>(V::load(sc) / V::load(fa)) + mean));
  }
}

// Full blocks [b0, b1) for storage dtype D and output dtype O into out (block b0 at out[0]). Per batch of blocks: the
// scalers (vectorized across blocks), then each block's 16-entry output table (vectorized
// across codes), then the table lookups.
template <int L, Dtype D, Dtype O>
QLORA_INLINE void dequantize_blocks(const uint8_t* codes, const int8_t* scalers, const void* factors_,
                                    float mean, const Layout& l, void* out_, int64_t b0, int64_t b1) {
  using S = Storage<D>;
  using SO = Storage<O>;
  using OutT = typename SO::T;
  const auto* factors = static_cast<const typename S::T*>(factors_);
  auto* out = static_cast<OutT*>(out_);
  float cb[nf4::kNumCodes];
  std::memcpy(cb, nf4::codebook(D).data(), sizeof cb);
  constexpr int64_t kBatch = 64;
  float s[kBatch];
  alignas(64) OutT table[kBatch][nf4::kNumCodes];
  for (int64_t bb = b0; bb < b1; bb += kBatch) {
    const int64_t nb = std::min(kBatch, b1 - bb);
    block_scales<L, D>(scalers, factors, mean, l.scaler_block_size, bb, nb, s);
    for (int64_t i = 0; i < nb; ++i) block_table<L, D>(cb, s[i], table[i]);
    const int64_t nbytes = l.block_size / 2;
    if constexpr (sizeof(OutT) == 2) {
      expand16_blocks<L>(codes + bb * nbytes, nb, nbytes, table[0], out + (bb - b0) * l.block_size);
    } else {
      expand32_blocks<L>(codes + bb * nbytes, nb, nbytes, table[0], out + (bb - b0) * l.block_size);
    }
  }
}

// The fast path's (storage, output) dtypes: bf16 and fp32 either side.
bool has_fast_path(Dtype d, Dtype o) { return d != Dtype::F16 && o != Dtype::F16; }

// Full blocks [b0, b1) through dequantize_blocks for the runtime dtypes, its table loops compiled
// for the active ISA; block b0 lands at out[0].
void dequantize_fast(Dtype d, Dtype o, const uint8_t* codes, const int8_t* scalers, const void* factors, float mean,
                     const Layout& l, void* out, int64_t b0, int64_t b1) {
  dispatch_dtype(d, [&](auto dt) {
    dispatch_dtype(o, [&](auto ot) {
      constexpr Dtype D = decltype(dt)::value, O = decltype(ot)::value;
      if constexpr (D != Dtype::F16 && O != Dtype::F16)
        dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
          dequantize_blocks<lanes<decltype(isa)::value>, D, O>(codes, scalers, factors, mean, l, out, b0, b1);
        });
    });
  });
}

// Any dtypes, any block (also the last, partial one): per element from the reference scaler;
// block b0 lands at out[0].
void dequantize_blocks_generic(Dtype d, Dtype out_dtype, const uint8_t* codes,
                               const int8_t* scalers, const void* factors, float mean,
                               const Layout& l, void* out, int64_t b0, int64_t b1) {
  const auto& cb = nf4::codebook(d);
  for (int64_t b = b0; b < b1; ++b) {
    const float s = nf4::dequantized_scaler(d, scalers, factors, mean, l, b);
    float values[nf4::kNumCodes];
    for (int c = 0; c < nf4::kNumCodes; ++c)
      values[c] = nf4::round_to(out_dtype, nf4::round_to(d, cb[c] * s));
    const int64_t i0 = b * l.block_size, n = std::min(l.block_size, l.numel - i0);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t byte = codes[(i0 + i) / 2];
      nf4::store_from_float(out_dtype, out, i0 - b0 * l.block_size + i, values[i % 2 == 0 ? byte >> 4 : byte & 15]);
    }
  }
}

}  // namespace

void nf4_dequantize_cpu(Dtype d, Dtype out_dtype, const uint8_t* codes, const int8_t* scalers,
                        const void* factors, float mean, const Layout& l, void* out) {
  const int64_t n_full = l.numel / l.block_size;  // blocks with no element past numel
  const bool fast = has_fast_path(d, out_dtype);
  const auto at_block = [&](int64_t b) { return static_cast<char*>(out) + b * l.block_size * nf4::dtype_size(out_dtype); };
  at::parallel_for(0, l.n_real_blocks(), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    const int64_t fast_end = fast ? std::min(b1, n_full) : b0;
    if (fast_end > b0) dequantize_fast(d, out_dtype, codes, scalers, factors, mean, l, at_block(b0), b0, fast_end);
    const int64_t rest = std::max(b0, fast_end);
    dequantize_blocks_generic(d, out_dtype, codes, scalers, factors, mean, l, at_block(rest), rest, b1);
  });
}

void nf4_dequantize_blocks_cpu(const Nf4Operand& w, Dtype out_dtype, int64_t b0, int64_t b1, void* out) {
  if (has_fast_path(w.dtype, out_dtype))
    return dequantize_fast(w.dtype, out_dtype, w.codes, w.scalers, w.factors, w.mean, w.layout, out, b0, b1);
  dequantize_blocks_generic(w.dtype, out_dtype, w.codes, w.scalers, w.factors, w.mean, w.layout, out, b0, b1);
}

}  // namespace qlora::kernels
