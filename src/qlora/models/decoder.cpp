#include "qlora/models/decoder.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <stdexcept>

#include "qlora/io/checkpoint_dir.h"

#include "qlora/io/quantize_checkpoint.h"
#include "qlora/models/fused_experts.h"
#include "qlora/models/output_head.h"
#include "qlora/modules/activation_checkpointing.h"
#include "qlora/modules/gated_delta_net.h"
#include "qlora/modules/per_layer_inputs.h"
#include "qlora/modules/rms_norm.h"
#include "qlora/modules/rope.h"
#include "qlora/ops/nf4_ops.h"

namespace qlora::models {
namespace {

using modules::DecoderLayer;
using modules::LoraLinear;

struct Loader {
  const io::CheckpointDir& ckpt;
  const DecoderLoadOptions& opt;
  KeyLayout layout;  // the table's text keys -> this checkpoint's (key_layout.h)

  void check_shape(const std::string& key, at::IntArrayRef got, const std::vector<int64_t>& want) const {
    if (got.vec() != want) {
      throw std::invalid_argument((ckpt.contains(key) ? ckpt.file_of(key).path() : ckpt.path()) + ": tensor '" + key +
                                  "' has shape " + c10::str(got) +
                                  ", expected " + c10::str(at::IntArrayRef(want)) + " from config.json");
    }
  }
  // dtype: the storage dtype (compute dtype, or frozen_dtype for embed_tokens / lm_head).
  at::Tensor dense(const std::string& text_key, const std::vector<int64_t>& shape, at::ScalarType dtype) const {
    const std::string key = layout_key(layout, text_key);
    // A checkpoint written by `qlora quantize` stores projections as NF4 entries only;
    // load_nf4 reads those (and names the checkpoint and key when neither form exists).
    at::Tensor t = ckpt.contains(key) ? ckpt.tensor(key)
                                      : ops::nf4_dequantize(io::load_nf4(ckpt, key), dtype);
    check_shape(key, t.sizes(), shape);
    // Zero-copy when dtype and device already match: the read-only mapping is never written.
    return t.to(opt.device, dtype);
  }
  at::Tensor dense(const std::string& key, const std::vector<int64_t>& shape) const {
    return dense(key, shape, opt.compute_dtype);
  }
  LoraLinear projection(const std::string& text_key, const std::vector<int64_t>& shape) const {
    if (!opt.base_in_nf4) return modules::lora_linear_dense(dense(text_key, shape));
    const std::string key = layout_key(layout, text_key);
    Nf4Tensor w = io::load_nf4(ckpt, key);  // errors name the checkpoint and key
    // Drop the float tensor's resident pages once quantized, so loading a 7B base keeps RSS
    // near the NF4 size instead of accumulating the mapped fp16/bf16 file.
    if (ckpt.contains(key)) ckpt.file_of(key).release(key);
    check_shape(key, w.shape, shape);
    return modules::lora_linear_nf4(w.to(opt.device));
  }
  void add_adapter(LoraLinear& l, at::Generator& gen) const {
    modules::lora_linear_add_adapter(l, opt.lora_r, opt.lora_alpha, opt.lora_dropout, gen, opt.device);
    l.scale = modules::lora_scale(opt.lora_alpha, opt.lora_r, opt.lora_use_rslora);
    if (opt.lora_use_dora) modules::lora_linear_add_dora(l);  // while the whole base is here
  }
  // Decoder layer i, with adapters on the `targets` (PEFT spelling) drawn from `gen` in table
  // order: the draws go layer by layer, then the output projection's, whatever the targets.
  DecoderLayer layer(const Architecture& arch, const DecoderConfig& c, int64_t i, const std::set<std::string>& targets,
                     at::Generator& gen) const {
    DecoderLayer L;
    for (const NormRow& n : arch.layer_norms)
      if (in_layer(n.mixer, c, i)) L.*n.member = dense(hf_key(n, i), norm_shape(n, c, i));
    for (const ProjectionRow& row : arch.projections) {
      if (!row.member || !in_layer(row.mixer, c, i)) continue;
      LoraLinear& p = L.*row.member;
      const std::vector<int64_t> shape = projection_shape(row, c, i);
      p = projection(hf_key(row, i), shape);
      if (has_bias(row, c)) modules::lora_linear_set_bias(p, dense(hf_bias_key(row, i), {shape[0]}));
      if (targets.count(row.peft_name)) add_adapter(p, gen);
    }
    if (c.is_moe(i)) L.router = experts(*arch.experts, c, i, targets.count(kExpertsTarget) > 0, gen, L);
    return L;
  }
  // Layer i's routed experts (architecture.h, ExpertsRow: fused or one tensor per expert, whichever
  // the checkpoint holds) into `out`, each expert's gate_up [2 * inter, hidden] and down its own NF4
  // (or dense) weight, with adapters when `adapt`, and (gpt-oss) its biases and the router's into L.
  // Returns the router's weight.
  at::Tensor experts(const ExpertsRow& row, const DecoderConfig& c, int64_t i, bool adapt, at::Generator& gen,
                     DecoderLayer& L) const {
    const int64_t E = c.moe.num_experts, H = c.hidden_size, I = c.moe.inter;
    const std::string fused = hf_module(row.fused, i), split = hf_module(row.split, i);
    const bool is_fused = row.transposed_interleaved || ckpt.contains(layout_key(layout, fused + ".gate_up_proj"));
    const std::string router_module = hf_module(is_fused ? row.fused_router : row.split_router, i);
    modules::Experts& out = L.experts;
    FusedExperts gate_up, down;  // fused: as the checkpoint stores them
    if (is_fused) {
      gate_up = read_fused_experts(ckpt, row, true, layout_key(layout, fused + ".gate_up_proj"), E, H, I);
      down = read_fused_experts(ckpt, row, false, layout_key(layout, fused + ".down_proj"), E, H, I);
    }
    std::vector<Nf4Tensor> gu_nf4, down_nf4;
    std::vector<at::Tensor> gu_dense, down_dense;
    for (int64_t e = 0; e < E; ++e) {
      const std::string stem = split + "." + std::to_string(e) + ".";
      const at::Tensor gu = is_fused ? gate_up.expert(e)
                                     : at::cat({checked(stem + row.gate + ".weight", {I, H}),
                                                checked(stem + row.up + ".weight", {I, H})});
      const at::Tensor dn = is_fused ? down.expert(e) : checked(stem + row.down + ".weight", {H, I});
      const std::string name = ckpt.path() + ": " + (is_fused ? fused : stem.substr(0, stem.size() - 1));
      if (opt.base_in_nf4) {
        gu_nf4.push_back(ops::nf4_quantize(gu.contiguous(), name + " gate_up").to(opt.device));
        down_nf4.push_back(ops::nf4_quantize(dn.contiguous(), name + " down").to(opt.device));
      } else {
        gu_dense.push_back(gu.to(opt.device, opt.compute_dtype).contiguous());
        down_dense.push_back(dn.to(opt.device, opt.compute_dtype).contiguous());
      }
    }
    out = opt.base_in_nf4 ? modules::experts_nf4(std::move(gu_nf4), std::move(down_nf4))
                          : modules::experts_dense(std::move(gu_dense), std::move(down_dense));
    out.activation = c.moe.activation;
    out.alpha = c.moe.swiglu_alpha;
    out.limit = c.moe.swiglu_limit;
    if (row.biases) {
      L.router_bias = dense(router_module + ".bias", {E});
      const at::Tensor gu_bias = dense(fused + ".gate_up_proj_bias", {E, 2 * I});
      out.gate_up_bias = row.transposed_interleaved ? modules::deinterleave_gate_up(gu_bias, 1).contiguous() : gu_bias;
      out.down_bias = dense(fused + ".down_proj_bias", {E, H});
    }
    if (adapt)
      modules::experts_add_adapters(out, opt.lora_r, modules::lora_scale(opt.lora_alpha, opt.lora_r, opt.lora_use_rslora),
                                    gen, opt.device);
    return dense(router_module + ".weight", {E, H});
  }
  // The checkpoint's tensor (mapped, its own dtype), of the shape config.json implies.
  at::Tensor checked(const std::string& text_key, const std::vector<int64_t>& shape) const {
    const std::string key = layout_key(layout, text_key);
    if (!ckpt.contains(key)) throw std::invalid_argument(ckpt.path() + ": tensor '" + key + "' is missing");
    at::Tensor t = ckpt.tensor(key);
    check_shape(key, t.sizes(), shape);
    return t;
  }
  // Gemma 4's per-layer inputs: the table as the checkpoint stores it, in host memory (EmbedRow::host),
  // the rest in the compute dtype on the device.
  modules::PerLayerInputs per_layer_inputs(const Architecture& arch, const DecoderConfig& c) const {
    modules::PerLayerInputs p;
    if (!has_embed_rows(c)) return p;
    for (const EmbedRow& row : arch.embed_rows) {
      const std::string key = layout_key(layout, row.hf_key);
      if (!row.host) {
        p.*row.member = dense(row.hf_key, embed_shape(row, c));
        continue;
      }
      if (!ckpt.contains(key)) throw std::invalid_argument(ckpt.path() + ": tensor '" + key + "' is missing");
      p.*row.member = ckpt.tensor(key);  // zero-copy: the mapping's pages, read a batch's rows at a time
      check_shape(key, (p.*row.member).sizes(), embed_shape(row, c));
    }
    p.layers = c.num_hidden_layers;
    p.dim = c.per_layer_input_dim;
    p.rms_norm_eps = c.rms_norm_eps;
    p.norm_scale = c.norm;
    return p;
  }
};

// LoRA targets in either spelling -> their PEFT names; unknown ones are refused, naming the allowed.
std::set<std::string> lora_targets(const Architecture& arch, const std::vector<std::string>& names) {
  try {
    const std::vector<std::string> peft = peft_targets(arch, names);
    return {peft.begin(), peft.end()};
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("load_decoder: ") + e.what());
  }
}

}  // namespace

