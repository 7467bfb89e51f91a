// The CPU's vector ISA, read once from ATen's CPU capabilities (which count an extension only
// where the OS saves its registers), for the kernels' run-time dispatch, model.dtype = "auto" and
// the bench JSON. One binary runs everywhere: each kernel has a path per ISA and takes the best
// one active_isa() allows.
//
// QLORA_CPU_ISA=scalar|avx2|avx512|avx512_bf16 caps it (tests force each path the machine has;
// asking for more than the CPU has is an error naming both).
#pragma once

namespace qlora::kernels {

// Ordered: each level includes the ones below it.
enum class CpuIsa {
  kScalar = 0,
  kAvx2 = 1,        // AVX2 + FMA
  kAvx512 = 2,      // AVX-512 F, BW, DQ, VL (x86-64-v4)
  kAvx512Bf16 = 3,  // plus AVX512_BF16 (vdpbf16ps: bf16 dot products into fp32)
};

struct CpuFeatures {
  CpuIsa isa = CpuIsa::kScalar;  // the best level the CPU and OS support
  bool amx_bf16 = false;         // AMX tiles with bf16 (Sapphire Rapids and later)
  bool amd = false;              // vendor "AuthenticAMD"
};

const CpuFeatures& cpu_features();  // the CPU's, read once
// cpu_features().isa, capped by QLORA_CPU_ISA (read once) and by any live ScopedIsaCap.
CpuIsa active_isa();
// Whether the CPU multiplies bf16 natively (AVX512_BF16, which every AMX-BF16 CPU also has), as
// active_isa() allows: where bf16 compute is the fast path (model.dtype = "auto" picks bf16 there,
// fp32 elsewhere).
bool has_native_bf16();
// Whether bf16 GEMMs (torch's, through oneDNN) outrun fp32 ones here, so that model.dtype = "auto"
// computes in bf16: AMX-BF16, or AVX512_BF16 on AMD (Zen 4/5 run its dot products at twice the fp32
// FMA rate; 882 vs 190 GFLOP/s measured on a 2048^3 matmul, Zen 5). An Intel CPU with AVX512_BF16
// but no AMX (Cooper Lake, or a VM that hides AMX) runs them at half fp32's rate (146 vs 292
// GFLOP/s, a 2-core Xeon model 207 VM): fp32 there. As has_native_bf16(), within the ISA cap.
bool bf16_gemms_fast();
const char* isa_name(CpuIsa isa);  // "scalar", "avx2", "avx512", "avx512_bf16"

// Caps active_isa() at `isa` for its lifetime, on every thread (tests run each kernel path the
// machine has in one process). Not for concurrent use: one cap at a time, restored on exit.
class ScopedIsaCap {
 public:
  explicit ScopedIsaCap(CpuIsa isa);
  ~ScopedIsaCap();
  ScopedIsaCap(const ScopedIsaCap&) = delete;
  ScopedIsaCap& operator=(const ScopedIsaCap&) = delete;

 private:
  int previous_;
};

}  // namespace qlora::kernels
