#include "kernels/cpu_isa.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace qlora::kernels {
namespace {

#if defined(__x86_64__)
bool bit(uint32_t reg, int b) { return (reg >> b) & 1u; }

uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures read_cpu() {
  CpuFeatures f;
  uint32_t a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d)) f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = bit(c, 27), fma = bit(c, 12);
  if (!osxsave) return f;
  const uint64_t x = xcr0();
  const bool ymm = (x & 0x6) == 0x6, zmm = (x & 0xe6) == 0xe6, tiles = (x & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = bit(b, 5), avx512 = bit(b, 16) && bit(b, 17) && bit(b, 30) && bit(b, 31);  // F, DQ, BW, VL
  f.amx_bf16 = tiles && bit(d, 22);
  uint32_t a1 = 0, b1, c1, d1;
  const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && bit(a1, 5);
  if (ymm && avx2 && fma) f.isa = CpuIsa::kAvx2;
  if (f.isa == CpuIsa::kAvx2 && zmm && avx512) f.isa = bf16 ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512;
  return f;
}
#else
CpuFeatures read_cpu() { return {}; }
#endif

CpuIsa capped(CpuIsa detected) {
  const char* env = std::getenv("QLORA_CPU_ISA");
  if (env == nullptr || *env == '\0') return detected;
  for (int level = 0; level <= static_cast<int>(CpuIsa::kAvx512Bf16); ++level) {
    const auto isa = static_cast<CpuIsa>(level);
    if (std::string(env) != isa_name(isa)) continue;
    if (level > static_cast<int>(detected))
      throw std::invalid_argument(std::string("QLORA_CPU_ISA=") + env + ": this CPU has " + isa_name(detected));
    return isa;
  }
  throw std::invalid_argument(std::string("QLORA_CPU_ISA=") + env + ": expected scalar, avx2, avx512 or avx512_bf16");
}

// ScopedIsaCap's cap: the highest level, i.e. none, when no cap is live.
std::atomic<int> g_cap{static_cast<int>(CpuIsa::kAvx512Bf16)};

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = read_cpu();
  return f;
}

CpuIsa active_isa() {
  static const CpuIsa isa = capped(cpu_features().isa);
  return static_cast<CpuIsa>(std::min(static_cast<int>(isa), g_cap.load(std::memory_order_relaxed)));
}

ScopedIsaCap::ScopedIsaCap(CpuIsa isa) : previous_(g_cap.exchange(static_cast<int>(isa))) {}
ScopedIsaCap::~ScopedIsaCap() { g_cap.store(previous_); }

// Every CPU with AMX-BF16 also has AVX512_BF16, so the capped level decides (QLORA_CPU_ISA=avx2 gives fp32).
bool has_native_bf16() { return active_isa() == CpuIsa::kAvx512Bf16; }
bool bf16_gemms_fast() { return has_native_bf16() && (cpu_features().amx_bf16 || cpu_features().amd); }

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

}  // namespace qlora::kernels