modules::LayerDims DecoderModel::dims(int64_t layer) const {
  const DecoderConfig& c = config;
  modules::LayerDims d;
  d.num_heads = c.num_attention_heads, d.num_kv_heads = c.layer_kv_heads(layer), d.head_dim = c.layer_head_dim(layer);
  d.rms_norm_eps = c.rms_norm_eps;
  d.norm = c.norm;
  d.v_norm = c.v_norm;
  d.activation = c.activation;
  if (c.query_pre_attn_scalar) d.attention.scale = 1.0 / std::sqrt(*c.query_pre_attn_scalar);
  d.attention.softcap = c.attn_logit_softcapping.value_or(0.0);
  if (c.is_sliding(layer)) d.attention.window = *c.sliding_window;
  d.rope = c.uses_rope(layer);
  d.output_gate = c.attn_output_gate;
  d.gated_delta = c.gated_delta;
  d.moe = c.moe;
  return d;
}

DecoderModel load_decoder(const std::string& checkpoint_dir, const DecoderLoadOptions& opt) {
  if (opt.compute_dtype != at::kFloat && opt.compute_dtype != at::kBFloat16) {
    throw std::invalid_argument("load_decoder: compute dtype must be float32 or bfloat16");
  }
  const at::ScalarType frozen =
      opt.frozen_dtype == at::ScalarType::Undefined ? opt.compute_dtype : opt.frozen_dtype;
  if (frozen != opt.compute_dtype && !(frozen == at::kBFloat16 && opt.compute_dtype == at::kFloat)) {
    throw std::invalid_argument(
        "load_decoder: frozen dtype must equal the compute dtype, or be bfloat16 with float32 compute");
  }
  DecoderModel m;
  m.config = load_decoder_config(checkpoint_dir);
  const Architecture& arch = m.architecture();
  const std::set<std::string> targets = lora_targets(arch, opt.lora_targets);
  if (!targets.empty() && opt.lora_r <= 0) throw std::invalid_argument("load_decoder: lora r must be positive");
  if (opt.lora_use_dora && targets.count(output_projection(arch).peft_name))
    throw std::invalid_argument(std::string("lora.use_dora = true with the output projection (") +
                                output_projection(arch).peft_name +
                                ") among lora.targets: DoRA adapts the decoder projections, the output head's chunked "
                                "loss takes plain LoRA; drop \"output\" from lora.targets or set lora.use_dora = false");
  if (targets.count(kExpertsTarget) && (opt.lora_use_dora || opt.lora_dropout > 0))
    throw std::invalid_argument(std::string("lora.targets has \"experts\" with ") +
                                (opt.lora_use_dora ? "lora.use_dora = true" : "lora.dropout > 0") +
                                ": peft's LoRA on fused expert tensors (target_parameters) has neither DoRA nor dropout; "
                                "drop \"experts\" from lora.targets or set " +
                                (opt.lora_use_dora ? "lora.use_dora = false" : "lora.dropout = 0"));
  if (targets.count(kExpertsTarget) && m.config.moe_layers.empty())
    throw std::invalid_argument(checkpoint_dir + "/config.json: lora.targets has \"experts\", but the model has no "
                                "mixture-of-experts layers (Gemma 4: enable_moe_block is false); drop \"experts\"");
  m.compute_dtype = opt.compute_dtype;
  m.frozen_dtype = frozen;
  m.activation_checkpointing = opt.activation_checkpointing;
  const DecoderConfig& c = m.config;
  const auto ckpt = io::CheckpointDir::open(checkpoint_dir);
  m.key_layout = key_layout_of(ckpt, c);
  m.skipped_weights = skipped_weights(ckpt, m.key_layout);
  const Loader ld{ckpt, opt, m.key_layout};
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(opt.seed);

  const int64_t h = c.hidden_size;
  m.embed_tokens = ld.dense(arch.embed_key, {c.vocab_size, h}, frozen);
  m.per_layer_inputs = ld.per_layer_inputs(arch, c);
  m.layers.reserve(static_cast<size_t>(c.num_hidden_layers));  // layers keep their addresses
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    m.layers.push_back(ld.layer(arch, c, i, targets, gen));
    if (opt.on_layer_loaded) opt.on_layer_loaded(i, m.layers.back(), arch);
  }
  m.norm = ld.dense(arch.final_norm_key, {h});
  const ProjectionRow& head = output_projection(arch);
  if (c.tie_word_embeddings) {
    m.lm_head = modules::lora_linear_dense(m.embed_tokens);
  } else {
    m.lm_head = modules::lora_linear_dense(ld.dense(hf_key(head, 0), projection_shape(head, c, 0), frozen));
  }
  if (targets.count(head.peft_name)) ld.add_adapter(m.lm_head, gen);
  m.inv_freq = modules::rope_inv_freq(c.global_rope_dim(), c.rope()).to(opt.device);
  if (c.local_rope) m.inv_freq_local = modules::rope_inv_freq(c.rope_dim(), *c.local_rope).to(opt.device);
  return m;
}

