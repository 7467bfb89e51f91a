// The row passes of kernels/softmax_cpu.h, written once over the N-lane vectors of
// kernels/simd.h and compiled per ISA (dispatch_isa). bf16 rows are widened as they are loaded;
// causal attention's exps stay fp32 (in a per-thread row) until the one rounding of p = e / sum.
#include "kernels/softmax_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

using simd::Vec;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Elements per parallel chunk: enough work that a second thread pays for its wake-up.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n)); }

// The largest of x[0, n) (-inf for n == 0). A NaN may or may not win; the exp pass propagates it.
template <int N, class T> QLORA_INLINE float row_max(int64_t n, const T* x) {
  using V = Vec<N>;
  typename V::F acc = V::splat(-kInf);
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE { acc = V::max(acc, V::load_n(x + i, w, -kInf)); });
  return V::max_of(acc);
}

// out[i] = exp(x[i] - m) for i < n (NaN kept); returns their sum.
template <int N, class T, class O> QLORA_INLINE float exp_sum(int64_t n, const T* x, float m, O* out) {
  using V = Vec<N>;
  typename V::F acc = V::splat(0.0f);
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
    const typename V::F p = V::select_first(V::exp(V::load_n(x + i, w, 0.0f) - m), w, 0.0f);
    V::store_n(out + i, p, w);
    acc += p;
  });
  return V::sum(acc);
}

template <int N, class T> QLORA_INLINE void scale_row(int64_t n, const float* e, float c, T* x) {
  using V = Vec<N>;
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE { V::store_n(x + i, V::load_n(e + i, w, 0.0f) * c, w); });
}

template <int N, class T> QLORA_INLINE void grad_row(int64_t n, T* ds, const T* p, float delta) {
  using V = Vec<N>;
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
    V::store_n(ds + i, V::load_n(p + i, w, 0.0f) * (V::load_n(ds + i, w, 0.0f) - delta), w);
  });
}

// Causal softmax of rows [r0, r1); e: a row of `keys` floats for bf16 rows' exps (fp32 rows hold
// their own).
template <int N, class T>
QLORA_INLINE void causal_rows(int64_t r0, int64_t r1, int64_t nq, int64_t keys, T* s, float* e, float* lse,
                              int64_t lse_ld) {
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t h = row / nq, r = row % nq, valid = keys - nq + r + 1;
    T* x = s + row * keys;
    float* ex;
    if constexpr (std::is_same_v<T, float>) ex = x;
    else ex = e;
    const float m = row_max<N>(valid, x);
    const float sum = exp_sum<N>(valid, x, m, ex);
    scale_row<N>(valid, ex, 1.0f / sum, x);
    std::fill(x + valid, x + keys, T{});
    if (lse) lse[h * lse_ld + r] = m + std::log(sum);
  }
}

template <class T> void causal(int64_t heads, int64_t nq, int64_t keys, T* s, float* lse, int64_t lse_ld) {
  at::parallel_for(0, heads * nq, grain_rows(keys), [&](int64_t r0, int64_t r1) {
    std::vector<float> e(std::is_same_v<T, float> ? 0 : static_cast<size_t>(keys));
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      causal_rows<lanes<isa()>>(r0, r1, nq, keys, s, e.empty() ? nullptr : e.data(), lse, lse_ld);
    });
  });
}

template <class T>
void backward(int64_t heads, int64_t nq, int64_t keys, T* ds, const T* p, const float* delta, int64_t delta_ld) {
  at::parallel_for(0, heads * nq, grain_rows(keys), [&](int64_t r0, int64_t r1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      for (int64_t row = r0; row < r1; ++row)
        grad_row<lanes<isa()>>(keys, ds + row * keys, p + row * keys, delta[(row / nq) * delta_ld + row % nq]);
    });
  });
}

template <class T>
void online(int64_t rows, int64_t n, const T* z, int64_t ldz, T* p, int64_t ldp, float* m, float* s, float* rescale) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      constexpr int N = lanes<isa()>;
      for (int64_t r = r0; r < r1; ++r) {
        const float mx = row_max<N>(n, z + r * ldz), m_new = mx > m[r] ? mx : m[r];
        rescale[r] = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
        s[r] = s[r] * rescale[r] + exp_sum<N>(n, z + r * ldz, m_new, p + r * ldp);
        m[r] = m_new;
      }
    });
  });
}

}  // namespace

void causal_softmax_cpu(int64_t heads, int64_t nq, int64_t keys, float* s, float* lse, int64_t lse_ld) {
  causal(heads, nq, keys, s, lse, lse_ld);
}
void causal_softmax_cpu(int64_t heads, int64_t nq, int64_t keys, uint16_t* s, float* lse, int64_t lse_ld) {
  causal(heads, nq, keys, s, lse, lse_ld);
}

void softmax_backward_cpu(int64_t heads, int64_t nq, int64_t keys, float* ds, const float* p, const float* delta,
                          int64_t delta_ld) {
  backward(heads, nq, keys, ds, p, delta, delta_ld);
}
void softmax_backward_cpu(int64_t heads, int64_t nq, int64_t keys, uint16_t* ds, const uint16_t* p,
                          const float* delta, int64_t delta_ld) {
  backward(heads, nq, keys, ds, p, delta, delta_ld);
}

void online_softmax_cpu(int64_t rows, int64_t n, const float* z, int64_t ldz, float* p, int64_t ldp, float* m,
                        float* s, float* rescale) {
  online(rows, n, z, ldz, p, ldp, m, s, rescale);
}
void online_softmax_cpu(int64_t rows, int64_t n, const uint16_t* z, int64_t ldz, uint16_t* p, int64_t ldp, float* m,
                        float* s, float* rescale) {
  online(rows, n, z, ldz, p, ldp, m, s, rescale);
}

}  // namespace qlora::kernels
