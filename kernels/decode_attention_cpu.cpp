// decode_attention_cpu.h's kernel. One task per (sequence, KV head): the allowed keys listed once,
// then for each query head of the group its scores (four keys at a time, one vector accumulator
// each, summed along D), the softmax over them (kernels/simd.h's exp), and the weighted sum of
// the value rows (up to four vectors of D at a time, the keys in order).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu_dispatch.h"
#include "kernels/decode_attention_cpu.h"
#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

// s[i] = (q . row(keys[i])) * scale, soft-capped when cap > 0; q fp32, rows at base + key * ld.
template <int L, class T>
QLORA_INLINE void scores(const float* q, const T* base, int64_t ld, const int64_t* keys, int64_t n, int64_t D,
                         float scale, float cap, float* s) {
  using V = simd::Vec<L>;
  using F = typename V::F;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const T* r0 = base + keys[i] * ld;
    const T* r1 = base + keys[i + 1] * ld;
    const T* r2 = base + keys[i + 2] * ld;
    const T* r3 = base + keys[i + 3] * ld;
    F a0 = V::splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += L) {
      const F qv = V::load(q + d);
      a0 = qv * V::load(r0 + d) + a0;
      a1 = qv * V::load(r1 + d) + a1;
      a2 = qv * V::load(r2 + d) + a2;
      a3 = qv * V::load(r3 + d) + a3;
    }
    s[i] = V::sum(a0) * scale, s[i + 1] = V::sum(a1) * scale;
    s[i + 2] = V::sum(a2) * scale, s[i + 3] = V::sum(a3) * scale;
  }
  for (; i < n; ++i) {
    const T* r = base + keys[i] * ld;
    F a = V::splat(0.0f);
    for (int64_t d = 0; d < D; d += L) a = V::load(q + d) * V::load(r + d) + a;
    s[i] = V::sum(a) * scale;
  }
  if (cap > 0)
    for (int64_t j = 0; j < n; ++j) s[j] = std::tanh(s[j] / cap) * cap;
}

// s[0, n) becomes exp(s - max); returns the reciprocal of their sum.
template <int L> QLORA_INLINE float softmax_weights(float* s, int64_t n) {
  using V = simd::Vec<L>;
  using F = typename V::F;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  F total = V::splat(0.0f);
  V::for_vectors(n, [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
    const F e = V::exp(V::load_n(s + i, w, 0.0f) - m);
    V::store_n(s + i, e, w);
    total = total + V::select_first(e, w, 0.0f);
  });
  return 1.0f / V::sum(total);
}

// out[c0, c0 + C L) = inv * sum_i p[i] row(keys[i])[c0, ...), C vectors at a time.
template <int L, int C, class T>
QLORA_INLINE void weighted_block(const T* base, int64_t ld, const int64_t* keys, const float* p, int64_t n, int64_t c0,
                                 float inv, T* out) {
  using V = simd::Vec<L>;
  using F = typename V::F;
  F acc[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) acc[c] = V::splat(0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const T* r = base + keys[i] * ld + c0;
    const F pv = V::splat(p[i]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c] = pv * V::load(r + c * L) + acc[c];
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) V::store(out + c0 + c * L, acc[c] * inv);
}

template <int L, class T>
QLORA_INLINE void weighted(const T* base, int64_t ld, const int64_t* keys, const float* p, int64_t n, int64_t D,
                           float inv, T* out) {
  int64_t c0 = 0;
  for (; c0 + 4 * L <= D; c0 += 4 * L) weighted_block<L, 4>(base, ld, keys, p, n, c0, inv, out);
  switch ((D - c0) / L) {
    case 3: weighted_block<L, 3>(base, ld, keys, p, n, c0, inv, out); break;
    case 2: weighted_block<L, 2>(base, ld, keys, p, n, c0, inv, out); break;
    case 1: weighted_block<L, 1>(base, ld, keys, p, n, c0, inv, out); break;
    default: break;
  }
}

// Sequence b, KV head g: every query head of its group.
template <int L, class T>
QLORA_INLINE void group(const DecodeAttention<T>& p, int64_t b, int64_t g, std::vector<int64_t>& keys,
                        std::vector<float>& s, std::vector<float>& qf) {
  keys.clear();
  const bool* allowed = p.allowed ? p.allowed + b * p.allowed_ld : nullptr;
  for (int64_t j = 0; j < p.T; ++j)
    if (!allowed || allowed[j]) keys.push_back(j);
  const int64_t n = static_cast<int64_t>(keys.size()), rep = p.H / p.KVH;
  const T* kb = p.k + b * p.k_sb + g * p.k_sh;
  const T* vb = p.v + b * p.v_sb + g * p.v_sh;
  for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
    const T* q = p.q + b * p.q_sb + h * p.q_sh;
    T* out = p.out + b * p.o_sb + h * p.o_sh;
    if (n == 0) {
      std::fill(out, out + p.D, T{});  // bit pattern 0: +0 in fp32 and bf16
      continue;
    }
    for (int64_t d = 0; d < p.D; ++d) qf[d] = simd::Vec<L>::scalar(q[d]);
    scores<L>(qf.data(), kb, p.k_st, keys.data(), n, p.D, p.scale, p.softcap, s.data());
    const float inv = softmax_weights<L>(s.data(), n);
    weighted<L>(vb, p.v_st, keys.data(), s.data(), n, p.D, inv, out);
  }
}

template <class T> void run(const DecodeAttention<T>& p) {
  // Enough multiply-adds per chunk of tasks to be worth a second thread.
  const int64_t per_task = std::max<int64_t>(1, (p.H / p.KVH) * p.T * p.D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / per_task);
  at::parallel_for(0, p.B * p.KVH, grain, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> keys;
    keys.reserve(static_cast<size_t>(p.T));
    std::vector<float> s(static_cast<size_t>(p.T)), qf(static_cast<size_t>(p.D));
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
      for (int64_t t = t0; t < t1; ++t) group<lanes<decltype(isa)::value>>(p, t / p.KVH, t % p.KVH, keys, s, qf);
    });
  });
}

}  // namespace

void decode_attention_cpu(const DecodeAttention<float>& p) { run(p); }
void decode_attention_cpu(const DecodeAttention<uint16_t>& p) { run(p); }

}  // namespace qlora::kernels