// `out` is the output of unit u and, unless u is the head, the input of unit u + 1: when its
// gradient is complete, u + 1's backward has run and u's is next. (Layer 0's input comes from the
// frozen embedding and wants no gradient, so no after_backward(0) ever comes: the engine ends the
// backward itself.)
void add_unit_backward_hooks(const at::Tensor& out, UnitHooks* hooks, int64_t u, bool feeds_next) {
  if (!out.requires_grad()) return;
  at::Tensor t = out;  // register_hook is non-const
  t.register_hook([hooks, u, feeds_next](const at::Tensor& g) {
    if (feeds_next) hooks->after_backward(u + 1);
    hooks->before_backward(u);
    return g;
  });
}

namespace {

// The output projection as the model configures it.
OutputHead output_head(const DecoderModel& m) {
  return {&m.lm_head, m.lm_head_chunk_rows, m.config.final_logit_softcapping.value_or(0.0)};
}

// Gemma 4's inputs to each layer besides h, along one forward: the per-layer inputs, and the keys and
// values a KV-source layer hands to the layers that share them (decoder_config.h: kv_source).
struct LayerSides {
  at::Tensor per_layer;               // [batch, seq, layers, dim]; undefined without per-layer inputs
  std::vector<modules::SharedKv> kv;  // per layer: what it stored, if it is a KV source
  modules::LayerExtras of(const DecoderConfig& c, int64_t i) {
    modules::LayerExtras e;
    if (per_layer.defined()) e.per_layer_input = per_layer.select(2, i);  // [batch, seq, dim]
    if (c.is_kv_shared(i)) e.kv = &kv[static_cast<size_t>(c.kv_source[static_cast<size_t>(i)])];
    else if (c.is_kv_source(i)) e.kv = &kv[static_cast<size_t>(i)];
    return e;
  }
};

// Layer i under activation checkpointing: only its input is kept, the replay in backward recomputes
// the rest. A KV-shared layer's source K/V join its params, so their gradients reach the source.
at::Tensor checkpointed_layer(const DecoderModel& m, int64_t i, const at::Tensor& h, const modules::RopeTables& rope,
                              const at::Tensor& attn_mask, const modules::Segments& segments,
                              const modules::LayerExtras& ex) {
  const DecoderLayer& layer = m.layers[static_cast<size_t>(i)];
  const modules::LayerDims d = m.dims(i);
  const bool train = m.training;
  UnitHooks* hooks = m.hooks.get();
  std::vector<at::Tensor> params = layer.trainable();
  // A copy: the replay runs after hidden_states has returned (a KV source is never checkpointed, so
  // this layer only reads it).
  const auto kv = ex.kv ? std::make_shared<modules::SharedKv>(*ex.kv) : nullptr;
  if (kv)
    for (const at::Tensor& t : {kv->k, kv->v})
      if (t.requires_grad()) params.push_back(t);
  const at::Tensor per_layer = ex.per_layer_input;
  // The forward pass (not the replay) records the router's choice: it runs before this returns.
  modules::Routing* routing = ex.routing;
  // Captured by value: the backward replays this closure after hidden_states has returned. The
  // hooks are held by the model, which outlives its backward.
  return modules::checkpointed(
      [&layer, d, rope, attn_mask, segments, train, hooks, i, kv, per_layer, routing](const at::Tensor& x) {
        const bool replay = at::GradMode::is_enabled();  // the forward pass runs without grad
        if (hooks && replay) hooks->before_forward(i, true);
        const modules::LayerExtras e{per_layer, kv.get(), replay ? nullptr : routing};
        at::Tensor y = modules::decoder_layer_forward(layer, d, x, rope, train, nullptr, attn_mask,
                                                      segments.gather.defined() ? &segments : nullptr, &e);
        if (hooks && replay) hooks->after_forward(i, true);
        return y;
      },
      h, params);
}

// h [batch, seq, hidden] with the image tokens' rows replaced by the images' features, in order
// (transformers' masked_scatter); differentiable in both.
at::Tensor with_image_features(const at::Tensor& h, const ImageInputs& images) {
  const at::Tensor& f = images.features;
  if (!images.mask.defined() || images.mask.scalar_type() != at::kBool || images.mask.sizes() != h.sizes().slice(0, 2))
    throw std::invalid_argument("DecoderModel: the image-token mask must be bool [batch, seq] = " +
                                c10::str(h.sizes().slice(0, 2)));
  const at::Tensor mask = images.mask.to(h.device());
  const int64_t n = mask.sum().item<int64_t>();
  if (f.dim() != 2 || f.size(0) != n || f.size(1) != h.size(2))
    throw std::invalid_argument("DecoderModel: " + std::to_string(n) + " image tokens take [" + std::to_string(n) +
                                ", " + std::to_string(h.size(2)) + "] features, got " + c10::str(f.sizes()));
  return h.masked_scatter(mask.unsqueeze(-1), f.to(h.scalar_type()));
}

// attn_mask [batch, seq, seq] (undefined: causal, no cache) where also each image's tokens see all of
// that image's tokens (transformers' blockwise overlay). An image is a run of image tokens; a packed
// sample's start (position 0) begins a new run.
at::Tensor bidirectional_image_mask(const ImageInputs& images, const at::Tensor& positions, const at::Tensor& attn_mask,
                                    int64_t batch) {
  const at::Tensor is_image = images.mask.to(positions.device());  // [b, s]
  const int64_t seq = is_image.size(1);
  const at::Tensor base =
      attn_mask.defined() ? attn_mask : at::ones({seq, seq}, is_image.options()).tril().expand({batch, seq, seq});
  if (base.size(2) != seq)
    throw std::invalid_argument("DecoderModel: images with bidirectional attention take a whole sequence (no cache)");
  at::Tensor continues = at::zeros_like(is_image);  // the token before is an image token of the same sample
  continues.narrow(1, 1, seq - 1).copy_(is_image.narrow(1, 0, seq - 1));
  if (positions.dim() == 2) continues.logical_and_(positions.ne(0));
  const at::Tensor run = is_image.logical_and(continues.logical_not()).to(at::kLong).cumsum(1).masked_fill(
      is_image.logical_not(), 0);  // [b, s]: 1, 2, ... per image, 0 on text
  return base.logical_or(run.unsqueeze(2).eq(run.unsqueeze(1)).logical_and(run.unsqueeze(2).gt(0)));
}

// The decoder up to the last layer's output, shared by the forwards and the losses.
// positions: [seq] (plain rows) or [batch, seq] (packed rows), already on the model's device;
// attn_mask: undefined (causal) or [batch, seq, seq] bool.
at::Tensor hidden_states(const DecoderModel& m, const at::Tensor& tokens, const at::Tensor& positions,
                         const at::Tensor& attn_mask, modules::KvCache* cache, const ImageInputs* images = nullptr) {
  if (cache && cache->layers.empty()) cache->layers.resize(m.layers.size());
  const DecoderConfig& c = m.config;
  // Packed rows: where each sample sits, for the Gated DeltaNet layers (attention reads the mask).
  const bool linear = !c.linear_layers.empty();
  const modules::Segments segments = linear && positions.dim() == 2 && !cache
                                         ? modules::segments_from_positions(positions, c.gated_delta.conv_kernel)
                                         : modules::Segments{};
  const modules::Segments* segs = segments.gather.defined() ? &segments : nullptr;
  // [seq, head_dim] or [batch, seq, head_dim]
  const bool mrope = images && images->positions.defined();
  const modules::RopeTables rope_global =
      mrope ? modules::mrope_tables(m.inv_freq, images->positions.to(positions.device()), c.mrope_section,
                                    m.compute_dtype, modules::rope_attention_scaling(c.rope()))
            : modules::rope_tables(m.inv_freq, positions, m.compute_dtype, modules::rope_attention_scaling(c.rope()));
  const modules::RopeTables rope_local =
      m.inv_freq_local.defined()
          ? modules::rope_tables(m.inv_freq_local, positions, m.compute_dtype,
                                 modules::rope_attention_scaling(*c.local_rope))
          : rope_global;
  const bool checkpoint = m.activation_checkpointing && !cache && at::GradMode::is_enabled();
  // Layers where an image's tokens see each other: their mask (undefined: attn_mask everywhere).
  const at::Tensor image_mask = images && c.image_attention != DecoderConfig::ImageAttention::kCausal
                                    ? bidirectional_image_mask(*images, positions, attn_mask, tokens.size(0))
                                    : at::Tensor();
  UnitHooks* hooks = m.hooks.get();
  const int64_t num_layers = static_cast<int64_t>(m.layers.size());
  LayerSides sides;
  sides.kv.resize(m.layers.size());
  if (hooks) hooks->before_forward(UnitHooks::kEmbedUnit, false);
  // Image tokens embed as the family says before their features replace them (Gemma 4: its pad
  // token, which its per-layer inputs' token part reads; their projected part reads the features).
  const at::Tensor text_tokens = images && c.image_pad_token_id >= 0
                                     ? tokens.masked_fill(images->mask.to(tokens.device()), c.image_pad_token_id)
                                     : tokens;
  at::Tensor h = at::embedding(m.embed_tokens, text_tokens.to(m.embed_tokens.device()));  // [batch, seq, hidden]
  if (h.scalar_type() != m.compute_dtype) h = h.to(m.compute_dtype);  // bf16 rows widen exactly
  // Gemma: times sqrt(hidden), rounded to the compute dtype first as transformers does.
  if (c.embed_scale != 1.0) h = h * at::scalar_tensor(c.embed_scale, h.options());
  if (images && images->features.defined()) h = with_image_features(h, *images);
  if (m.per_layer_inputs.defined())
    sides.per_layer = modules::per_layer_inputs_forward(m.per_layer_inputs, text_tokens, h);
  if (hooks) hooks->after_forward(UnitHooks::kEmbedUnit, false);
  for (int64_t i = 0; i < num_layers; ++i) {
    const DecoderLayer& layer = m.layers[i];
    const modules::LayerDims d = m.dims(i);
    const modules::RopeTables& rope = c.is_sliding(i) ? rope_local : rope_global;
    const bool see_image = image_mask.defined() &&
                           (c.image_attention == DecoderConfig::ImageAttention::kAllLayers || c.is_sliding(i));
    const at::Tensor& mask = see_image ? image_mask : attn_mask;
    modules::LayerExtras ex = sides.of(c, i);
    modules::Routing routing;
    const bool count = m.router_counts && m.training && !cache && layer.is_moe();
    if (count) ex.routing = &routing;
    if (hooks) hooks->before_forward(i, false);
    if (cache) {
      h = modules::decoder_layer_forward(layer, d, h, rope, m.training, &cache->layers[i], mask, nullptr, &ex);
    } else if (checkpoint && !c.is_kv_source(i)) {  // a KV source's K/V must carry their graph onwards
      h = checkpointed_layer(m, i, h, rope, mask, segments, ex);
    } else {
      h = modules::decoder_layer_forward(layer, d, h, rope, m.training, nullptr, mask, segs, &ex);
    }
    if (count) m.router_counts->counts[i] += modules::expert_counts(routing, c.moe.num_experts, m.router_counts->valid);
    if (hooks) {
      hooks->after_forward(i, false);
      add_unit_backward_hooks(h, hooks, i, /*feeds_next=*/true);
    }
  }
  if (cache) cache->seen += tokens.size(1);
  return h;  // [batch, seq, hidden]
}

// Unit L (final norm + lm_head) over the last layer's output h [batch, seq, hidden]: `body` gets
// the normed hidden states [batch * seq, hidden] and the head's LoRA input (undefined without an
// adapter) and returns the unit's output (logits or the loss), which gets the unit's hooks.
template <typename Body>
at::Tensor head_unit(const DecoderModel& m, const at::Tensor& h, Body body) {
  UnitHooks* hooks = m.hooks.get();
  const int64_t unit = static_cast<int64_t>(m.layers.size());
  if (hooks) hooks->before_forward(unit, false);
  const at::Tensor normed = modules::rms_norm(h, m.norm, m.config.rms_norm_eps, m.config.norm).reshape({-1, h.size(-1)});
  const at::Tensor lora_x = m.lm_head.active() ? modules::lora_input(m.lm_head, normed, m.training) : at::Tensor();
  at::Tensor out = body(normed, lora_x);
  if (hooks) {
    hooks->after_forward(unit, false);
    add_unit_backward_hooks(out, hooks, unit, /*feeds_next=*/false);
  }
  return out;
}

void check_tokens(const DecoderModel& m, const at::Tensor& tokens) {
  if (tokens.dim() != 2 || tokens.scalar_type() != at::kLong) {
    throw std::invalid_argument("DecoderModel::forward: tokens must be int64 [batch, seq]");
  }
  const int64_t seq = tokens.size(1);
  if (seq == 0) throw std::invalid_argument("DecoderModel::forward: empty sequence");
  if (tokens.numel() > 0) {
    const int64_t lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
    if (lo < 0 || hi >= m.config.vocab_size) {
      throw std::invalid_argument("DecoderModel::forward: token id out of range [0, " +
                                  std::to_string(m.config.vocab_size) + ")");
    }
  }
}

// The packed rows' positions and mask on the model's device, checked (see DecoderModel::forward).
// past: the key slots a cache already holds (0 without one).
std::pair<at::Tensor, at::Tensor> packed_inputs(const DecoderModel& m, const at::Tensor& tokens,
                                                const at::Tensor& position_ids, const at::Tensor& attn_mask,
                                                int64_t past = 0) {
  check_tokens(m, tokens);
  const int64_t b = tokens.size(0), seq = tokens.size(1), keys = past + seq;
  if (!position_ids.defined() || position_ids.scalar_type() != at::kLong || position_ids.sizes() != tokens.sizes()) {
    throw std::invalid_argument("DecoderModel::forward: position_ids must be int64 [batch, seq] like tokens " +
                                c10::str(tokens.sizes()));
  }
  if (!attn_mask.defined() || attn_mask.scalar_type() != at::kBool || attn_mask.dim() != 3 ||
      attn_mask.size(0) != b || attn_mask.size(1) != seq || attn_mask.size(2) != keys) {
    throw std::invalid_argument("DecoderModel::forward: attn_mask must be bool [batch, seq, past + seq] = [" +
                                std::to_string(b) + ", " + std::to_string(seq) + ", " + std::to_string(keys) + "]");
  }
  const at::Device dev = m.embed_tokens.device();
  const at::Tensor mask = attn_mask.to(dev);  // [b, s, s]
  // A query that may attend to nothing softmaxes over an empty set: NaN logits and gradients.
  if (!mask.any(-1).all().item<bool>()) {
    throw std::invalid_argument(
        "DecoderModel::forward: attn_mask has a query row with no allowed key (let padding attend causally "
        "among itself, as data::block_causal_mask does for document id -1)");
  }
  return {position_ids.to(dev), mask};
}

// Positions 0..seq-1 shared by every row: [seq].
at::Tensor plain_positions(const DecoderModel& m, const at::Tensor& tokens, int64_t past) {
  check_tokens(m, tokens);
  return at::arange(past, past + tokens.size(1), tokens.options().dtype(at::kLong));
}

// The logits [batch, seq, vocab] fp32 of the last layer's output h [batch, seq, hidden].
at::Tensor logits_of(const DecoderModel& m, const at::Tensor& h) {
  return head_unit(m, h, [&m](const at::Tensor& normed, const at::Tensor& lora_x) {
           return output_logits(output_head(m), normed, lora_x);  // [batch * seq, vocab]
         })
      .view({h.size(0), h.size(1), -1});
}

// What loss_of sums over: the whole batch, each row, or each token.
enum class LossPer { kBatch, kRow, kToken };

// The summed token cross-entropy of h's logits against labels [batch, seq] (see DecoderModel::loss),
// per row ([batch], DecoderModel::row_losses) or per token ([batch * seq], DecoderModel::token_losses).
at::Tensor loss_of(const DecoderModel& m, const at::Tensor& h, const at::Tensor& labels, LossPer per = LossPer::kBatch,
                   at::Tensor* entropy = nullptr) {
  if (!labels.defined() || labels.scalar_type() != at::kLong || labels.sizes() != h.sizes().slice(0, 2)) {
    throw std::invalid_argument("DecoderModel::loss: labels must be int64 [batch, seq] like tokens " +
                                c10::str(h.sizes().slice(0, 2)) + ", got " +
                                (labels.defined() ? c10::str(labels.sizes()) : std::string("none")));
  }
  const int64_t chunk = m.loss_chunk_tokens > 0 ? m.loss_chunk_tokens : default_loss_chunk_tokens(std::min(m.config.vocab_size, m.lm_head_chunk_rows));
  OutputHead head = output_head(m);
  head.temperature = m.logit_temperature;
  head.entropy = entropy;
  return head_unit(m, h, [&](const at::Tensor& normed, const at::Tensor& lora_x) {
    const at::Tensor flat = labels.reshape({-1}).to(normed.device());  // [batch * seq]
    if (per != LossPer::kBatch) {
      const int64_t b = per == LossPer::kRow ? labels.size(0) : flat.size(0);
      const at::Tensor segs = per == LossPer::kRow ? at::arange(b, flat.options()).repeat_interleave(labels.size(1))
                                                   : at::arange(b, flat.options());  // [batch * seq]
      return m.chunked_loss ? chunked_segment_loss(head, normed, lora_x, flat, segs, b, chunk)
                            : full_segment_loss(head, normed, lora_x, flat, segs, b);
    }
    return m.chunked_loss ? chunked_token_loss(head, normed, lora_x, flat, chunk)
                          : full_token_loss(head, normed, lora_x, flat);
  });
}

}  // namespace

