// Helpers shared by the CPU kernels: function multi-versioning for x86 vector ISAs and
// load/round helpers for the storage dtypes that compilers can vectorize.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/cpu_isa.h"
#include "quant/nf4_format.h"

// Clones a function for AVX-512, AVX2 and baseline x86-64; the loader picks one at start-up.
// Code inlined into it (QLORA_INLINE) is compiled for each ISA too.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QLORA_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QLORA_VECTOR_CLONES
#endif
#define QLORA_INLINE inline __attribute__((always_inline))

// Hand-vectorized kernels: AVX2 + FMA intrinsics in functions marked QLORA_AVX2, taken when the
// active ISA (cpu_isa.h: the CPU's, or less under QLORA_CPU_ISA) has both (a scalar path otherwise).
#if defined(__x86_64__)
#define QLORA_AVX2 __attribute__((target("avx2,fma")))
inline const bool kHaveAvx2Fma = qlora::kernels::active_isa() >= qlora::kernels::CpuIsa::kAvx2;
#endif

namespace qlora::kernels {

// Bit-level bf16 helpers without NaN handling (inputs are checked finite first), written so
// that loops over them vectorize.
QLORA_INLINE float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
QLORA_INLINE uint32_t bf16_round_bits(float f) {  // float bits rounded to bf16, low half zero
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}
QLORA_INLINE float bf16_round(float f) {
  const uint32_t u = bf16_round_bits(f);
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// Storage traits: T is the element type in memory; load() widens to float; round() rounds a
// float to the nearest storage value; store() narrows a float that is already representable.
template <nf4::Dtype D> struct Storage;
template <> struct Storage<nf4::Dtype::F32> {
  using T = float;
  static QLORA_INLINE float load(T v) { return v; }
  static QLORA_INLINE float round(float f) { return f; }
  static QLORA_INLINE T store(float f) { return f; }
};
template <> struct Storage<nf4::Dtype::BF16> {
  using T = uint16_t;
  static QLORA_INLINE float load(T v) { return bf16_bits_to_float(v); }
  static QLORA_INLINE float round(float f) { return bf16_round(f); }
  static QLORA_INLINE T store(float f) { return static_cast<T>(bf16_round_bits(f) >> 16); }
};
template <> struct Storage<nf4::Dtype::F16> {
  using T = uint16_t;
  static QLORA_INLINE float load(T v) { return nf4::f16_to_float(v); }
  static QLORA_INLINE float round(float f) { return nf4::round_to(nf4::Dtype::F16, f); }
  static QLORA_INLINE T store(float f) { return nf4::f16_from_float(f); }
};

// Calls fn(std::integral_constant<nf4::Dtype, D>{}) for the runtime dtype d.
template <class Fn> void dispatch_dtype(nf4::Dtype d, Fn&& fn) {
  switch (d) {
    case nf4::Dtype::BF16: fn(std::integral_constant<nf4::Dtype, nf4::Dtype::BF16>{}); break;
    case nf4::Dtype::F16: fn(std::integral_constant<nf4::Dtype, nf4::Dtype::F16>{}); break;
    default: fn(std::integral_constant<nf4::Dtype, nf4::Dtype::F32>{});
  }
}

}  // namespace qlora::kernels
