// The pieces of a Llama-shaped decoder, as free functions over plain structs of tensors: RMSNorm
// (Llama's and Gemma's (1 + w) form), rotate-half RoPE (llama3 / linear frequency scaling), causal
// GQA attention (sliding window, logit soft-capping), the gated MLP (SiLU or GELU-tanh), the
// decoder layer in its pre-norm (Llama) and sandwich-norm (Gemma) forms, per-layer activation
// checkpointing and a KV cache for generation.
// Numerics follow transformers' implementation of each family op for op where the order matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "qlora/modules/lora_linear.h"
#include "qlora/modules/options.h"

namespace qlora::modules {

// HF's LlamaRMSNorm: normalise in fp32, cast back to x's dtype, then multiply by the weight
// (weight * normed, in that order and in the promoted dtype).
// x: [..., dim]; weight: [dim]. Returns [..., dim].
// Both norms are one autograd node for a frozen weight (bit-identical values to HF's op chain; it
// keeps x and the per-row rstd, and backward is the analytic gradient wrt x in fp32, cast to x's
// dtype). A weight that requires grad gets autograd's op chain instead.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// HF's GemmaRMSNorm: normalise and scale by (1 + weight) in fp32, then cast to x's dtype.
at::Tensor rms_norm_plus_one(const at::Tensor& x, const at::Tensor& weight, double eps);
// Any of the three forms (RmsScale: Llama's, Gemma 2/3's, Gemma 4's w in fp32), one autograd node alike.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, RmsScale scale);

// Inverse frequencies [head_dim / 2] fp32: 1 / theta^(2i / head_dim), then llama3 scaling if given.
at::Tensor rope_inv_freq(int64_t head_dim, double theta,
                         const std::optional<Llama3RopeScaling>& scaling);
// The same for a RopeParams (theta, llama3, yarn or linear scaling).
at::Tensor rope_inv_freq(int64_t head_dim, const RopeParams& params);
// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
double rope_attention_scaling(const RopeParams& params);

struct RopeTables {
  // [seq, head_dim] (one position range shared by every row) or [batch, seq, head_dim] (per-token
  // positions, e.g. packed rows whose positions restart at 0 per sample), in the compute dtype.
  at::Tensor cos, sin;
};
// positions: [seq] or [batch, seq] int64; the tables get the same leading dims plus head_dim.
// Angles are formed in fp32, cos and sin scaled by `scale` (rope_attention_scaling) and cast at
// the end, as transformers does.
RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, at::ScalarType dtype,
                       double scale = 1.0);

// Rotate-half RoPE: x * cos + rotate_half(x) * sin. x: [batch, heads, seq, head_dim].
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

// One layer's state for generation: an attention layer's keys/values for every position seen so
// far, or a Gated DeltaNet layer's conv window and recurrent state.
struct LayerCache {
  at::Tensor k, v;  // [batch, kv_heads, past, head_dim]: the first `past` slots of k_room / v_room if defined
  // [batch, kv_heads, capacity, head_dim] or undefined: slots reserved for later tokens (reserve_kv),
  // which extend_cache fills in place instead of concatenating a new cache every step.
  at::Tensor k_room, v_room;
  at::Tensor conv;   // [batch, conv channels, conv_kernel - 1]: the last inputs of the causal conv
  at::Tensor state;  // [batch, value heads, key_head_dim, value_head_dim] fp32
};

// Makes room for `capacity` key/value slots in c (at least its past): later tokens are written in
// place. Anything that replaces c.k / c.v by other tensors must clear k_room / v_room.
void reserve_kv(LayerCache& c, int64_t capacity);

// Every layer's state, and how many positions it has seen.
struct KvCache {
  std::vector<LayerCache> layers;
  int64_t seen = 0;
  int64_t length() const { return seen; }
  void reset() {
    layers.clear();
    seen = 0;
  }
};

// How a layer's attention scores are formed beyond q.k: the scale (default 1/sqrt(head_dim);
// Gemma: query_pre_attn_scalar^-0.5), a tanh soft-cap (Gemma 2: cap * tanh(s / cap), after
// scaling, before masking) and a sliding window (query i sees keys j with i - window < j <= i).
struct AttentionOptions {
  double scale = 0.0;    // 0: 1 / sqrt(head_dim)
  double softcap = 0.0;  // 0: none
  int64_t window = 0;    // 0: full causal
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
  bool is_linear() const { return in_proj_qkv.out_features > 0; }
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
};

// Where each packed sample sits, for the mixer that carries state along a row (the Gated DeltaNet):
// the samples of all rows are laid end to end in one row, each padded with zeros to a whole number
// of the gated delta rule's chunks and by at least conv_kernel - 1 tokens, so neither the conv
// window nor the recurrent state passes from one sample to the next (the last padding slot of each
// sample decays the state to zero). A sample starts where its position is 0, as transformers
// derives cu_seqlens from position_ids.
struct Segments {
  at::Tensor gather;   // [total] int64: the flat [batch * seq] token each slot takes, or batch * seq
                       // (a zero row appended) for padding
  at::Tensor reset;    // [total] bool: true at each sample's last padding slot
  at::Tensor scatter;  // [batch * seq] int64: the slot each token's output comes from
};
// positions: [batch, seq] int64.
Segments segments_from_positions(const at::Tensor& positions, int64_t conv_kernel);

// The family's RMSNorm (dims.norm's form).
at::Tensor layer_norm(const LayerDims& dims, const at::Tensor& x, const at::Tensor& weight);

// down(act(gate(x)) * up(x)), gate and up from gate_up_proj when the layer has it.
// x: [batch, seq, hidden].
at::Tensor gated_mlp(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x, bool training);

// Keys and values one layer hands to later ones (Gemma 4's KV sharing): [batch, kv_heads, total, d],
// rotated and normed, covering every position the layer has seen (its cache's too).
struct SharedKv {
  at::Tensor k, v;
};
// What a Gemma 4 layer takes besides h: its slice of the per-layer inputs [batch, seq, per-layer dim]
// (undefined: none), and `kv`: a KV-shared layer attends over it; any other layer given one stores
// its K/V there for the layers that reuse them.
struct LayerExtras {
  at::Tensor per_layer_input;
  SharedKv* kv = nullptr;
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

// Activation checkpointing: runs `fn(h)` without recording a graph, keeping only h; backward
// replays fn with grad enabled (and the RNG state of the forward, so dropout masks agree) and
// back-propagates into h and `params` (the tensors fn uses that need gradients).
at::Tensor checkpointed(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& h,
                        const std::vector<at::Tensor>& params);

}  // namespace qlora::modules
