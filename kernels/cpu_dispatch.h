// Helpers shared by the CPU kernels: function multi-versioning for x86 vector ISAs and dispatch
// over the storage dtypes (whose conversions are in kernels/simd.h).
#pragma once

#include <cstdint>
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
