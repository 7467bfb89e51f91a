// NF4 quantize on CPU: block absmax, double quantization of the scalers, packed codes.
// Bit-identical to quant/nf4_reference.cpp; the code search is the 15-threshold step
// function of quant/nf4_format.h (compare and count), which vectorizes, instead of torchao's
// 16-way argmin.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "kernels/cpu_dispatch.h"
#include "kernels/nf4_cpu.h"
#include "quant/nf4_reference.h"

namespace qlora::kernels {

namespace {

using nf4::Dtype;
using nf4::Layout;

constexpr int64_t kGrainBlocks = 256;  // 16K elements a task: big enough to amortize a task

template <Dtype D>
QLORA_INLINE bool absmax_range(const void* x_, const Layout& l, void* absmax_, int64_t b0,
                               int64_t b1) {
  using S = Storage<D>;
  const auto* x = static_cast<const typename S::T*>(x_);
  auto* absmax = static_cast<typename S::T*>(absmax_);
  bool finite = true;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * l.block_size, i1 = std::min(l.numel, i0 + l.block_size);
    float m = 0.0f;
    uint32_t bad = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const float v = std::fabs(S::load(x[i]));
      bad |= !(v <= 3.4028235e38f);  // NaN or Inf
      m = v > m ? v : m;
    }
    finite &= bad == 0;
    absmax[b] = S::store(i0 < l.numel ? m : 0.0f);
  }
  return finite;
}

template <Dtype D>
QLORA_INLINE void codes_range(const void* x_, const void* absmax_, const Layout& l,
                              const float* t, uint8_t* codes, int64_t b0, int64_t b1) {
  using S = Storage<D>;
  const auto* x = static_cast<const typename S::T*>(x_);
  const auto* absmax = static_cast<const typename S::T*>(absmax_);
  constexpr int64_t kChunk = 64;  // elements per inner step (even)
  for (int64_t b = b0; b < b1; ++b) {
    const float a = S::load(absmax[b]);
    const int64_t i0 = b * l.block_size, i1 = i0 + l.block_size;
    for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
      const int64_t n = std::min(kChunk, i1 - c0);
      const int64_t real = std::clamp<int64_t>(l.numel - c0, 0, n);
      uint8_t c[kChunk];
      if (real == n && a != 0.0f) {
        for (int64_t i = 0; i < kChunk; ++i) {  // fixed trip count: vectorizes
          const float v = S::round(S::load(x[c0 + (i < n ? i : 0)]) / a);
          uint8_t k = 0;
          for (int j = 0; j < nf4::kNumCodes - 1; ++j) k += v >= t[j];
          c[i] = k;
        }
      } else {  // tail of the tensor or an all-zero block
        for (int64_t i = 0; i < n; ++i) {
          c[i] = (i < real && a != 0.0f) ? nf4::nearest_code(t, S::round(S::load(x[c0 + i]) / a))
                                         : nf4::kZeroCode;
        }
      }
      uint8_t* out = codes + c0 / 2;
      for (int64_t j = 0; j < n / 2; ++j) out[j] = static_cast<uint8_t>(c[2 * j] << 4 | c[2 * j + 1]);
    }
  }
}

#define QLORA_DEFINE_CLONES(Name, D)                                                          \
  QLORA_VECTOR_CLONES bool absmax_##Name(const void* x, const Layout& l, void* a, int64_t b0, \
                                         int64_t b1) {                                        \
    return absmax_range<D>(x, l, a, b0, b1);                                                  \
  }                                                                                           \
  QLORA_VECTOR_CLONES void codes_##Name(const void* x, const void* a, const Layout& l,        \
                                        const float* t, uint8_t* c, int64_t b0, int64_t b1) { \
    codes_range<D>(x, a, l, t, c, b0, b1);                                                    \
  }
QLORA_DEFINE_CLONES(f32, Dtype::F32)
QLORA_DEFINE_CLONES(bf16, Dtype::BF16)
QLORA_DEFINE_CLONES(f16, Dtype::F16)
#undef QLORA_DEFINE_CLONES

}  // namespace

bool nf4_block_absmax_cpu(Dtype d, const void* x, const Layout& l, void* absmax) {
  auto fn = d == Dtype::BF16 ? absmax_bf16 : d == Dtype::F16 ? absmax_f16 : absmax_f32;
  std::atomic<bool> finite{true};
  at::parallel_for(0, l.n_blocks(), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    if (!fn(x, l, absmax, b0, b1)) finite = false;
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
  auto fn = d == Dtype::BF16 ? codes_bf16 : d == Dtype::F16 ? codes_f16 : codes_f32;
  const float* t = nf4::code_thresholds(d).data();
  at::parallel_for(0, l.n_blocks(), kGrainBlocks,
                   [&](int64_t b0, int64_t b1) { fn(x, absmax, l, t, codes, b0, b1); });
}

}  // namespace qlora::kernels
