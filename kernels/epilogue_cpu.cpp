// The epilogues of kernels/epilogue_cpu.h: with AVX-512 written in its intrinsics (for GELU a
// reciprocal estimate refined by one Newton step where the generic vectors divide: vdivps was a
// quarter of its time), elsewhere over the N-lane vectors of kernels/simd.h per ISA.
#include "kernels/epilogue_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels/simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace qlora::kernels {

namespace {

using simd::Vec;

constexpr int64_t kGrainElements = 1 << 15;  // enough work that a second thread pays for its wake-up
constexpr float k2Beta = 2.0f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
constexpr float k2BetaKappa = k2Beta * 0.044715f;

template <int N> QLORA_INLINE typename Vec<N>::F gelu_tanh(typename Vec<N>::F x) {
  const typename Vec<N>::F two_u = x * (k2Beta + k2BetaKappa * (x * x));
  return x / (1.0f + Vec<N>::exp(-two_u));
}

// One row of cols: y = gelu(y + b) (Gelu) or y = x + (y + b); b, x may be null.
template <bool Gelu, class T> void generic_row(int64_t cols, T* y, const T* x, const T* b) {
  dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
    using V = Vec<lanes<isa()>>;
    V::for_vectors(cols, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
      typename V::F v = V::load_n(y + i, w, 0.0f);
      if (b != nullptr) v = v + V::load_n(b + i, w, 0.0f);
      if constexpr (Gelu) v = gelu_tanh<V::kLanes>(v);
      else if (x != nullptr) v = V::load_n(x + i, w, 0.0f) + v;
      V::store_n(y + i, v, w);
    });
  });
}

#if defined(__x86_64__)
// e^-2u as Vec::exp computes it (the same clamp, split of ln 2 and polynomial), then x / (1 + e)
// as x r, r the reciprocal estimate (rel. error 2^-14) after one Newton step (~2^-28).
QLORA_AVX512 __m512 gelu_tanh_avx512(__m512 x) {
  const __m512 two_u = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(k2BetaKappa), _mm512_mul_ps(x, x),
                                                        _mm512_set1_ps(k2Beta)));
  __m512 e = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), two_u), _mm512_set1_ps(-87.0f)),
                           _mm512_set1_ps(88.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(e, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), e);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  e = _mm512_scalef_ps(p, k);
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(x, inv);
}

QLORA_AVX512 __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
QLORA_AVX512 __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
QLORA_AVX512 void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
QLORA_AVX512 void store16(uint16_t* p, __m512 v, __mmask16 m) {
  // Round to nearest even, NaN to 0x7fc0: kernels/simd.h's bf16 rounding.
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

template <bool Gelu, class T> QLORA_AVX512 void avx512_row(int64_t cols, T* y, const T* x, const T* b) {
  for (int64_t i = 0; i < cols; i += 16) {
    const __mmask16 m = cols - i >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (cols - i)) - 1u);
    __m512 v = load16(y + i, m);
    if (b != nullptr) v = _mm512_add_ps(v, load16(b + i, m));
    if constexpr (Gelu) v = gelu_tanh_avx512(v);
    else if (x != nullptr) v = _mm512_add_ps(load16(x + i, m), v);
    store16(y + i, v, m);
  }
}
#endif

template <bool Gelu, class T> void epilogue(int64_t rows, int64_t cols, T* y, const T* x, const T* b) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, cols));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* yr = y + r * cols;
      const T* xr = x != nullptr ? x + r * cols : nullptr;
#if defined(__x86_64__)
      if (active_isa() >= CpuIsa::kAvx512) {
        avx512_row<Gelu>(cols, yr, xr, b);
        continue;
      }
#endif
      generic_row<Gelu>(cols, yr, xr, b);
    }
  });
}

}  // namespace

void bias_gelu_tanh_cpu(int64_t rows, int64_t cols, float* y, const float* bias) {
  epilogue<true>(rows, cols, y, static_cast<const float*>(nullptr), bias);
}
void bias_gelu_tanh_cpu(int64_t rows, int64_t cols, uint16_t* y, const uint16_t* bias) {
  epilogue<true>(rows, cols, y, static_cast<const uint16_t*>(nullptr), bias);
}
void bias_residual_cpu(int64_t rows, int64_t cols, float* y, const float* x, const float* bias) {
  epilogue<false>(rows, cols, y, x, bias);
}
void bias_residual_cpu(int64_t rows, int64_t cols, uint16_t* y, const uint16_t* x, const uint16_t* bias) {
  epilogue<false>(rows, cols, y, x, bias);
}

}  // namespace qlora::kernels
