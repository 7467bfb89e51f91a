// CUDA NF4 dequantization, the hot path: it runs before every NF4 matmul, forward and
// backward, because base weights are never kept dequantized. Torch-free (declared in
// kernels/nf4_cuda.h); numerics are those of quant/nf4_format.h bit for bit:
//   deq_b = T(T(scaler_b / factor_g) + mean),  out = T(codebook[code] * deq_b) -> out dtype
// each op rounded to T, no FMA contraction (--fmad=false), IEEE `/` (never --use_fast_math).
//
// Memory-bound design: one thread produces exactly 16 bytes of output (8 bf16/fp16 or 4 fp32
// values) from 4 or 2 bytes of codes, so a warp's loads and its 16-byte stores are each one
// contiguous run. The unit never straddles a quantization block, so deq is computed once per
// unit; the 16-entry codebook sits in shared memory (16 words, 16 banks: lookups never
// conflict).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/nf4_cuda.h"
#include "kernels/nf4_cuda_common.cuh"

namespace qlora::kernels {
namespace {

using namespace detail;

// v (a value of storage dtype D, as float) stored as output dtype O. Rounding to D first and
// then to O is what the format defines; when O is D the second rounding is the identity, so
// one conversion does.
template <class D, class O>
__device__ __forceinline__ typename O::Storage to_output(float v) {
  if constexpr (std::is_same_v<D, O>) {
    return O::to_storage(v);
  } else {
    return O::to_storage(D::round(v));
  }
}

// Kernel parameters live in the constant bank, which serializes lanes reading different
// addresses; the codebook is indexed by data, so it is copied to shared memory first.
__device__ __forceinline__ void load_codebook(const Nf4Tables& tables, float* codebook) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < nf4::kNumCodes; ++k) codebook[k] = tables.codebook[k];
  }
  __syncthreads();
}

template <class D>
__device__ __forceinline__ float block_scale(const int8_t* scalers,
                                             const typename D::Storage* factors, int64_t b,
                                             int64_t g, float mean) {
  const float factor = D::to_float(factors[g]);
  return D::round(D::round(static_cast<float>(scalers[b]) / factor) + mean);
}

// Fast path: unit u = 16 bytes of output = kOut values = kOut / 2 code bytes, all in block
// u / units_per_block (block_size % kOut == 0). Needs out 16-byte and codes kOut/2-byte
// aligned.
template <class D, class O>
__global__ void __launch_bounds__(kThreads)
    dequantize_vec_kernel(const uint8_t* __restrict__ codes, const int8_t* __restrict__ scalers,
                          const typename D::Storage* __restrict__ factors,
                          const typename D::Storage* __restrict__ mean_ptr, int64_t numel,
                          int64_t n_units, Div64 unit_to_block, Div64 block_to_group,
                          const Nf4Tables tables, typename O::Storage* __restrict__ out) {
  using OS = typename O::Storage;
  constexpr int kOut = 16 / sizeof(OS);  // 8 or 4
  constexpr int kBytes = kOut / 2;       // 4 or 2
  using CodeWord = std::conditional_t<kBytes == 4, uint32_t, uint16_t>;
  __shared__ float codebook[nf4::kNumCodes];
  load_codebook(tables, codebook);
  const float mean = D::to_float(*mean_ptr);
  for (int64_t u = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < n_units;
       u += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = unit_to_block(u);
    const float deq = block_scale<D>(scalers, factors, b, block_to_group(b), mean);
    const uint32_t word = reinterpret_cast<const CodeWord*>(codes)[u];
    union {
      uint4 v;
      OS s[kOut];
    } r;
#pragma unroll
    for (int k = 0; k < kBytes; ++k) {
      // Byte k of the word is element pair k (little endian); the even element is the high
      // nibble.
      const uint32_t byte = word >> (8 * k);
      r.s[2 * k] = to_output<D, O>(codebook[(byte >> 4) & 15u] * deq);
      r.s[2 * k + 1] = to_output<D, O>(codebook[byte & 15u] * deq);
    }
    const int64_t e0 = u * kOut;
    if (e0 + kOut <= numel) {
      *reinterpret_cast<uint4*>(out + e0) = r.v;
    } else {  // the last, partial unit: nothing is written past numel
#pragma unroll
      for (int k = 0; k < kOut; ++k)
        if (e0 + k < numel) out[e0 + k] = r.s[k];
    }
  }
}

// Any even block_size, any alignment: one code byte (two values) per thread.
template <class D, class O>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ codes, const int8_t* __restrict__ scalers,
                      const typename D::Storage* __restrict__ factors,
                      const typename D::Storage* __restrict__ mean_ptr, int64_t numel,
                      int64_t n_bytes, Div64 elem_to_block, Div64 block_to_group,
                      const Nf4Tables tables, typename O::Storage* __restrict__ out) {
  __shared__ float codebook[nf4::kNumCodes];
  load_codebook(tables, codebook);
  const float mean = D::to_float(*mean_ptr);
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < n_bytes;
       j += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = 2 * j;
    const int64_t b = elem_to_block(e);  // block_size is even: both values share the block
    const float deq = block_scale<D>(scalers, factors, b, block_to_group(b), mean);
    const uint32_t byte = codes[j];
    out[e] = to_output<D, O>(codebook[byte >> 4] * deq);
    if (e + 1 < numel) out[e + 1] = to_output<D, O>(codebook[byte & 15u] * deq);
  }
}

}  // namespace

cudaError_t nf4_dequantize_cuda(nf4::Dtype dtype, nf4::Dtype out_dtype, const uint8_t* codes,
                                const int8_t* scalers, const void* factors, const void* mean,
                                const nf4::Layout& layout, const Nf4Tables& tables, void* out,
                                cudaStream_t stream) {
  if (layout.numel <= 0) return cudaSuccess;
  return with_traits(dtype, [&](auto d_traits) -> cudaError_t {
    return with_traits(out_dtype, [&](auto o_traits) -> cudaError_t {
      using D = decltype(d_traits);
      using O = decltype(o_traits);
      using DS = typename D::Storage;
      using OS = typename O::Storage;
      constexpr int64_t kOut = 16 / sizeof(OS);
      const auto* f = static_cast<const DS*>(factors);
      const auto* m = static_cast<const DS*>(mean);
      auto* o = static_cast<OS*>(out);
      const Div64 block_to_group = Div64::make(layout.scaler_block_size);
      unsigned grid = 0;
      cudaError_t err;
      if (layout.block_size % kOut == 0 && aligned(out, 16) && aligned(codes, kOut / 2)) {
        const int64_t n_units = (layout.numel + kOut - 1) / kOut;
        if ((err = grid_size(n_units, kThreads, &grid)) != cudaSuccess) return err;
        dequantize_vec_kernel<D, O><<<grid, kThreads, 0, stream>>>(
            codes, scalers, f, m, layout.numel, n_units, Div64::make(layout.block_size / kOut),
            block_to_group, tables, o);
      } else {
        const int64_t n_bytes = (layout.numel + 1) / 2;
        if ((err = grid_size(n_bytes, kThreads, &grid)) != cudaSuccess) return err;
        dequantize_kernel<D, O><<<grid, kThreads, 0, stream>>>(
            codes, scalers, f, m, layout.numel, n_bytes, Div64::make(layout.block_size),
            block_to_group, tables, o);
      }
      return cudaGetLastError();
    });
  });
}

}  // namespace qlora::kernels
