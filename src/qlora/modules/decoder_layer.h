// A Llama-shaped decoder layer as free functions over plain structs of tensors: its tensors
// (DecoderLayer), what its forward needs besides them (LayerDims), and the forward in its pre-norm
// (Llama), sandwich-norm (Gemma) and post-norm (OLMo) forms: attention (modules/attention.h) or a
// Gated DeltaNet (modules/gated_delta_net.h) as the mixer, the gated MLP (modules/gated_mlp.h), and
// Gemma 4's per-layer input and KV sharing.
// Numerics follow transformers' implementation of each family op for op where the order matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "qlora/modules/attention.h"
#include "qlora/modules/kv_cache.h"
#include "qlora/modules/lora_linear.h"
#include "qlora/modules/moe.h"
#include "qlora/modules/options.h"
#include "qlora/modules/rope.h"

namespace qlora::modules {

// A decoder layer's tensors. Which optional ones are defined is the family's (its architecture
// rows decide what is loaded) and selects the forward's form.
struct DecoderLayer {
  at::Tensor input_layernorm, post_attention_layernorm;  // [hidden], compute dtype, frozen
  // Gemma's sandwich norms: with them, post_attention_layernorm normalises the attention output
  // and pre_feedforward_layernorm the MLP input; post_feedforward_layernorm the MLP output.
  at::Tensor pre_feedforward_layernorm, post_feedforward_layernorm;
  // [head_dim] (Qwen3, Gemma 3), per head; or [heads * head_dim], [kv_heads * head_dim] (OLMo),
  // over all heads. Without input_layernorm (OLMo), post_attention_layernorm and
  // post_feedforward_layernorm close the branches and nothing normalises their inputs.
  at::Tensor q_norm, k_norm;
  LoraLinear q_proj, k_proj, v_proj, o_proj;           // [heads*d, hidden] ... [hidden, heads*d]
  LoraLinear gate_proj, up_proj, down_proj;            // [inter, hidden] x2, [hidden, inter]
  // Phi-3's fused projections, used instead of q/k/v and gate/up when set: qkv_proj stacks q, k
  // and v along its output, gate_up_proj stacks gate and up.
  LoraLinear qkv_proj, gate_up_proj;
  // Qwen3.5's Gated DeltaNet layers, instead of attention (modules/gated_delta_net.h): projections to
  // the conv's q/k/v channels, the output gate z, beta's and the decay's logits, and back to hidden;
  // the depthwise conv weight [channels, 1, kernel], A_log and dt_bias [value heads], and the gated
  // norm's weight [value_head_dim].
  LoraLinear in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
  at::Tensor conv1d, A_log, dt_bias, linear_norm;
  // Gemma 4's per-layer input: after the MLP, gate [per-layer dim, hidden] -> act -> times the
  // layer's per-layer input -> projection [hidden, per-layer dim] -> post_per_layer_input_norm,
  // added to the residual; then the whole output is scaled by layer_scalar [1].
  LoraLinear per_layer_input_gate, per_layer_projection;
  at::Tensor post_per_layer_input_norm, layer_scalar;
  // A Mixture-of-Experts layer (modules/moe.h), instead of the gated MLP: the router's weight
  // [experts, hidden] (compute dtype, frozen) and the routed experts.
  at::Tensor router;
  Experts experts;
  // Qwen3.5-MoE's shared expert beside the routed ones: a gated MLP (gate, up [inter, hidden], down
  // [hidden, inter]) every token takes, scaled by sigmoid(x @ shared_expert_gate^T) ([1, hidden],
  // compute dtype, frozen).
  LoraLinear shared_gate_proj, shared_up_proj, shared_down_proj;
  at::Tensor shared_expert_gate;
  // Gemma 4's MoE (enable_moe_block), beside the gated MLP rather than instead of it: the router's
  // scale [hidden] and per_expert_scale [experts] (RouterTensors), the experts' input norm and the
  // norms closing the MLP's and the experts' branches before post_feedforward_layernorm.
  at::Tensor router_scale, per_expert_scale;
  at::Tensor pre_feedforward_layernorm_2, post_feedforward_layernorm_1, post_feedforward_layernorm_2;
  // gpt-oss: the router's bias [experts] (compute dtype, frozen; undefined: none) and each attention
  // head's learned sink logit [heads] (AttentionOptions::sinks).
  at::Tensor router_bias, sinks;
  bool is_linear() const { return in_proj_qkv.out_features > 0; }
  bool is_moe() const { return router.defined(); }
  // Gemma 4's KV-shared layers compute queries only and attend over an earlier layer's K/V.
  bool kv_shared() const { return q_proj.out_features > 0 && k_proj.out_features == 0; }
  // The trainable tensors of this layer (LoRA A/B of every adapted projection).
  std::vector<at::Tensor> trainable() const;
};

// What the forward of one layer needs besides its tensors.
struct LayerDims {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  RmsScale norm = RmsScale::kWeight;  // the form of every RMSNorm of the layer
  bool v_norm = false;  // Gemma 4: values are RMS-normalised (no weight) per head, as keys are by k_norm
  MlpActivation activation = MlpActivation::kSilu;
  AttentionOptions attention;
  bool rope = true;  // false: q and k are not rotated (SmolLM3's NoPE layers)
  bool output_gate = false;  // Qwen3.5: q_proj yields [query, gate] per head; output *= sigmoid(gate)
  GatedDeltaDims gated_delta;  // a Gated DeltaNet layer's sizes
  MoeDims moe;                 // a MoE layer's router
};

struct Segments;  // packed samples' places, for the Gated DeltaNet (modules/gated_delta_net.h)

// The family's RMSNorm (dims.norm's form).
at::Tensor layer_norm(const LayerDims& dims, const at::Tensor& x, const at::Tensor& weight);

// Keys and values one layer hands to later ones (Gemma 4's KV sharing): [batch, kv_heads, total, d],
// rotated and normed, covering every position the layer has seen (its cache's too).
struct SharedKv {
  at::Tensor k, v;
};
// What a Gemma 4 layer takes besides h: its slice of the per-layer inputs [batch, seq, per-layer dim]
// (undefined: none), and `kv`: a KV-shared layer attends over it; any other layer given one stores
// its K/V there for the layers that reuse them.
// `routing` (any layer): a MoE layer stores its router's choice there (router statistics).
struct LayerExtras {
  at::Tensor per_layer_input;
  SharedKv* kv = nullptr;
  Routing* routing = nullptr;
};

// One pre-norm decoder layer. h: [batch, seq, hidden]; rope tables for the seq positions.
// cache (optional): this layer's cache entry, extended in place.
// attn_mask (optional, [batch, seq, past + seq] bool, true = may attend): replaces plain causal
// attention (packed rows; with a cache, a generation batch's padded key slots). A Gated DeltaNet layer reads `segments`
// instead (null: each row is one sequence). extras: Gemma 4's (see LayerExtras); null: none.
at::Tensor decoder_layer_forward(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& h,
                                 const RopeTables& rope, bool training, LayerCache* cache = nullptr,
                                 const at::Tensor& attn_mask = at::Tensor(), const Segments* segments = nullptr,
                                 const LayerExtras* extras = nullptr);

}  // namespace qlora::modules