at::Tensor DecoderModel::forward(const at::Tensor& tokens, modules::KvCache* cache, const ImageInputs* images) const {
  const at::Tensor positions = plain_positions(*this, tokens, cache ? cache->length() : 0);  // [seq]
  return logits_of(*this, hidden_states(*this, tokens, positions, at::Tensor(), cache, images));
}

at::Tensor DecoderModel::forward(const at::Tensor& tokens, const at::Tensor& position_ids,
                               const at::Tensor& attn_mask, modules::KvCache* cache, const ImageInputs* images) const {
  if (cache && !config.linear_layers.empty() && tokens.size(1) > 1) {
    // A Gated DeltaNet layer reads no mask: with a cache it would carry padding or another
    // sample into a row's state.
    throw std::invalid_argument(
        "DecoderModel::forward: a model with Gated DeltaNet layers takes position_ids + attn_mask with a KV cache "
        "one token per row only (prefill each sequence without them)");
  }
  const auto [positions, mask] = packed_inputs(*this, tokens, position_ids, attn_mask, cache ? cache->length() : 0);
  return logits_of(*this, hidden_states(*this, tokens, positions, mask, cache, images));
}

at::Tensor DecoderModel::loss(const at::Tensor& tokens, const at::Tensor& labels, const ImageInputs* images) const {
  const at::Tensor positions = plain_positions(*this, tokens, 0);  // [seq]
  return loss_of(*this, hidden_states(*this, tokens, positions, at::Tensor(), nullptr, images), labels);
}

