// The SwiGLU passes of kernels/swiglu_cpu.h, written once over the N-lane vectors of
// kernels/simd.h (exp within 2 ulp of expf) and compiled per ISA (dispatch_isa).
#include "kernels/swiglu_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

using simd::Vec;

// Elements per parallel chunk: enough work that a second thread pays for its wake-up.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n)); }

template <int N> QLORA_INLINE typename Vec<N>::F sigmoid(typename Vec<N>::F g) {
  return 1.0f / (1.0f + Vec<N>::exp(-g));
}

template <int N, class T> QLORA_INLINE void forward_row(int64_t n, const T* g, const T* u, T* out) {
  using V = Vec<N>;
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
    const typename V::F gv = V::load_n(g + i, w, 0.0f);
    V::store_n(out + i, gv * sigmoid<N>(gv) * V::load_n(u + i, w, 0.0f), w);
  });
}

template <int N, class T>
QLORA_INLINE void backward_row(int64_t n, const T* grad, const T* g, const T* u, T* dg, T* du) {
  using V = Vec<N>;
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
    const typename V::F gv = V::load_n(g + i, w, 0.0f), gr = V::load_n(grad + i, w, 0.0f), s = sigmoid<N>(gv);
    V::store_n(du + i, gr * (gv * s), w);
    V::store_n(dg + i, gr * V::load_n(u + i, w, 0.0f) * (s * (1.0f + gv * (1.0f - s))), w);
  });
}

template <class T>
void forward(int64_t rows, int64_t n, const T* g, int64_t ldg, const T* u, int64_t ldu, T* out, int64_t ldo) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      for (int64_t r = r0; r < r1; ++r) forward_row<lanes<isa()>>(n, g + r * ldg, u + r * ldu, out + r * ldo);
    });
  });
}

template <class T>
void backward(int64_t rows, int64_t n, const T* grad, int64_t ldgrad, const T* g, int64_t ldg, const T* u, int64_t ldu,
              T* dg, int64_t lddg, T* du, int64_t lddu) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      for (int64_t r = r0; r < r1; ++r)
        backward_row<lanes<isa()>>(n, grad + r * ldgrad, g + r * ldg, u + r * ldu, dg + r * lddg, du + r * lddu);
    });
  });
}

}  // namespace

void swiglu_forward_cpu(int64_t rows, int64_t n, const float* g, int64_t ldg, const float* u, int64_t ldu, float* out,
                        int64_t ldo) {
  forward(rows, n, g, ldg, u, ldu, out, ldo);
}
void swiglu_forward_cpu(int64_t rows, int64_t n, const uint16_t* g, int64_t ldg, const uint16_t* u, int64_t ldu,
                        uint16_t* out, int64_t ldo) {
  forward(rows, n, g, ldg, u, ldu, out, ldo);
}

void swiglu_backward_cpu(int64_t rows, int64_t n, const float* grad, int64_t ldgrad, const float* g, int64_t ldg,
                         const float* u, int64_t ldu, float* dg, int64_t lddg, float* du, int64_t lddu) {
  backward(rows, n, grad, ldgrad, g, ldg, u, ldu, dg, lddg, du, lddu);
}
void swiglu_backward_cpu(int64_t rows, int64_t n, const uint16_t* grad, int64_t ldgrad, const uint16_t* g, int64_t ldg,
                         const uint16_t* u, int64_t ldu, uint16_t* dg, int64_t lddg, uint16_t* du, int64_t lddu) {
  backward(rows, n, grad, ldgrad, g, ldg, u, ldu, dg, lddg, du, lddu);
}

}  // namespace qlora::kernels
