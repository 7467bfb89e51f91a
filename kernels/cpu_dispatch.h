// Helpers shared by the CPU kernels: function multi-versioning for x86 vector ISAs and
// load/round helpers for the storage dtypes that compilers can vectorize.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu_isa.h"
#include "quant/nf4_format.h"

#define QLORA_INLINE inline __attribute__((always_inline))

// Target attributes of the kernels' ISA levels (cpu_isa.h). Code inlined into a function marked
// with one (QLORA_INLINE templates, always-inline lambdas) is compiled for that ISA.
// GCC's prefer-vector-width=512 (its auto-vectorizer otherwise keeps to 256-bit vectors) is not a
// target feature clang knows, and clang drops the whole attribute over it: clang builds (the
// sanitizer tree) get the features alone.
#if defined(__x86_64__)
#if defined(__clang__)
#define QLORA_PREFER_512 ""
#else
#define QLORA_PREFER_512 ",prefer-vector-width=512"
#endif
#define QLORA_AVX2 __attribute__((target("avx2,fma")))
#define QLORA_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl" QLORA_PREFER_512)))
#define QLORA_AVX512_BF16 \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16" QLORA_PREFER_512)))
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

// dispatch_isa(fn) calls fn(IsaTag<I>{}) from a function compiled for I, the active ISA
// (active_isa(), which QLORA_CPU_ISA and ScopedIsaCap cap): fn, an always-inline generic lambda
// (QLORA_LAMBDA_INLINE), is inlined there, and with it the generic vectors of kernels/simd.h it
// uses, at I's width (lanes<I>). kAvx512Bf16 runs the kAvx512 code: kernels that use its dot
// products check for it themselves.
template <CpuIsa I> using IsaTag = std::integral_constant<CpuIsa, I>;
constexpr int lanes_of(CpuIsa isa) { return isa >= CpuIsa::kAvx512 ? 16 : isa == CpuIsa::kAvx2 ? 8 : 4; }
template <CpuIsa I> constexpr int lanes = lanes_of(I);
#define QLORA_LAMBDA_INLINE __attribute__((always_inline))

#if defined(__x86_64__)
template <class Fn> QLORA_AVX512 void run_avx512(Fn& fn) { fn(IsaTag<CpuIsa::kAvx512>{}); }
template <class Fn> QLORA_AVX2 void run_avx2(Fn& fn) { fn(IsaTag<CpuIsa::kAvx2>{}); }
#endif

template <class Fn> void dispatch_isa(Fn&& fn) {
#if defined(__x86_64__)
  const CpuIsa isa = active_isa();
  if (isa >= CpuIsa::kAvx512) return run_avx512(fn);
  if (isa == CpuIsa::kAvx2) return run_avx2(fn);
#endif
  fn(IsaTag<CpuIsa::kScalar>{});
}

}  // namespace qlora::kernels
