// The RoPE pass of kernels/rope_cpu.h, over rows on ATen's intra-op threads; each row written once
// over the N-lane vectors of kernels/simd.h and compiled per ISA (dispatch_isa).
#include "kernels/rope_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

using simd::Vec;

template <int N, class T, class C>
QLORA_INLINE void rope_row(int64_t half, const T* t, const C* c, const C* s, float sign, T* out) {
  using V = Vec<N>;
  const auto pair = [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
    const typename V::F t1 = V::load_n(t + i, w, 0.0f), t2 = V::load_n(t + half + i, w, 0.0f);
    V::store_n(out + i, t1 * V::load_n(c + i, w, 0.0f) + sign * (t2 * V::load_n(s + i, w, 0.0f)), w);
    V::store_n(out + half + i, t2 * V::load_n(c + half + i, w, 0.0f) - sign * (t1 * V::load_n(s + half + i, w, 0.0f)),
               w);
  };
  if (half < N || half % N == 0 || static_cast<const void*>(t) == static_cast<const void*>(out)) {
    V::for_vectors(half, pair);
    return;
  }
  // A half not a multiple of N (the towers' 36): its tail as one whole vector ending at the half's end,
  // overlapping the one before (out of place, those lanes are written again with the same values),
  // instead of element-wise partial loads.
  for (int64_t i = 0; i + N <= half; i += N) pair(i, N);
  pair(half - N, N);
}

template <class T, class C>
void rope(int64_t B, int64_t H, int64_t S, int64_t d, const T* x, Strides4 xs, const C* cos, const C* sin, int64_t tsb,
          float sign, T* out, Strides4 os) {
  const int64_t rows = B * H * S, grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, d));
  // Rows in memory order: with x laid out [B, S, H, d] (the projections' output), the heads of a
  // position in turn, so that its table row is read once from memory for all of them.
  const bool heads_inner = xs.h < xs.s;
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / (H * S), h = heads_inner ? r % H : r / S % H, s = heads_inner ? r / H % S : r % S;
        const int64_t table = b * tsb + s * d;
        rope_row<lanes<isa()>>(d / 2, x + b * xs.b + h * xs.h + s * xs.s, cos + table, sin + table, sign,
                               out + b * os.b + h * os.h + s * os.s);
      }
    });
  });
}

}  // namespace

void rope_cpu(int64_t B, int64_t H, int64_t S, int64_t d, const float* x, Strides4 xs, const float* cos,
              const float* sin, int64_t tsb, float sign, float* out, Strides4 os) {
  rope(B, H, S, d, x, xs, cos, sin, tsb, sign, out, os);
}
void rope_cpu(int64_t B, int64_t H, int64_t S, int64_t d, const uint16_t* x, Strides4 xs, const uint16_t* cos,
              const uint16_t* sin, int64_t tsb, float sign, uint16_t* out, Strides4 os) {
  rope(B, H, S, d, x, xs, cos, sin, tsb, sign, out, os);
}
void rope_cpu(int64_t B, int64_t H, int64_t S, int64_t d, const uint16_t* x, Strides4 xs, const float* cos,
              const float* sin, int64_t tsb, float sign, uint16_t* out, Strides4 os) {
  rope(B, H, S, d, x, xs, cos, sin, tsb, sign, out, os);
}

}  // namespace qlora::kernels
