#include "kernels/cpu_isa.h"

#include <ATen/cpu/Utils.h>

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

// A boolean of ATen's CPU capabilities (cpuinfo underneath: CPUID, each vector extension counted
// only where XCR0 shows the OS saves its registers); absent keys (other architectures) are false.
bool capability(const std::unordered_map<std::string, c10::IValue>& caps, const char* key) {
  const auto it = caps.find(key);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

// The vendor, which ATen does not tell (only a brand name): bf16_gemms_fast() depends on it.
bool vendor_is_amd() {
#if defined(__x86_64__)
  uint32_t a, b, c, d;
  return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
#else
  return false;
#endif
}

CpuFeatures read_cpu() {
  const auto caps = at::cpu::get_cpu_capabilities();
  const auto has = [&](const char* key) { return capability(caps, key); };
  CpuFeatures f;
  f.amd = vendor_is_amd();
  if (has("avx2") && has("fma3")) f.isa = CpuIsa::kAvx2;
  if (f.isa == CpuIsa::kAvx2 && has("avx512_f") && has("avx512_dq") && has("avx512_bw") && has("avx512_vl"))
    f.isa = has("avx512_bf16") ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512;
  // cpuinfo reports AMX from CPUID alone; init_amx() asks the kernel for the tile state (as oneDNN
  // does before using it), which fails where the OS cannot run AMX: then bf16 GEMMs are not fast.
  f.amx_bf16 = has("amx_bf16") && at::cpu::init_amx();
  return f;
}

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
