// NF4 dequantize on CPU. Per block, the 16 possible outputs are computed once (exactly as the
// reference does, in the NF4 dtype, then converted to the output dtype); the codes then only
// index that table. For 16-bit outputs the lookup is two SSSE3 byte shuffles per 16 codes.
#include <ATen/Parallel.h>

#include <cstring>

#include "kernels/cpu_dispatch.h"
#include "kernels/nf4_cpu.h"
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
__attribute__((target("ssse3"))) void expand16_ssse3(const uint8_t* codes, int64_t nbytes,
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
const bool kHaveSsse3 = __builtin_cpu_supports("ssse3");
#endif

void expand16(const uint8_t* codes, int64_t nbytes, const uint16_t* table, uint16_t* out) {
#if defined(__x86_64__)
  if (kHaveSsse3) return expand16_ssse3(codes, nbytes, table, out);
#endif
  expand_scalar(codes, nbytes, table, out);
}

}  // namespace

void nf4_dequantize_cpu(Dtype d, Dtype out_dtype, const uint8_t* codes, const int8_t* scalers,
                        const void* factors, float mean, const Layout& l, void* out) {
  const auto& cb = nf4::codebook(d);
  const int64_t n_full = l.numel / l.block_size;  // blocks with no element past numel
  at::parallel_for(0, l.n_real_blocks(), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float s = nf4::dequantized_scaler(d, scalers, factors, mean, l, b);
      const int64_t i0 = b * l.block_size;
      const int64_t n = b < n_full ? l.block_size : l.numel - i0;
      float values[nf4::kNumCodes];
      for (int c = 0; c < nf4::kNumCodes; ++c)
        values[c] = nf4::round_to(out_dtype, nf4::round_to(d, cb[c] * s));
      if (out_dtype == Dtype::F32) {
        auto* o = static_cast<float*>(out) + i0;
        expand_scalar(codes + i0 / 2, n / 2, values, o);
        if (n % 2) o[n - 1] = values[codes[(i0 + n - 1) / 2] >> 4];
      } else {
        uint16_t table[nf4::kNumCodes];
        for (int c = 0; c < nf4::kNumCodes; ++c) nf4::store_from_float(out_dtype, table, c, values[c]);
        auto* o = static_cast<uint16_t*>(out) + i0;
        expand16(codes + i0 / 2, n / 2, table, o);
        if (n % 2) o[n - 1] = table[codes[(i0 + n - 1) / 2] >> 4];
      }
    }
  });
}

}  // namespace qlora::kernels
