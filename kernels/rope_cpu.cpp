// The RoPE pass of kernels/rope_cpu.h, over rows on ATen's intra-op threads; each row's
// multiply-adds vectorize (plain loops, cloned per x86 vector ISA).
#include "kernels/rope_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels/cpu_dispatch.h"

namespace qlora::kernels {

namespace {

QLORA_VECTOR_CLONES void rope_row(int64_t half, const float* __restrict t, const float* __restrict c,
                                  const float* __restrict s, float sign, float* __restrict out) {
  for (int64_t i = 0; i < half; ++i) {
    out[i] = t[i] * c[i] + sign * (t[half + i] * s[i]);
    out[half + i] = t[half + i] * c[half + i] - sign * (t[i] * s[half + i]);
  }
}

}  // namespace

void rope_cpu(int64_t B, int64_t H, int64_t S, int64_t d, const float* x, Strides4 xs, const float* cos,
              const float* sin, int64_t tsb, float sign, float* out, Strides4 os) {
  const int64_t rows = B * H * S, grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, d));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (H * S), h = r / S % H, s = r % S;
      const int64_t table = b * tsb + s * d;
      rope_row(d / 2, x + b * xs.b + h * xs.h + s * xs.s, cos + table, sin + table, sign,
               out + b * os.b + h * os.h + s * os.s);
    }
  });
}

}  // namespace qlora::kernels
