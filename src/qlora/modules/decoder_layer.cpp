#include "qlora/modules/decoder_layer.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>

#include <array>
#include <stdexcept>
#include <tuple>

#include "qlora/modules/gated_delta_net.h"
#include "qlora/modules/gated_mlp.h"
#include "qlora/modules/rms_norm.h"

namespace qlora::modules {

std::vector<at::Tensor> DecoderLayer::trainable() const {
  std::vector<at::Tensor> out;
  for (const LoraLinear* p : {&q_proj, &k_proj, &v_proj, &qkv_proj, &o_proj, &in_proj_qkv, &in_proj_z, &in_proj_b,
                              &in_proj_a, &out_proj, &gate_proj, &up_proj, &gate_up_proj, &down_proj,
                              &shared_gate_proj, &shared_up_proj, &shared_down_proj, &per_layer_input_gate,
                              &per_layer_projection}) {
    if (p->has_lora()) {
      out.push_back(p->lora_a);
      out.push_back(p->lora_b);
      if (p->has_dora()) out.push_back(p->magnitude);
    }
  }
  for (const at::Tensor& t : experts.trainable()) out.push_back(t);
  return out;
}

at::Tensor layer_norm(const LayerDims& dims, const at::Tensor& x, const at::Tensor& weight) {
  return rms_norm(x, weight, dims.rms_norm_eps, dims.norm);
}

namespace {

// q [b, s, heads, d], k and v [b, s, kv_heads, d], from q/k/v_proj or Phi-3's qkv_proj. A KV-shared
// layer projects q only (k, v undefined); without v_proj (Gemma 4's attention_k_eq_v) v is k's
// projection.
std::array<at::Tensor, 3> project_qkv(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x,
                                      bool training) {
  const int64_t b = x.size(0), s = x.size(1), d = dims.head_dim;
  const int64_t nq = dims.num_heads * d, nkv = dims.num_kv_heads * d;
  at::Tensor q, k, v;
  if (layer.qkv_proj.out_features > 0) {
    const at::Tensor qkv = lora_linear_forward(layer.qkv_proj, x, training);  // [b, s, nq + 2 nkv]
    q = qkv.narrow(-1, 0, nq);
    k = qkv.narrow(-1, nq, nkv);
    v = qkv.narrow(-1, nq + nkv, nkv);
  } else if (layer.kv_shared()) {
    q = lora_linear_forward(layer.q_proj, x, training);
  } else {
    std::vector<const LoraLinear*> projs = {&layer.q_proj, &layer.k_proj};
    if (layer.v_proj.out_features > 0) projs.push_back(&layer.v_proj);
    const std::vector<at::Tensor> qkv = lora_linear_group_forward(projs, x, training);
    q = qkv[0];
    k = qkv[1];
    v = qkv.size() > 2 ? qkv[2] : k;
  }
  const int64_t qd = dims.output_gate ? 2 * d : d;  // Qwen3.5: each head's query, then its gate
  if (!k.defined()) return {q.view({b, s, dims.num_heads, qd}), k, v};
  return {q.view({b, s, dims.num_heads, qd}), k.view({b, s, dims.num_kv_heads, d}), v.view({b, s, dims.num_kv_heads, d})};
}

// The attention mixer over the layer's normed input x [b, s, hidden]: returns o_proj's output.
at::Tensor attention_mixer(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x,
                           const RopeTables& rope, bool training, LayerCache* cache, const at::Tensor& attn_mask,
                           const LayerExtras* extras) {
  const int64_t b = x.size(0), s = x.size(1);
  auto [q, k, v] = project_qkv(layer, dims, x, training);  // [b, s, heads, d]
  at::Tensor gate;                                           // Qwen3.5: [b, s, heads * d]
  if (dims.output_gate) {  // q: [b, s, heads, 2d], each head's query and then its gate
    gate = q.narrow(-1, dims.head_dim, dims.head_dim).reshape({b, s, dims.num_heads * dims.head_dim});
    q = q.narrow(-1, 0, dims.head_dim).contiguous();
  }
  // Before RoPE: per head (Qwen3, Gemma 3: a [head_dim] weight) or over all heads at once (OLMo).
  const auto qk_norm = [&](const at::Tensor& t, const at::Tensor& w) {
    return w.size(0) == t.size(-1) ? layer_norm(dims, t, w) : layer_norm(dims, t.flatten(2), w).view(t.sizes());
  };
  if (layer.q_norm.defined()) q = qk_norm(q, layer.q_norm);
  q = q.transpose(1, 2);  // [b, heads, s, d]
  if (dims.rope) q = apply_rope(q, rope);
  if (layer.kv_shared()) {  // Gemma 4: an earlier layer's K/V, cache included
    if (!extras || !extras->kv || !extras->kv->k.defined())
      throw std::logic_error("decoder_layer_forward: a KV-shared layer needs its source layer's keys and values");
    k = extras->kv->k;
    v = extras->kv->v;
  } else {
    if (layer.k_norm.defined()) k = qk_norm(k, layer.k_norm);
    // Gemma 4: values normed per head without a weight (a unit weight: times 1 is exact).
    if (dims.v_norm) v = layer_norm(dims, v, at::ones({v.size(-1)}, v.options()));
    k = k.transpose(1, 2);  // [b, kv_heads, s, d]
    if (dims.rope) k = apply_rope(k, rope);
    std::tie(k, v) = extend_cache(cache, k, v.transpose(1, 2));
    if (extras && extras->kv) *extras->kv = {k, v};
  }
  AttentionOptions ao = dims.attention;
  ao.sinks = layer.sinks;
  at::Tensor attn = (attn_mask.defined() ? masked_attention(q, k, v, attn_mask, ao) : causal_attention(q, k, v, ao))
                        .transpose(1, 2)
                        .reshape({b, s, dims.num_heads * dims.head_dim});  // [b, s, heads * d]
  if (gate.defined()) attn = attn * at::sigmoid(gate);
  return lora_linear_forward(layer.o_proj, attn, training);  // [b, s, hidden]
}

// Gemma 4's per-layer input branch over the layer's output h [b, s, hidden]: what it adds to h.
at::Tensor per_layer_branch(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& h,
                            const LayerExtras* extras, bool training) {
  if (!extras || !extras->per_layer_input.defined())
    throw std::logic_error("decoder_layer_forward: a layer with per_layer_input_gate needs its per-layer input");
  const at::Tensor g = lora_linear_forward(layer.per_layer_input_gate, h, training);  // [b, s, per-layer dim]
  const at::Tensor act = dims.activation == MlpActivation::kSilu ? at::silu(g) : at::gelu(g, "tanh");
  const at::Tensor p = lora_linear_forward(layer.per_layer_projection, act * extras->per_layer_input, training);
  return layer_norm(dims, p, layer.post_per_layer_input_norm);  // [b, s, hidden]
}

// A MoE layer's feed-forward: the routed experts, plus Qwen3.5-MoE's shared expert scaled by the
// sigmoid of its gate, added in that order and in the compute dtype as transformers does.
at::Tensor moe_mlp(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x, bool training,
                   Routing* routing) {
  const at::Tensor routed =
      moe_forward(layer.router, layer.experts, dims.moe, x, routing, {{}, {}, layer.router_bias});
  if (!layer.shared_expert_gate.defined()) return routed;
  const at::Tensor shared = gated_mlp(layer.shared_gate_proj, layer.shared_up_proj, layer.shared_down_proj, dims, x,
                                      training);  // [b, s, hidden]
  return routed + at::sigmoid(at::linear(x, layer.shared_expert_gate)) * shared;
}

// Gemma 4's feed-forward with a MoE beside the MLP, on the residual stream h [b, s, hidden]: the
// MLP on x (pre_feedforward_layernorm(h)) closed by post_feedforward_layernorm_1, plus the experts
// on pre_feedforward_layernorm_2(h), routed by h itself, closed by post_feedforward_layernorm_2.
at::Tensor mlp_beside_moe(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& h, const at::Tensor& x,
                          bool training, Routing* routing) {
  const at::Tensor mlp = layer_norm(dims, gated_mlp(layer, dims, x, training), layer.post_feedforward_layernorm_1);
  const at::Tensor h2 = h.reshape({-1, h.size(-1)});
  Routing r = route(layer.router, dims.moe, h2, {layer.router_scale, layer.per_expert_scale, {}});
  const at::Tensor y = grouped_experts(layer.experts, layer_norm(dims, h2, layer.pre_feedforward_layernorm_2), r.index,
                                       r.weights);
  if (routing) *routing = std::move(r);
  return mlp + layer_norm(dims, y.view(h.sizes()), layer.post_feedforward_layernorm_2);
}

}  // namespace

at::Tensor decoder_layer_forward(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& h,
                                 const RopeTables& rope, bool training, LayerCache* cache,
                                 const at::Tensor& attn_mask, const Segments* segments, const LayerExtras* extras) {
  // OLMo 2/3 normalise no layer input: their norms close each branch instead.
  const bool post_norms_only = !layer.input_layernorm.defined();
  at::Tensor x = post_norms_only ? h : layer_norm(dims, h, layer.input_layernorm);  // [b, s, hidden]
  at::Tensor out = layer.is_linear() ? gated_delta_net_forward(layer, dims, x, training, cache, segments)
                                     : attention_mixer(layer, dims, x, rope, training, cache, attn_mask, extras);
  // Gemma's sandwich: post_attention_layernorm closes the attention branch, pre_feedforward opens
  // the MLP's. OLMo's closes it and the MLP's input is not normalised. Llama's
  // post_attention_layernorm is the MLP's input norm.
  const bool sandwich = layer.pre_feedforward_layernorm.defined();
  if (sandwich || post_norms_only) out = layer_norm(dims, out, layer.post_attention_layernorm);
  const at::Tensor hidden = h + out;
  if (sandwich) x = layer_norm(dims, hidden, layer.pre_feedforward_layernorm);
  else x = post_norms_only ? hidden : layer_norm(dims, hidden, layer.post_attention_layernorm);
  Routing* routing = extras ? extras->routing : nullptr;
  at::Tensor mlp = layer.pre_feedforward_layernorm_2.defined() ? mlp_beside_moe(layer, dims, hidden, x, training, routing)
                   : layer.is_moe()                             ? moe_mlp(layer, dims, x, training, routing)
                                                                : gated_mlp(layer, dims, x, training);
  if (layer.post_feedforward_layernorm.defined()) mlp = layer_norm(dims, mlp, layer.post_feedforward_layernorm);
  at::Tensor out_h = hidden + mlp;
  if (layer.per_layer_input_gate.out_features > 0) out_h = out_h + per_layer_branch(layer, dims, out_h, extras, training);
  return layer.layer_scalar.defined() ? out_h * layer.layer_scalar : out_h;
}

}  // namespace qlora::modules
