// Device helpers shared by the NF4 CUDA kernels (nf4_quantize.cu, nf4_dequantize.cu): the
// storage dtypes with round-to-nearest-even conversions as quant/nf4_dtype.h defines them,
// fast division by launch constants, grid sizing. Internal to kernels/; torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/nf4_cuda.h"

namespace qlora::kernels::detail {

// ---- storage dtypes ---------------------------------------------------------------------
struct F32Traits {
  using Storage = float;
  __device__ static float to_float(float s) { return s; }
  __device__ static float to_storage(float f) { return f; }
  __device__ static float round(float f) { return f; }
};
struct BF16Traits {
  using Storage = uint16_t;
  __device__ static float to_float(uint16_t s) { return __uint_as_float(uint32_t{s} << 16); }
  // cvt.rn is round-to-nearest-even like c10::BFloat16; NaN is pinned to 0x7fc0 as there
  // (the hardware would give 0x7fff) so even NaN bits agree with the CPU reference.
  __device__ static uint16_t to_storage(float f) {
    return isnan(f) ? uint16_t{0x7fc0} : __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
  __device__ static float round(float f) { return to_float(to_storage(f)); }
};
struct F16Traits {
  using Storage = uint16_t;
  __device__ static float to_float(uint16_t s) { return __half2float(__ushort_as_half(s)); }
  __device__ static uint16_t to_storage(float f) { return __half_as_ushort(__float2half_rn(f)); }
  __device__ static float round(float f) { return to_float(to_storage(f)); }
};

// Division by a launch-constant divisor; the default layouts (64, 256) are powers of two and
// 64-bit integer division is a long software sequence on the GPU.
struct Div64 {
  uint64_t d;
  int shift;  // >= 0 when d is a power of two
  static Div64 make(int64_t divisor) {
    Div64 r{static_cast<uint64_t>(divisor), -1};
    if ((r.d & (r.d - 1)) == 0) {
      r.shift = 0;
      while ((uint64_t{1} << r.shift) != r.d) ++r.shift;
    }
    return r;
  }
  __device__ __forceinline__ int64_t operator()(int64_t x) const {
    const uint64_t u = static_cast<uint64_t>(x);
    return static_cast<int64_t>(shift >= 0 ? u >> shift : u / d);
  }
};

// Enough resident blocks to fill the device; the grid-stride loops take the rest.
inline cudaError_t grid_size(int64_t threads_needed, int threads_per_block, unsigned* grid) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t wanted = (threads_needed + threads_per_block - 1) / threads_per_block;
  const int64_t cap = int64_t{sms > 0 ? sms : 1} * (2048 / threads_per_block) * 4;
  *grid = static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
  return cudaSuccess;
}

// Calls f(Traits{}) for the storage dtype.
template <class F>
cudaError_t with_traits(nf4::Dtype d, F&& f) {
  switch (d) {
    case nf4::Dtype::F32: return f(F32Traits{});
    case nf4::Dtype::BF16: return f(BF16Traits{});
    case nf4::Dtype::F16: return f(F16Traits{});
  }
  return cudaErrorInvalidValue;
}

inline bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

constexpr int kThreads = 256;

}  // namespace qlora::kernels::detail