at::Tensor DecoderModel::loss(const at::Tensor& tokens, const at::Tensor& position_ids, const at::Tensor& attn_mask,
                            const at::Tensor& labels, const ImageInputs* images) const {
  const auto [positions, mask] = packed_inputs(*this, tokens, position_ids, attn_mask);
  return loss_of(*this, hidden_states(*this, tokens, positions, mask, nullptr, images), labels);
}

at::Tensor DecoderModel::row_losses(const at::Tensor& tokens, const at::Tensor& labels) const {
  const at::Tensor positions = plain_positions(*this, tokens, 0);  // [seq]
  return loss_of(*this, hidden_states(*this, tokens, positions, at::Tensor(), nullptr), labels, LossPer::kRow);
}

at::Tensor DecoderModel::row_losses(const at::Tensor& tokens, const at::Tensor& position_ids, const at::Tensor& attn_mask,
                                  const at::Tensor& labels, const ImageInputs* images) const {
  const auto [positions, mask] = packed_inputs(*this, tokens, position_ids, attn_mask);
  return loss_of(*this, hidden_states(*this, tokens, positions, mask, nullptr, images), labels, LossPer::kRow);
}

namespace {

// loss_of per token, [batch, seq] (entropy too where asked).
at::Tensor per_token(const DecoderModel& m, const at::Tensor& h, const at::Tensor& labels, at::Tensor* entropy) {
  const at::Tensor losses = loss_of(m, h, labels, LossPer::kToken, entropy);
  if (entropy) *entropy = entropy->view(labels.sizes());
  return losses.view(labels.sizes());
}

}  // namespace

