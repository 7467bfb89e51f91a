// NF4 quantize on CPU: block absmax, double quantization of the scalers, packed codes.
// Bit-identical to quant/nf4_reference.cpp; the code search is the 15-threshold step
// function of quant/nf4_format.h (compare and count), which vectorizes, instead of torchao's
// 16-way argmin.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "kernels/nf4_cpu.h"
#include "kernels/simd.h"
#include "quant/nf4_reference.h"

namespace qlora::kernels {

namespace {

using nf4::Dtype;
using nf4::Layout;

constexpr int64_t kGrainBlocks = 256;  // 16K elements a task: big enough to amortize a task
constexpr int64_t kBlockSize64 = 64;

// |x| as integer bits: for non-negative floats the integer order is the float order, so the
// absmax is an integer max (which vectorizes without fast-math), and Inf/NaN show up as bits
// at or above the infinity pattern.
template <Dtype D> struct AbsBits;
template <> struct AbsBits<Dtype::F32> {
  using U = uint32_t;
  static constexpr U kMask = 0x7fffffffu, kInf = 0x7f800000u;
};
template <> struct AbsBits<Dtype::BF16> {
  using U = uint16_t;
  static constexpr U kMask = 0x7fff, kInf = 0x7f80;
};
template <> struct AbsBits<Dtype::F16> {
  using U = uint16_t;
  static constexpr U kMask = 0x7fff, kInf = 0x7c00;
};

template <Dtype D>
QLORA_INLINE bool absmax_range(const void* x_, const Layout& l, void* absmax_, int64_t b0,
                               int64_t b1) {
  using B = AbsBits<D>;
  using U = typename B::U;
  const U* x = static_cast<const U*>(x_);
  U* absmax = static_cast<U*>(absmax_);
  U all = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * l.block_size, i1 = std::min(l.numel, i0 + l.block_size);
    U m = 0;
    if (i1 - i0 == kBlockSize64) {  // the common block size: a fixed trip count vectorizes
      for (int64_t i = 0; i < kBlockSize64; ++i) m = std::max<U>(m, x[i0 + i] & B::kMask);
    } else {
      for (int64_t i = i0; i < i1; ++i) m = std::max<U>(m, x[i] & B::kMask);
    }
    absmax[b] = m;
    all = std::max(all, m);
  }
  return all < B::kInf;
}

// Codes of m <= 64 elements (m even) of one block with absmax a != 0; kFixed64 makes m a
// compile-time 64 so the loops vectorize with no remainder handling.
template <Dtype D, bool kFixed64>
QLORA_INLINE void codes_chunk(const typename Storage<D>::T* x, float a, const float* t,
                              uint8_t* out, int64_t m) {
  using S = Storage<D>;
  const int64_t n = kFixed64 ? kBlockSize64 : m;
  int32_t c[kBlockSize64];
  for (int64_t i = 0; i < n; ++i) {
    const float v = S::round(S::load(x[i]) / a);
    int32_t k = 0;
    for (int j = 0; j < nf4::kNumCodes - 1; ++j) k += v >= t[j];
    c[i] = k;
  }
  for (int64_t j = 0; j < n / 2; ++j) out[j] = static_cast<uint8_t>(c[2 * j] << 4 | c[2 * j + 1]);
}

template <Dtype D>
QLORA_INLINE void codes_range(const void* x_, const void* absmax_, const Layout& l,
                              const float* t, uint8_t* codes, int64_t b0, int64_t b1) {
  using S = Storage<D>;
  const auto* x = static_cast<const typename S::T*>(x_);
  const auto* absmax = static_cast<const typename S::T*>(absmax_);
  for (int64_t b = b0; b < b1; ++b) {
    const float a = S::load(absmax[b]);
    const int64_t i0 = b * l.block_size;
    const int64_t real = std::clamp<int64_t>(l.numel - i0, 0, l.block_size);
    uint8_t* out = codes + i0 / 2;
    if (real == l.block_size && a != 0.0f) {
      if (l.block_size == kBlockSize64) {
        codes_chunk<D, true>(x + i0, a, t, out, kBlockSize64);
      } else {
        for (int64_t c0 = 0; c0 < l.block_size; c0 += kBlockSize64)
          codes_chunk<D, false>(x + i0 + c0, a, t, out + c0 / 2,
                                std::min(kBlockSize64, l.block_size - c0));
      }
      continue;
    }
    for (int64_t j = 0; j < l.block_size / 2; ++j) {  // tail of the tensor or an all-zero block
      auto code = [&](int64_t i) {
        return (i < real && a != 0.0f) ? nf4::nearest_code(t, S::round(S::load(x[i0 + i]) / a))
                                       : nf4::kZeroCode;
      };
      out[j] = static_cast<uint8_t>(code(2 * j) << 4 | code(2 * j + 1));
    }
  }
}

// Runs the range function for dtype d, compiled for the active ISA (the loops vectorize).
template <class Fn> void for_dtype_and_isa(Dtype d, Fn&& fn) {
  dispatch_dtype(d, [&](auto dt) { dispatch_isa([&](auto) QLORA_LAMBDA_INLINE { fn(dt); }); });
}

}  // namespace

bool nf4_block_absmax_cpu(Dtype d, const void* x, const Layout& l, void* absmax) {
  std::atomic<bool> finite{true};
  at::parallel_for(0, l.n_blocks(), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for_dtype_and_isa(d, [&](auto dt) QLORA_LAMBDA_INLINE {
      if (!absmax_range<decltype(dt)::value>(x, l, absmax, b0, b1)) finite = false;
    });
  });
  return finite;
}

void nf4_double_quantize_cpu(Dtype d, const void* absmax, float mean, const Layout& l,
                             int8_t* scalers, void* factors) {
  // n_blocks / 256 groups: cheap next to the codes, so the reference loop, run in parallel.
  at::parallel_for(0, l.n_groups(), 16, [&](int64_t g0, int64_t g1) {
    nf4::double_quantize_reference(d, absmax, mean, l, scalers, factors, g0, g1);
  });
}

void nf4_quantize_codes_cpu(Dtype d, const void* x, const void* absmax, const Layout& l,
                            uint8_t* codes) {
  const float* t = nf4::code_thresholds(d).data();
  at::parallel_for(0, l.n_blocks(), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for_dtype_and_isa(d, [&](auto dt) QLORA_LAMBDA_INLINE {
      codes_range<decltype(dt)::value>(x, absmax, l, t, codes, b0, b1);
    });
  });
}

}  // namespace qlora::kernels
