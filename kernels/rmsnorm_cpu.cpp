// The RMSNorm passes of kernels/rmsnorm_cpu.h, written once over the N-lane vectors of
// kernels/simd.h and compiled per ISA (dispatch_isa).
#include "kernels/rmsnorm_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

using simd::Vec;

// Elements per parallel chunk: enough work that a second thread pays for its wake-up.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n)); }

// The storage dtype's rounding of a float vector (none for float).
template <int N, class T> QLORA_INLINE typename Vec<N>::F round_as(typename Vec<N>::F v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T buf[N];
    Vec<N>::store(buf, v);
    return Vec<N>::load(buf);
  }
}

// sum(a * b) over the row, a vector of partial sums reduced in a fixed order.
template <int N, class T, class Fn> QLORA_INLINE float row_sum(int64_t n, Fn&& term) {
  using V = Vec<N>;
  typename V::F acc = V::splat(0.0f);
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE { acc += term(i, w); });
  return V::sum(acc);
}

template <int N, class T>
QLORA_INLINE float forward_row(int64_t n, const T* x, const T* w, float eps, RmsScale scale, T* out) {
  using V = Vec<N>;
  const float ss = row_sum<N, T>(n, [&](int64_t i, int64_t k) QLORA_LAMBDA_INLINE {
    const typename V::F xv = V::load_n(x + i, k, 0.0f);
    return xv * xv;
  });
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  V::for_vectors(n, [&](int64_t i, int64_t k) QLORA_LAMBDA_INLINE {
    const typename V::F h = V::load_n(x + i, k, 0.0f) * rstd, wv = V::load_n(w + i, k, 0.0f);
    if (scale == RmsScale::kWeight) V::store_n(out + i, wv * round_as<N, T>(h), k);
    else V::store_n(out + i, h * (scale == RmsScale::kOnePlusWeight ? wv + 1.0f : wv), k);
  });
  return rstd;
}

template <int N, class T>
QLORA_INLINE void backward_row(int64_t n, const T* g, const T* x, const T* w, float rstd, RmsScale scale, T* gx) {
  using V = Vec<N>;
  const float one = scale == RmsScale::kOnePlusWeight ? 1.0f : 0.0f;
  const float dot = row_sum<N, T>(n, [&](int64_t i, int64_t k) QLORA_LAMBDA_INLINE {
    return V::load_n(g + i, k, 0.0f) * (V::load_n(w + i, k, 0.0f) + one) * V::load_n(x + i, k, 0.0f);
  });
  const float c = dot / static_cast<float>(n) * (rstd * rstd * rstd);
  V::for_vectors(n, [&](int64_t i, int64_t k) QLORA_LAMBDA_INLINE {
    const typename V::F gw = V::load_n(g + i, k, 0.0f) * (V::load_n(w + i, k, 0.0f) + one);
    V::store_n(gx + i, gw * rstd - V::load_n(x + i, k, 0.0f) * c, k);
  });
}

template <class T>
void forward(int64_t rows, int64_t n, const T* x, int64_t ldx, const T* w, float eps, RmsScale scale, T* out,
             int64_t ldo, float* rstd) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      for (int64_t r = r0; r < r1; ++r)
        rstd[r] = forward_row<lanes<isa()>>(n, x + r * ldx, w, eps, scale, out + r * ldo);
    });
  });
}

template <class T>
void backward(int64_t rows, int64_t n, const T* g, int64_t ldg, const T* x, int64_t ldx, const T* w,
              const float* rstd, RmsScale scale, T* gx, int64_t ldgx) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      for (int64_t r = r0; r < r1; ++r)
        backward_row<lanes<isa()>>(n, g + r * ldg, x + r * ldx, w, rstd[r], scale, gx + r * ldgx);
    });
  });
}

}  // namespace

void rms_norm_forward_cpu(int64_t rows, int64_t n, const float* x, int64_t ldx, const float* w, float eps,
                          RmsScale scale, float* out, int64_t ldo, float* rstd) {
  forward(rows, n, x, ldx, w, eps, scale, out, ldo, rstd);
}
void rms_norm_forward_cpu(int64_t rows, int64_t n, const uint16_t* x, int64_t ldx, const uint16_t* w, float eps,
                          RmsScale scale, uint16_t* out, int64_t ldo, float* rstd) {
  forward(rows, n, x, ldx, w, eps, scale, out, ldo, rstd);
}

void rms_norm_backward_cpu(int64_t rows, int64_t n, const float* grad, int64_t ldg, const float* x, int64_t ldx,
                           const float* w, const float* rstd, RmsScale scale, float* gx, int64_t ldgx) {
  backward(rows, n, grad, ldg, x, ldx, w, rstd, scale, gx, ldgx);
}
void rms_norm_backward_cpu(int64_t rows, int64_t n, const uint16_t* grad, int64_t ldg, const uint16_t* x,
                           int64_t ldx, const uint16_t* w, const float* rstd, RmsScale scale, uint16_t* gx,
                           int64_t ldgx) {
  backward(rows, n, grad, ldg, x, ldx, w, rstd, scale, gx, ldgx);
}

}  // namespace qlora::kernels