at::Tensor DecoderModel::token_losses(const at::Tensor& tokens, const at::Tensor& labels, at::Tensor* entropy) const {
  const at::Tensor positions = plain_positions(*this, tokens, 0);  // [seq]
  return per_token(*this, hidden_states(*this, tokens, positions, at::Tensor(), nullptr), labels, entropy);
}

at::Tensor DecoderModel::token_losses(const at::Tensor& tokens, const at::Tensor& position_ids, const at::Tensor& attn_mask,
                                      const at::Tensor& labels, const ImageInputs* images, at::Tensor* entropy) const {
  const auto [positions, mask] = packed_inputs(*this, tokens, position_ids, attn_mask);
  return per_token(*this, hidden_states(*this, tokens, positions, mask, nullptr, images), labels, entropy);
}

std::vector<std::pair<std::string, at::Tensor>> DecoderModel::lora_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto add = [&out](const std::string& stem, const LoraLinear& l) {
    if (!l.has_lora()) return;
    out.emplace_back("base_model.model." + stem + ".lora_A.weight", l.lora_a);
    out.emplace_back("base_model.model." + stem + ".lora_B.weight", l.lora_b);
    if (l.has_dora()) out.emplace_back("base_model.model." + stem + ".lora_magnitude_vector", l.magnitude);
  };
  const Architecture& arch = architecture();
  const KeyLayout names = peft_layout(config);
  for (size_t i = 0; i < layers.size(); ++i) {
    for (const ProjectionRow& row : arch.projections)
      if (row.member && in_layer(row.mixer, config, static_cast<int64_t>(i)))
        add(layout_key(names, hf_module(row.hf_module, static_cast<int64_t>(i))), layers[i].*row.member);
    const modules::Experts& ex = layers[i].experts;
    if (!ex.has_lora()) continue;
    // peft's target_parameters on both fused expert tensors: gate_up_proj's wrapper is the inner
    // one (base_layer), down_proj's the outer.
    const std::string stem =
        "base_model.model." + layout_key(names, hf_module(arch.experts->fused, static_cast<int64_t>(i)));
    out.emplace_back(stem + ".base_layer.lora_A.weight", ex.gate_up_a);
    out.emplace_back(stem + ".base_layer.lora_B.weight", ex.gate_up_b);
    out.emplace_back(stem + ".lora_A.weight", ex.down_a);
    out.emplace_back(stem + ".lora_B.weight", ex.down_b);
  }
  add(layout_key(names, output_projection(arch).hf_module), lm_head);
  if (tower)
    for (auto& entry : vision::tower_trainable(*tower)) out.push_back(std::move(entry));
  return out;
}

namespace {

// Whether lora_parameters()' entry `name` is a fused gate_up's lora_B whose rows peft interleaves.
bool interleaved_in_peft(const Architecture& arch, const std::string& name) {
  static const std::string tail = ".experts.base_layer.lora_B.weight";
  return arch.experts && arch.experts->transposed_interleaved && name.size() > tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

at::Tensor DecoderModel::to_peft(const std::string& name, const at::Tensor& t) const {
  return interleaved_in_peft(architecture(), name) ? modules::interleave_gate_up(t, 0) : t;
}

std::vector<std::pair<std::string, at::Tensor>> DecoderModel::peft_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out = lora_parameters();
  for (auto& [name, t] : out) t = to_peft(name, t);
  return out;
}

}  // namespace qlora::models
