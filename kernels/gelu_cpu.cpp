// GELU (tanh approximation) for kernels/gelu_cpu.h over the N-lane vectors of kernels/simd.h,
// compiled per ISA (dispatch_isa).
#include "kernels/gelu_cpu.h"

#include <ATen/Parallel.h>

#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

using simd::Vec;

constexpr int64_t kGrainElements = 1 << 15;  // enough work that a second thread pays for its wake-up

template <int N> QLORA_INLINE typename Vec<N>::F gelu_tanh(typename Vec<N>::F x) {
  constexpr float k2Beta = 2.0f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  constexpr float k2BetaKappa = k2Beta * 0.044715f;
  const typename Vec<N>::F two_u = x * (k2Beta + k2BetaKappa * (x * x));
  return x / (1.0f + Vec<N>::exp(-two_u));
}

template <class T> void inplace(int64_t n, T* x) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t i0, int64_t i1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      using V = Vec<lanes<isa()>>;
      V::for_vectors(i1 - i0, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
        T* p = x + i0 + i;
        V::store_n(p, gelu_tanh<V::kLanes>(V::load_n(p, w, 0.0f)), w);
      });
    });
  });
}

}  // namespace

void gelu_tanh_inplace_cpu(int64_t n, float* x) { inplace(n, x); }
void gelu_tanh_inplace_cpu(int64_t n, uint16_t* x) { inplace(n, x); }

}  // namespace qlora::kernels
