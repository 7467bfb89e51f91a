// Vectors of N floats for the CPU kernels, written once with GCC's vector extensions and compiled
// for each ISA by kernels/cpu_dispatch.h's dispatch_isa (N = 4: SSE2, 8: AVX2, 16: AVX-512).
// Everything here is always inlined into a function with the ISA's target attribute.
//
// Elements in memory are float or bf16 (uint16_t bit patterns): loads widen bf16 exactly, stores
// round as bf16::round_bits below. Arithmetic is fp32; the vector kernel files compile with
// -ffp-contract=fast, so a * b + c becomes one FMA where the ISA has it.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "kernels/cpu_dispatch.h"
#include "quant/nf4_format.h"

namespace qlora::kernels {

// ---- bf16 <-> float: the kernels' one conversion ---------------------------------------------
// Rounds as c10::BFloat16(float) does, the host's definition (tests/kernels/test_bf16_rounding.cpp
// holds every ISA to it): to nearest even, and every NaN, whatever its sign and payload, to the
// quiet NaN 0x7fc0 (rounding a NaN's bits could carry it into inf or -0, truncating them could
// make it inf). Written once over U, uint32_t or a vector of them (the bits of 1 or N floats),
// so the scalar loops the compiler vectorizes (Storage) and the explicit vectors (Vec) are one
// expression, free of branches and of comparisons GCC spells per vector type.
namespace bf16 {

// Float bits -> the bf16's bits in the high half, low half zero (the bits of the rounded float).
template <class U> QLORA_INLINE U round_bits(U u) {
  // A NaN's magnitude exceeds 0x7f800000, so adding 0x7fffff to it carries into bit 31.
  const U nan = 0u - (((u & 0x7fffffffu) + 0x7fffffu) >> 31);  // all ones in NaN lanes
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return (rounded & ~nan) | (0x7fc00000u & nan);
}
QLORA_INLINE float to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
QLORA_INLINE uint16_t from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(round_bits(u) >> 16);
}
QLORA_INLINE float round(float f) { return to_float(from_float(f)); }

}  // namespace bf16

// Storage traits: T is the element type in memory; load() widens to float; round() rounds a
// float to the nearest storage value; store() narrows a float (rounding it). fp16 is c10::Half's
// conversion, inlined where the loops over it vectorize.
template <nf4::Dtype D> struct Storage;
template <> struct Storage<nf4::Dtype::F32> {
  using T = float;
  static QLORA_INLINE float load(T v) { return v; }
  static QLORA_INLINE float round(float f) { return f; }
  static QLORA_INLINE T store(float f) { return f; }
};
template <> struct Storage<nf4::Dtype::BF16> {
  using T = uint16_t;
  static QLORA_INLINE float load(T v) { return bf16::to_float(v); }
  static QLORA_INLINE float round(float f) { return bf16::round(f); }
  static QLORA_INLINE T store(float f) { return bf16::from_float(f); }
};
template <> struct Storage<nf4::Dtype::F16> {
  using T = uint16_t;
  static QLORA_INLINE float load(T v) { return static_cast<float>(c10::Half(v, c10::Half::from_bits())); }
  static QLORA_INLINE float round(float f) { return static_cast<float>(c10::Half(f)); }
  static QLORA_INLINE T store(float f) { return c10::Half(f).x; }
};

