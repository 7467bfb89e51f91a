// Attention of a decode step: one new query per sequence against its cached keys and values. The
// ATen path (scaled_dot_product_attention, or matmul + softmax + matmul with soft-capping) runs
// two matrix-vector products per (sequence, head), each a BLAS call on a few thousand values, and
// repeats the K/V heads of grouped-query attention into a copy; here each (sequence, KV head) is one
// task that reads its keys and values once, in place, for every query head of its group.
// q [B, H, D], k and v [B, KVH, T, D] (any strides but a unit one along D), out [B, H, D]; H a
// multiple of KVH (query head h reads KV head h / (H / KVH)). allowed (may be null): [B, T] bool
// (row stride allowed_ld, 0 to share one row), the keys each sequence may see: padding, windows.
// Scores q.k * scale, optionally soft-capped (cap * tanh(s / cap)), softmax over the allowed keys
// in fp32, then the weighted sum of v. Every output is summed in a fixed order whatever the thread
// count. fp32 or bf16 (uint16_t bit patterns, widened to fp32; the output rounded once). A
// sequence with no allowed key gets zeros. D a multiple of 16.
#pragma once

#include <cstdint>

namespace qlora::kernels {

template <class E> struct DecodeAttention {  // E: float, or uint16_t for bf16
  int64_t B = 0, H = 0, KVH = 0, T = 0, D = 0;
  const E* q = nullptr;
  int64_t q_sb = 0, q_sh = 0;
  const E* k = nullptr;
  int64_t k_sb = 0, k_sh = 0, k_st = 0;
  const E* v = nullptr;
  int64_t v_sb = 0, v_sh = 0, v_st = 0;
  const bool* allowed = nullptr;
  int64_t allowed_ld = 0;
  float scale = 1.0f, softcap = 0.0f;
  E* out = nullptr;
  int64_t o_sb = 0, o_sh = 0;
};

void decode_attention_cpu(const DecodeAttention<float>& p);
void decode_attention_cpu(const DecodeAttention<uint16_t>& p);

}  // namespace qlora::kernels
