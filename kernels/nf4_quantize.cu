// CUDA NF4 quantization: block absmax, double quantization of the absmax scalers, and the
// packed 4-bit codes. Torch-free (declared in kernels/nf4_cuda.h); the numerics are those of
// quant/nf4_format.h, bit for bit: every float op is rounded to the storage dtype T right
// after it, the build passes --fmad=false so no multiply-add is contracted, and `/` stays the
// IEEE-correct division (never build this file with --use_fast_math).
//
// Quantize runs once per weight, so the kernels aim for coalesced single passes over x rather
// than peak bandwidth; the hot path is nf4_dequantize.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/nf4_cuda.h"
#include "kernels/nf4_cuda_common.cuh"

namespace qlora::kernels {
namespace {

using namespace detail;

// Reads N consecutive elements as floats; one 16-byte load when N elements fill 16 bytes
// (the caller guarantees the alignment).
template <class D, int N>
__device__ __forceinline__ void load_floats(const typename D::Storage* p, float (&f)[N]) {
  using S = typename D::Storage;
  if constexpr (N * sizeof(S) == 16) {
    union {
      uint4 v;
      S s[N];
    } u;
    u.v = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = D::to_float(u.s[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = D::to_float(p[k]);
  }
}

// ---- block absmax -------------------------------------------------------------------------
// `lanes` threads (a power of two <= 32) share one block so that for bf16 and block_size 64 a
// warp reads 4 blocks as 32 contiguous 16-byte loads; the max is exact, so the reduction order
// is free. No __launch_bounds__ here: with it ptxas aims at 32 registers and spills (fp16).
template <class D, int kVec>
__global__ void block_absmax_kernel(const typename D::Storage* __restrict__ x, int64_t numel,
                                    int64_t block_size, int64_t n_blocks, int lanes,
                                    typename D::Storage* __restrict__ absmax,
                                    int* __restrict__ nonfinite) {
  const int warp_lane = static_cast<int>(threadIdx.x & 31);
  const int lane = warp_lane & (lanes - 1);
  const int per_warp = 32 / lanes;
  const int sub = warp_lane / lanes;
  const int64_t warp = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (int64_t{gridDim.x} * blockDim.x) >> 5;
  const int64_t n_vec = block_size / kVec;
  bool bad = false;
  // The loop bound depends only on the warp, so every lane reaches the shuffles together.
  for (int64_t base = warp * per_warp; base < n_blocks; base += n_warps * per_warp) {
    const int64_t b = base + sub;
    float m = 0.0f;
    if (b < n_blocks) {
      const int64_t first = b * block_size;
      for (int64_t v = lane; v < n_vec; v += lanes) {
        const int64_t e = first + v * kVec;
        float f[kVec];
        if (e + kVec <= numel) {
          load_floats<D>(x + e, f);
        } else {  // the tail of x: elements past numel count as 0
#pragma unroll
          for (int k = 0; k < kVec; ++k) f[k] = e + k < numel ? D::to_float(x[e + k]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          bad |= !isfinite(f[k]);
          m = fmaxf(m, fabsf(f[k]));
        }
      }
    }
    for (int off = lanes / 2; off > 0; off >>= 1)
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (b < n_blocks && lane == 0) absmax[b] = D::to_storage(m);  // exact: |x| is a T value
  }
  if (bad) *nonfinite = 1;  // a benign race: every writer stores the same 1
}

// ---- double quantization ------------------------------------------------------------------
template <class D>
__device__ __forceinline__ float scaler_offset(const typename D::Storage* absmax, int64_t b,
                                               int64_t n_real_blocks, float mean) {
  return b < n_real_blocks ? D::round(D::to_float(absmax[b]) - mean) : 0.0f;
}

// One thread block per group (grid-stride over groups): max |s| over the group, then the
// scalers. s is recomputed in the second pass rather than kept: a group is at most a few KB.
template <class D>
__global__ void __launch_bounds__(kThreads)
    double_quantize_kernel(const typename D::Storage* __restrict__ absmax,
                           const typename D::Storage* __restrict__ mean_ptr,
                           int64_t scaler_block_size, int64_t n_real_blocks, int64_t n_groups,
                           int8_t* __restrict__ scalers,
                           typename D::Storage* __restrict__ factors) {
  __shared__ float warp_max[kThreads / 32];
  const float mean = D::to_float(*mean_ptr);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int n_warps = static_cast<int>(blockDim.x >> 5);
  for (int64_t g = blockIdx.x; g < n_groups; g += gridDim.x) {
    const int64_t first = g * scaler_block_size;
    float m = 0.0f;
    for (int64_t k = threadIdx.x; k < scaler_block_size; k += blockDim.x)
      m = fmaxf(m, fabsf(scaler_offset<D>(absmax, first + k, n_real_blocks, mean)));
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0) warp_max[warp] = m;
    __syncthreads();
    float smax = 0.0f;
    for (int w = 0; w < n_warps; ++w) smax = fmaxf(smax, warp_max[w]);
    __syncthreads();  // warp_max is rewritten by the next group

    // torchao's order: 256 / (2 * max|s|) computed as (1 / (2 * max)) * 256, each step in T.
    // smax == 0 gives factor +inf, stored as is (dequantize then computes 0 / inf = 0).
    const float two = D::round(2.0f * smax);
    const float recip = D::round(1.0f / two);
    const float factor = D::round(recip * 256.0f);
    if (threadIdx.x == 0) factors[g] = D::to_storage(factor);
    for (int64_t k = threadIdx.x; k < scaler_block_size; k += blockDim.x) {
      int q = 0;
      if (smax != 0.0f) {
        const float s = scaler_offset<D>(absmax, first + k, n_real_blocks, mean);
        const float r = rintf(D::round(s * factor));  // round half to even, like torch.round
        // NaN (only from inf * 0 in overflowing inputs) becomes 0, as an x86 float->int8 cast
        // of the clamped NaN does in the CPU reference.
        q = isnan(r) ? 0 : static_cast<int>(fminf(fmaxf(r, -128.0f), 127.0f));
      }
      scalers[first + k] = static_cast<int8_t>(q);
    }
  }
}

// ---- codes --------------------------------------------------------------------------------
// code(v) = #{k : v >= thresholds[k]} with v = x / absmax in T; the thresholds stay in the
// kernel's parameter space (constant bank), indexed only by unrolled constants.
template <class D>
__device__ __forceinline__ uint32_t code_of(float x, float a, const Nf4Tables& t) {
  const float v = a == 0.0f ? 0.0f : D::round(x / a);
  uint32_t c = 0;
#pragma unroll
  for (int k = 0; k < nf4::kNumCodes - 1; ++k) c += v >= t.thresholds[k] ? 1u : 0u;
  return c;
}

constexpr uint32_t kZeroWord = 0x01010101u * nf4::kZeroByte;

// Fast path (block_size % 16 == 0, x 16-byte and codes 8-byte aligned): a thread turns 16
// elements of one block into 8 code bytes, with 16-byte loads and one 8-byte store.
template <class D>
__global__ void __launch_bounds__(kThreads)
    quantize_codes_vec_kernel(const typename D::Storage* __restrict__ x,
                              const typename D::Storage* __restrict__ absmax, int64_t numel,
                              int64_t n_chunks, Div64 chunk_to_block, const Nf4Tables tables,
                              uint2* __restrict__ codes) {
  constexpr int kVec = 16 / sizeof(typename D::Storage);
  for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < n_chunks;
       c += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e0 = c * 16;
    if (e0 >= numel) {  // a whole chunk of padding
      codes[c] = make_uint2(kZeroWord, kZeroWord);
      continue;
    }
    const float a = D::to_float(absmax[chunk_to_block(c)]);
    float f[16];
    const bool full = e0 + 16 <= numel;
    if (full) {
#pragma unroll
      for (int l = 0; l < 16 / kVec; ++l) {
        float part[kVec];
        load_floats<D>(x + e0 + l * kVec, part);
#pragma unroll
        for (int k = 0; k < kVec; ++k) f[l * kVec + k] = part[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) f[k] = e0 + k < numel ? D::to_float(x[e0 + k]) : 0.0f;
    }
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const uint32_t code = full || e0 + k < numel ? code_of<D>(f[k], a, tables) : nf4::kZeroCode;
      // byte j = k / 2 sits at bits 8 * (j % 4) of word j / 4; the even element is its high
      // nibble.
      w[k / 8] |= code << (8 * ((k / 2) % 4) + (k % 2 == 0 ? 4 : 0));
    }
    codes[c] = make_uint2(w[0], w[1]);
  }
}

// Any even block_size, any alignment: one code byte (two elements) per thread.
template <class D>
__global__ void __launch_bounds__(kThreads)
    quantize_codes_kernel(const typename D::Storage* __restrict__ x,
                          const typename D::Storage* __restrict__ absmax, int64_t numel,
                          int64_t n_bytes, Div64 elem_to_block, const Nf4Tables tables,
                          uint8_t* __restrict__ codes) {
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < n_bytes;
       j += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = 2 * j;
    uint32_t hi = nf4::kZeroCode, lo = nf4::kZeroCode;
    if (e < numel) {
      // block_size is even, so both elements of a byte share a block.
      const float a = D::to_float(absmax[elem_to_block(e)]);
      hi = code_of<D>(D::to_float(x[e]), a, tables);
      if (e + 1 < numel) lo = code_of<D>(D::to_float(x[e + 1]), a, tables);
    }
    codes[j] = static_cast<uint8_t>(hi << 4 | lo);
  }
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------

cudaError_t nf4_block_absmax_cuda(nf4::Dtype dtype, const void* x, const nf4::Layout& layout,
                                  void* absmax, int* nonfinite, cudaStream_t stream) {
  const int64_t n_blocks = layout.n_blocks();
  if (n_blocks <= 0) return cudaSuccess;
  return with_traits(dtype, [&](auto traits) -> cudaError_t {
    using D = decltype(traits);
    using S = typename D::Storage;
    constexpr int kVec = 16 / sizeof(S);
    const bool vec = aligned(x, 16) && layout.block_size % kVec == 0;
    const int64_t n_vec = vec ? layout.block_size / kVec : layout.block_size;
    int lanes = 1;  // largest power of two <= min(32, vectors per block)
    while (lanes < 32 && 2 * lanes <= n_vec) lanes *= 2;
    const int64_t threads = (n_blocks + 32 / lanes - 1) / (32 / lanes) * 32;
    unsigned grid = 0;
    cudaError_t err = grid_size(threads, kThreads, &grid);
    if (err != cudaSuccess) return err;
    const S* xs = static_cast<const S*>(x);
    S* out = static_cast<S*>(absmax);
    if (vec)
      block_absmax_kernel<D, kVec><<<grid, kThreads, 0, stream>>>(
          xs, layout.numel, layout.block_size, n_blocks, lanes, out, nonfinite);
    else
      block_absmax_kernel<D, 1><<<grid, kThreads, 0, stream>>>(
          xs, layout.numel, layout.block_size, n_blocks, lanes, out, nonfinite);
    return cudaGetLastError();
  });
}

cudaError_t nf4_double_quantize_cuda(nf4::Dtype dtype, const void* absmax, const void* mean,
                                     const nf4::Layout& layout, int8_t* scalers, void* factors,
                                     cudaStream_t stream) {
  const int64_t n_groups = layout.n_groups();
  if (n_groups <= 0) return cudaSuccess;
  return with_traits(dtype, [&](auto traits) -> cudaError_t {
    using D = decltype(traits);
    using S = typename D::Storage;
    // Small groups get small thread blocks so scaler_block_size 1 does not idle 255 threads.
    int threads = 32;
    while (threads < kThreads && threads < layout.scaler_block_size) threads *= 2;
    unsigned grid = 0;
    cudaError_t err = grid_size(n_groups * threads, threads, &grid);
    if (err != cudaSuccess) return err;
    double_quantize_kernel<D><<<grid, threads, 0, stream>>>(
        static_cast<const S*>(absmax), static_cast<const S*>(mean), layout.scaler_block_size,
        layout.n_real_blocks(), n_groups, scalers, static_cast<S*>(factors));
    return cudaGetLastError();
  });
}

cudaError_t nf4_quantize_codes_cuda(nf4::Dtype dtype, const void* x, const void* absmax,
                                    const nf4::Layout& layout, const Nf4Tables& tables,
                                    uint8_t* codes, cudaStream_t stream) {
  const int64_t n_bytes = layout.code_bytes();
  if (n_bytes <= 0) return cudaSuccess;
  return with_traits(dtype, [&](auto traits) -> cudaError_t {
    using D = decltype(traits);
    using S = typename D::Storage;
    const S* xs = static_cast<const S*>(x);
    const S* am = static_cast<const S*>(absmax);
    unsigned grid = 0;
    cudaError_t err;
    // padded_numel is a multiple of block_size, so with block_size % 16 == 0 the chunks of
    // 16 elements tile the codes exactly and never straddle a block.
    if (layout.block_size % 16 == 0 && aligned(x, 16) && aligned(codes, 8)) {
      const int64_t n_chunks = layout.padded_numel / 16;
      if ((err = grid_size(n_chunks, kThreads, &grid)) != cudaSuccess) return err;
      quantize_codes_vec_kernel<D><<<grid, kThreads, 0, stream>>>(
          xs, am, layout.numel, n_chunks, Div64::make(layout.block_size / 16), tables,
          reinterpret_cast<uint2*>(codes));
    } else {
      if ((err = grid_size(n_bytes, kThreads, &grid)) != cudaSuccess) return err;
      quantize_codes_kernel<D><<<grid, kThreads, 0, stream>>>(
          xs, am, layout.numel, n_bytes, Div64::make(layout.block_size), tables, codes);
    }
    return cudaGetLastError();
  });
}

}  // namespace qlora::kernels