namespace simd {

template <int N> struct Types;

// The vector types of N lanes, with the lane-wise conversions GCC spells per concrete type.
#define QLORA_SIMD_TYPES(N)                                                                      \
  typedef float f##N __attribute__((vector_size(4 * (N))));                                      \
  typedef uint32_t u##N __attribute__((vector_size(4 * (N))));                                   \
  typedef int32_t i##N __attribute__((vector_size(4 * (N))));                                    \
  typedef uint16_t h##N __attribute__((vector_size(2 * (N))));                                   \
  QLORA_INLINE u##N widen(h##N h) { return __builtin_convertvector(h, u##N); }                   \
  QLORA_INLINE h##N narrow(u##N u) { return __builtin_convertvector(u, h##N); }                  \
  QLORA_INLINE i##N to_int(f##N f) { return __builtin_convertvector(f, i##N); }                  \
  template <> struct Types<N> {                                                                  \
    using F = f##N;                                                                              \
    using U = u##N;                                                                              \
    using I = i##N;                                                                              \
    using H = h##N;                                                                              \
  };
QLORA_SIMD_TYPES(4)
QLORA_SIMD_TYPES(8)
QLORA_SIMD_TYPES(16)
#undef QLORA_SIMD_TYPES

// One element stored from a float, as Vec::store.
QLORA_INLINE void store_scalar(float* p, float v) { *p = v; }
QLORA_INLINE void store_scalar(uint16_t* p, float v) { *p = bf16::from_float(v); }

template <int N> struct Vec {
  using F = typename Types<N>::F;
  using U = typename Types<N>::U;
  using I = typename Types<N>::I;
  using H = typename Types<N>::H;
  static constexpr int kLanes = N;

  // Lane by lane, which GCC turns into one broadcast (0 + x would be an add: not x for x = -0).
  static QLORA_INLINE F splat(float x) {
    F v;
    for (int i = 0; i < N; ++i) v[i] = x;
    return v;
  }
  static QLORA_INLINE float scalar(float x) { return x; }
  static QLORA_INLINE float scalar(uint16_t x) { return bf16::to_float(x); }

  static QLORA_INLINE F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static QLORA_INLINE F load(const uint16_t* p) {
    H h;
    std::memcpy(&h, p, sizeof h);
    return reinterpret_cast<F>(widen(h) << 16);
  }
  static QLORA_INLINE void store(float* p, F v) { std::memcpy(p, &v, sizeof v); }
  static QLORA_INLINE void store(uint16_t* p, F v) {
    const H h = narrow(bf16::round_bits(reinterpret_cast<U>(v)) >> 16);
    std::memcpy(p, &h, sizeof h);
  }

  // The first n < N elements at p, the other lanes `fill`; and the first n lanes stored at p.
  template <class T> static QLORA_INLINE F load_part(const T* p, int64_t n, float fill) {
    T buf[N];
    for (int i = 0; i < N; ++i) {
      if (i < n) buf[i] = p[i];
      else store_scalar(buf + i, fill);
    }
    return load(buf);
  }
  template <class T> static QLORA_INLINE void store_part(T* p, F v, int64_t n) {
    T buf[N];
    store(buf, v);
    for (int i = 0; i < n; ++i) p[i] = buf[i];
  }
  // The first w <= N elements (N: a whole vector), other lanes `fill`; and stored back.
  template <class T> static QLORA_INLINE F load_n(const T* p, int64_t w, float fill) {
    return w == N ? load(p) : load_part(p, w, fill);
  }
  template <class T> static QLORA_INLINE void store_n(T* p, F v, int64_t w) {
    if (w == N) store(p, v);
    else store_part(p, v, w);
  }
  // Calls f(i, w) for the vectors [i, i + w) covering [0, n): w = N but for the last, shorter one.
  template <class Fn> static QLORA_INLINE void for_vectors(int64_t n, Fn&& f) {
    int64_t i = 0;
    for (; i + N <= n; i += N) f(i, int64_t{N});
    if (i < n) f(i, n - i);
  }

  // v with lanes n.. replaced by `other` (through memory: GCC 12 fails on a vector select here).
  static QLORA_INLINE F select_first(F v, int64_t n, float other) {
    if (n >= N) return v;
    float buf[N];
    store(buf, v);
    for (int i = static_cast<int>(n); i < N; ++i) buf[i] = other;
    return load(buf);
  }

  static QLORA_INLINE F max(F a, F b) { return a > b ? a : b; }
  // Horizontal sum and max over the lanes, halving in a fixed order: the sum adds the upper half
  // of the lanes to the lower, as vectors (an extract and an add per halving), down to 4 lanes.
  static QLORA_INLINE float sum(F v) {
    if constexpr (N > 4) {
      typename Vec<N / 2>::F lo, hi;
      std::memcpy(&lo, &v, sizeof lo);
      std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
      return Vec<N / 2>::sum(lo + hi);
    } else {
      return (v[0] + v[2]) + (v[1] + v[3]);
    }
  }
  static QLORA_INLINE float max_of(F v) {
    float s[N];
    store(s, v);
    for (int w = N / 2; w > 0; w /= 2)
      for (int i = 0; i < w; ++i) s[i] = s[i + w] > s[i] ? s[i + w] : s[i];
    return s[0];
  }

  // e^x within 2 ulp of expf: x = k ln2 + r, |r| <= ln2 / 2, Cephes' degree-5 polynomial for e^r.
  // x is clamped to [-87, 88] (results stay normal: e^-inf is ~1.6e-38, not 0); NaN stays NaN.
  static QLORA_INLINE F exp(F x) {
    x = x < -87.0f ? splat(-87.0f) : x;
    x = x > 88.0f ? splat(88.0f) : x;
    const F magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const F k = (x * 1.44269504088896341f + magic) - magic;
    F r = x - k * 0.693359375f;  // x - k ln2, ln2 in two parts
    r = r - k * -2.12194440e-4f;
    F p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    return p * reinterpret_cast<F>((to_int(k) + 127) << 23);
  }
};

}  // namespace simd
}  // namespace qlora::kernels
