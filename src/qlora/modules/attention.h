// Causal GQA attention (sliding window, logit soft-capping, attention sinks) and attention under an
// explicit mask (packed rows, a generation batch's padding), as free functions over q, k and v:
// training's case on the CPU by query blocks (modules/blocked_attention.h), a generation step's one
// query through ops::decode_attention, the rest SDPA or, with soft-capping, transformers' eager path.
// gpt-oss's sinks: the blocked attention where it runs, else the eager path (decode steps included).
// Numerics follow transformers' implementation of each family op for op where the order matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace qlora::modules {

// How a layer's attention scores are formed beyond q.k: the scale (default 1/sqrt(head_dim);
// Gemma: query_pre_attn_scalar^-0.5), a tanh soft-cap (Gemma 2: cap * tanh(s / cap), after
// scaling, before masking) and a sliding window (query i sees keys j with i - window < j <= i).
struct AttentionOptions {
  double scale = 0.0;    // 0: 1 / sqrt(head_dim)
  double softcap = 0.0;  // 0: none
  int64_t window = 0;    // 0: full causal
  // gpt-oss's learned attention sinks, [heads] in q's dtype: one more logit per head in each row's
  // softmax, attending to no value (transformers' eager_attention_forward: the row's max over the
  // scores and its sink subtracted, softmax in q's dtype, the sink's column dropped). Undefined: none.
  at::Tensor sinks;
};

// Causal attention over q [batch, heads, seq, d], k/v [batch, kv_heads, total, d] where the q
// positions are the last `seq` of `total` (total > seq with a KV cache). K/V heads are expanded
// to the query heads (GQA). Returns [batch, heads, seq, d].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionOptions& opt = {});

// Attention under an explicit boolean mask (true = query i may attend to key j), e.g. the
// block-causal mask of packed rows, or with a KV cache the left padding of a generation batch.
// q [batch, heads, seq, d], k/v [batch, kv_heads, total, d] with the queries at the last seq of the
// total key slots, attn_mask [batch, seq, total] bool; every query row must allow at least one key
// (an all-false row would softmax to NaN). K/V heads are expanded as in causal_attention. A window
// in `opt` is applied on top of the mask, by slot distance (packed samples and a padded row's
// tokens are contiguous, so within a sample that is the position distance). On the CPU a mask
// without a cache that hides every future key (as packing's does) runs the blocked attention.
// Returns [batch, heads, seq, d].
at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& attn_mask, const AttentionOptions& opt = {});

}  // namespace qlora::modules
