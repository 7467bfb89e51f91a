// The pieces of a Llama decoder, as free functions over plain structs of tensors: RMSNorm,
// rotate-half RoPE (with llama3 frequency scaling), causal GQA attention, SwiGLU MLP, the decoder
// layer, per-layer activation checkpointing and a KV cache for generation.
// Numerics follow transformers' Llama implementation op for op where the order matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "qlora/modules/lora_linear.h"
#include "qlora/modules/rope_scaling.h"

namespace qlora::modules {

// HF's LlamaRMSNorm: normalise in fp32, cast back to x's dtype, then multiply by the weight
// (weight * normed, in that order and in the promoted dtype).
// x: [..., dim]; weight: [dim]. Returns [..., dim].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Inverse frequencies [head_dim / 2] fp32: 1 / theta^(2i / head_dim), then llama3 scaling if given.
at::Tensor rope_inv_freq(int64_t head_dim, double theta,
                         const std::optional<Llama3RopeScaling>& scaling);

struct RopeTables {
  // [seq, head_dim] (one position range shared by every row) or [batch, seq, head_dim] (per-token
  // positions, e.g. packed rows whose positions restart at 0 per sample), in the compute dtype.
  at::Tensor cos, sin;
};
// positions: [seq] or [batch, seq] int64; the tables get the same leading dims plus head_dim.
// Angles are formed in fp32 and cast at the end, as transformers does.
RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, at::ScalarType dtype);

// Rotate-half RoPE: x * cos + rotate_half(x) * sin. x: [batch, heads, seq, head_dim].
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

// Per-layer K/V for generation: keys/values for every position seen so far.
struct KvCache {
  std::vector<at::Tensor> k, v;  // per layer: [batch, kv_heads, past, head_dim]
  int64_t length() const { return k.empty() || !k[0].defined() ? 0 : k[0].size(2); }
  void reset() { k.clear(); v.clear(); }
};

// Causal attention over q [batch, heads, seq, d], k/v [batch, kv_heads, total, d] where the q
// positions are the last `seq` of `total` (total > seq with a KV cache). K/V heads are expanded
// to the query heads (GQA). Returns [batch, heads, seq, d].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Attention under an explicit boolean mask (true = query i may attend to key j), e.g. the
// block-causal mask of packed rows. q [batch, heads, seq, d], k/v [batch, kv_heads, seq, d],
// attn_mask [batch, seq, seq] bool; every query row must allow at least one key (an all-false row
// would softmax to NaN). K/V heads are expanded as in causal_attention. Returns [batch, heads, seq, d].
at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& attn_mask);

struct DecoderLayer {
  at::Tensor input_layernorm, post_attention_layernorm;  // [hidden], compute dtype, frozen
  LoraLinear q_proj, k_proj, v_proj, o_proj;           // [heads*d, hidden] ... [hidden, heads*d]
  LoraLinear gate_proj, up_proj, down_proj;            // [inter, hidden] x2, [hidden, inter]
  // The trainable tensors of this layer (LoRA A/B of every adapted projection).
  std::vector<at::Tensor> trainable() const;
};

struct LayerDims {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
};

// down(silu(gate(x)) * up(x)). x: [batch, seq, hidden].
at::Tensor swiglu_mlp(const DecoderLayer& layer, const at::Tensor& x, bool training);

// One pre-norm decoder layer. h: [batch, seq, hidden]; rope tables for the seq positions.
// cache_k/cache_v (optional, together): this layer's cache entries, extended in place.
// attn_mask (optional, [batch, seq, seq] bool, true = may attend): replaces plain causal attention
// (packed rows); it cannot be combined with a cache.
at::Tensor decoder_layer_forward(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& h,
                                 const RopeTables& rope, bool training, at::Tensor* cache_k = nullptr,
                                 at::Tensor* cache_v = nullptr, const at::Tensor& attn_mask = at::Tensor());

// Activation checkpointing: runs `fn(h)` without recording a graph, keeping only h; backward
// replays fn with grad enabled (and the RNG state of the forward, so dropout masks agree) and
// back-propagates into h and `params` (the tensors fn uses that need gradients).
at::Tensor checkpointed(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& h,
                        const std::vector<at::Tensor>& params);

}  // namespace qlora::modules
