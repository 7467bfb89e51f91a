// Gemma 4's vision tower (Gemma4ForConditionalGeneration: model.vision_tower, a Gemma4VisionModel, and
// model.embed_vision), as transformers 5.23 computes get_image_features:
//   patches     pixel_values [images, max_patches, P*P*C] in [0, 1] (the processor's, padded at the end),
//               mapped to 2 (x - 0.5), through input_proj (no bias), plus the x row and y row of the learned
//               position_embedding_table [2, size, D] (0 on padding patches: position (-1, -1));
//   layers      Gemma 4's sandwich: x + post_attention_norm(attn(input_norm x)),
//               x + post_ffw_norm(mlp(pre_ffw_norm x)), RMSNorms w-scaled in fp32; attention: q/k/v/o as
//               clippable linears (clamp the input, linear, clamp the output, where use_clipped_linears),
//               q_norm / k_norm over head_dim, a weightless v norm, 2-D rotary (head_dim's first half
//               rotated by x, the second by y, angles in fp32 cast to the compute dtype), scale 1, padding
//               keys masked; MLP: down(act(gate x) * up x), clippable too;
//   pooler      padding zeroed, each k x k block of patches (k = pooling_kernel_size) averaged by position
//               (a one-hot matmul in fp32), times sqrt(D) in fp32, the padding's blocks dropped;
//               standardize (std_bias, std_scale) in fp32 where the config asks; cast to the compute dtype;
//   embed_vision  weightless RMSNorm, then embedding_projection [text hidden, D] (no bias).
// Output: [sum over images of real patches / k^2, text hidden].
// NF4: every layer's q/k/v/o_proj.linear and gate/up/down_proj.linear. Dense: input_proj, the position
// table, norms, embed_vision (the projector), clamp bounds and standardisation buffers (applied in fp32).
#include <ATen/TensorIndexing.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/all.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/one_hot.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <memory>
#include <stdexcept>

#include "qlora/models/config_json.h"
#include "qlora/models/vision/blocks.h"

namespace qlora::models::vision {
namespace {

// Gemma4ClippableLinear: bounds undefined where use_clipped_linears is off.
struct Clippable {
  modules::LoraLinear linear;
  at::Tensor in_min, in_max, out_min, out_max;  // 0-dim, the compute dtype (the model's buffers)
};

struct Layer {
  at::Tensor input_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm, q_norm, k_norm;
  Clippable q, k, v, o, gate, up, down;
};

// A layer's clippable linears with their module names, in checkpoint order.
std::vector<std::pair<const char*, Clippable*>> clippables(Layer& l) {
  return {{"self_attn.q_proj", &l.q}, {"self_attn.k_proj", &l.k}, {"self_attn.v_proj", &l.v},
          {"self_attn.o_proj", &l.o}, {"mlp.gate_proj", &l.gate}, {"mlp.up_proj", &l.up},
          {"mlp.down_proj", &l.down}};
}

class Gemma4Tower final : public Tower {
 public:
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, inter = 0, patch = 0, table = 0, pool = 0,
          text_hidden = 0;
  double eps = 1e-6, theta = 100.0;
  Act act = Act::kGeluTanh;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Tensor input_proj, pos_table, inv_freq;
  at::Tensor std_bias, std_scale;  // the compute dtype's values in fp32; undefined without standardize
  std::vector<Layer> layers;
  at::Tensor projection;  // embed_vision.embedding_projection.weight [text hidden, D]

  at::Tensor clip(const Clippable& c, const at::Tensor& x) const {
    at::Tensor h = c.in_min.defined() ? at::clamp(x, c.in_min, c.in_max) : x;
    h = linear(c.linear, h, training);
    return c.out_min.defined() ? at::clamp(h, c.out_min, c.out_max) : h;
  }
  // Gemma4RMSNorm op for op: in fp32, x * (mean(x^2) + eps)^-0.5 (a pow, not rsqrt), times w; w undefined:
  // the weightless norm (v_norm, embed_vision's).
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w) const {
    const at::Tensor f = x.to(at::kFloat);
    at::Tensor out = f * at::pow(f.pow(2).mean(-1, true) + eps, -0.5);
    if (w.defined()) out = out * w.to(at::kFloat);
    return out.to(x.scalar_type());
  }

  // x [images, patches, heads, head_dim]: the first half rotated by x positions, the second by y.
  static at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t half = x.size(-1) / 2;
    std::vector<at::Tensor> parts;
    for (int64_t a = 0; a < 2; ++a)
      parts.push_back(rotate(x.narrow(-1, a * half, half), cos.narrow(-1, a * half, half).unsqueeze(2),
                             sin.narrow(-1, a * half, half).unsqueeze(2)));
    return at::cat(parts, -1);
  }

  at::Tensor attention(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& mask) const {
    const int64_t b = x.size(0), n = x.size(1);
    at::Tensor q = rope(norm(clip(l.q, x).view({b, n, heads, head_dim}), l.q_norm), cos, sin).transpose(1, 2);
    at::Tensor k = rope(norm(clip(l.k, x).view({b, n, kv_heads, head_dim}), l.k_norm), cos, sin).transpose(1, 2);
    at::Tensor v = norm(clip(l.v, x).view({b, n, kv_heads, head_dim}), {}).transpose(1, 2);
    if (kv_heads != heads) {
      k = at::repeat_interleave(k, heads / kv_heads, 1);
      v = at::repeat_interleave(v, heads / kv_heads, 1);
    }
    at::Tensor o = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, 1.0);
    return clip(l.o, o.transpose(1, 2).reshape({b, n, heads * head_dim}));
  }

  void check(const PixelInputs& in) const {
    const at::Tensor &px = in.pixel_values, &pos = in.position_ids;
    if (!px.defined() || px.dim() != 3 || px.size(2) != 3 * patch * patch)
      throw std::invalid_argument("Gemma 4 vision tower: pixel_values must be [images, max_patches, " +
                                  std::to_string(3 * patch * patch) + "] (3 * patch_size^2)");
    if (!pos.defined() || pos.dim() != 3 || pos.size(0) != px.size(0) || pos.size(1) != px.size(1) ||
        pos.size(2) != 2 || at::isFloatingType(pos.scalar_type()))
      throw std::invalid_argument("Gemma 4 vision tower: image_position_ids must be an integer [images, max_patches, 2]"
                                  " tensor beside pixel_values");
    if (pos.numel() > 0 && pos.max().item<int64_t>() >= table)
      throw std::invalid_argument("Gemma 4 vision tower: image_position_ids hold " +
                                  std::to_string(pos.max().item<int64_t>()) +
                                  ", past the position table (vision_config.position_embedding_size " +
                                  std::to_string(table) + ")");
    if (px.size(1) % (pool * pool) || px.size(1) < pool * pool)
      throw std::invalid_argument("Gemma 4 vision tower: max_patches " + std::to_string(px.size(1)) +
                                  " is not a positive multiple of pooling_kernel_size^2 = " + std::to_string(pool * pool));
  }

  std::vector<int64_t> tokens_per_image(const PixelInputs& in) const override {
    check(in);
    const at::Tensor real = (in.position_ids != -1).all(-1).sum(-1).cpu();
    std::vector<int64_t> out;
    for (int64_t i = 0; i < real.size(0); ++i) out.push_back(real[i].item<int64_t>() / (pool * pool));
    return out;
  }

  // transformers' Gemma4VisionPooler: [images, length, D] fp32 block averages and which blocks hold a patch.
  std::pair<at::Tensor, at::Tensor> pooled(const at::Tensor& h, const at::Tensor& pos, int64_t length) const {
    const at::Tensor clamped = pos.clamp_min(0);
    const at::Tensor max_x = std::get<0>(clamped.select(-1, 0).max(-1, true)) + 1;
    const at::Tensor blocks = at::floor_divide(clamped, pool);
    const at::Tensor index = blocks.select(-1, 0) + at::floor_divide(max_x, pool) * blocks.select(-1, 1);
    if (index.max().item<int64_t>() >= length)
      throw std::invalid_argument("Gemma 4 vision tower: image_position_ids place a patch in pooling block " +
                                  std::to_string(index.max().item<int64_t>()) + " of " + std::to_string(length) +
                                  " (max_patches / pooling_kernel_size^2)");
    const at::Tensor weights = at::one_hot(index.to(at::kLong), length).to(at::kFloat) / static_cast<double>(pool * pool);
    at::Tensor out = at::matmul(weights.transpose(1, 2), h.to(at::kFloat)).to(h.scalar_type());
    return {out, at::logical_not((weights == 0).all(1))};
  }

  at::Tensor forward(const PixelInputs& in) const override {
    check(in);
    enter(-1);
    const at::Tensor pos = in.position_ids.to(device, at::kLong);
    const at::Tensor padding = (pos == -1).all(-1);  // [images, patches]
    at::Tensor x = at::linear((2 * (in.pixel_values.to(device) - 0.5)).to(dtype), input_proj);
    const at::Tensor clamped = pos.clamp_min(0);
    at::Tensor pe = at::embedding(pos_table.select(0, 0), clamped.select(-1, 0)) +
                    at::embedding(pos_table.select(0, 1), clamped.select(-1, 1));
    x = x + at::where(padding.unsqueeze(-1), at::zeros({}, pe.options()), pe);
    leave(-1, x);
    // Angles [images, patches, 2, head_dim / 4] in fp32, cast; laid out (x, x, y, y) over head_dim.
    const at::Tensor freqs = pos.unsqueeze(-1).to(at::kFloat) * inv_freq;
    const auto table_of = [&](const at::Tensor& f) {
      const at::Tensor fx = f.select(2, 0), fy = f.select(2, 1);
      return at::cat({fx, fx, fy, fy}, -1).to(dtype);
    };
    const at::Tensor cos = table_of(at::cos(freqs)), sin = table_of(at::sin(freqs));
    // Padding keys masked for every query, materialised [images, 1, patches, patches] as transformers'
    // bidirectional mask is (SDPA's kernel may sum otherwise over a broadcast one).
    const int64_t b = padding.size(0), n = padding.size(1);
    const at::Tensor mask = at::logical_not(padding).view({b, 1, 1, n}).expand({b, 1, n, n}).contiguous();
    for (int64_t i = 0; i < depth(); ++i) {
      const Layer& l = layers[static_cast<size_t>(i)];
      enter(i);
      x = x + norm(attention(l, norm(x, l.input_norm), cos, sin, mask), l.post_attn_norm);
      at::Tensor h = norm(x, l.pre_ffw_norm);
      h = clip(l.down, activate(clip(l.gate, h), act) * clip(l.up, h));
      x = x + norm(h, l.post_ffw_norm);
      leave(i, x);
    }
    enter(depth());
    x = x.masked_fill(padding.unsqueeze(-1), 0.0);
    auto [avg, valid] = pooled(x, pos, x.size(1) / (pool * pool));
    at::Tensor soft = avg.to(at::kFloat) * std::sqrt(static_cast<double>(hidden));
    soft = soft.index({valid});  // [tokens, D]
    if (std_bias.defined()) soft = (soft - std_bias) * std_scale;
    soft = norm(soft.to(dtype), {});
    at::Tensor out = at::linear(soft, as_dtype(projection, dtype));
    leave(depth(), out);
    return out;
  }
  int64_t depth() const override { return static_cast<int64_t>(layers.size()); }

  std::vector<std::pair<std::string, modules::LoraLinear*>> linears() override {
    std::vector<std::pair<std::string, modules::LoraLinear*>> out;
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string p = "model.vision_tower.encoder.layers." + std::to_string(i) + ".";
      for (auto [name, c] : clippables(layers[i])) out.emplace_back(p + name + ".linear", &c->linear);
    }
    return out;
  }
  std::vector<std::pair<std::string, at::Tensor*>> projector() override {
    return {{"model.embed_vision.embedding_projection.weight", &projection}};
  }
  std::vector<std::pair<std::string, at::Tensor*>> frozen() override {
    const std::string v = "model.vision_tower.";
    std::vector<std::pair<std::string, at::Tensor*>> out = {
        {v + "patch_embedder.input_proj.weight", &input_proj},
        {v + "patch_embedder.position_embedding_table", &pos_table}};
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string p = v + "encoder.layers." + std::to_string(i) + ".";
      Layer& l = layers[i];
      for (auto [name, t] : {std::pair{"input_layernorm.weight", &l.input_norm},
                             {"post_attention_layernorm.weight", &l.post_attn_norm},
                             {"pre_feedforward_layernorm.weight", &l.pre_ffw_norm},
                             {"post_feedforward_layernorm.weight", &l.post_ffw_norm},
                             {"self_attn.q_norm.weight", &l.q_norm}, {"self_attn.k_norm.weight", &l.k_norm}})
        out.emplace_back(p + name, t);
      for (auto [name, c] : clippables(l))
        if (c->in_min.defined())
          for (auto [bound, t] : {std::pair{".input_min", &c->in_min}, {".input_max", &c->in_max},
                                  {".output_min", &c->out_min}, {".output_max", &c->out_max}})
            out.emplace_back(p + name + bound, t);
    }
    if (std_bias.defined()) {
      out.emplace_back(v + "std_bias", &std_bias);
      out.emplace_back(v + "std_scale", &std_scale);
    }
    return out;
  }
  std::vector<std::string> target_names() const override {
    return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  }
};

Clippable load_clippable(const TowerWeights& w, const std::string& module, int64_t out, int64_t in, bool clipped) {
  Clippable c;
  c.linear = w.linear(module + ".linear", out, in, false, true);
  if (clipped) {
    c.in_min = w.dense(module + ".input_min", {});
    c.in_max = w.dense(module + ".input_max", {});
    c.out_min = w.dense(module + ".output_min", {});
    c.out_max = w.dense(module + ".output_max", {});
  }
  return c;
}

Layer load_layer(const TowerWeights& w, const Gemma4Tower& t, int64_t i, bool clipped) {
  const std::string p = "encoder.layers." + std::to_string(i) + ".";
  const int64_t D = t.hidden, q = t.heads * t.head_dim, kv = t.kv_heads * t.head_dim;
  Layer l;
  l.input_norm = w.dense(p + "input_layernorm.weight", {D});
  l.post_attn_norm = w.dense(p + "post_attention_layernorm.weight", {D});
  l.pre_ffw_norm = w.dense(p + "pre_feedforward_layernorm.weight", {D});
  l.post_ffw_norm = w.dense(p + "post_feedforward_layernorm.weight", {D});
  l.q_norm = w.dense(p + "self_attn.q_norm.weight", {t.head_dim});
  l.k_norm = w.dense(p + "self_attn.k_norm.weight", {t.head_dim});
  l.q = load_clippable(w, p + "self_attn.q_proj", q, D, clipped);
  l.k = load_clippable(w, p + "self_attn.k_proj", kv, D, clipped);
  l.v = load_clippable(w, p + "self_attn.v_proj", kv, D, clipped);
  l.o = load_clippable(w, p + "self_attn.o_proj", D, q, clipped);
  l.gate = load_clippable(w, p + "mlp.gate_proj", t.inter, D, clipped);
  l.up = load_clippable(w, p + "mlp.up_proj", t.inter, D, clipped);
  l.down = load_clippable(w, p + "mlp.down_proj", D, t.inter, clipped);
  return l;
}

}  // namespace

std::unique_ptr<Tower> load_gemma4_tower(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                         const TowerLoadOptions& opt) {
  const std::string where = ckpt.path() + "/config.json";
  const nlohmann::json& vc = vision_config(config, where);
  const std::string vw = where + " vision_config";
  auto t = std::make_unique<Gemma4Tower>();
  t->hidden = cfg::get_int(vc, "hidden_size", vw, 768);
  t->heads = cfg::get_int(vc, "num_attention_heads", vw, 12);
  t->kv_heads = cfg::get_int(vc, "num_key_value_heads", vw, 12);
  t->head_dim = cfg::get_int(vc, "head_dim", vw, 64);
  t->inter = cfg::get_int(vc, "intermediate_size", vw, 3072);
  t->patch = cfg::get_int(vc, "patch_size", vw, 16);
  t->table = cfg::get_int(vc, "position_embedding_size", vw, 10240);
  t->pool = cfg::get_int(vc, "pooling_kernel_size", vw, 3);
  t->eps = cfg::get_num(vc, "rms_norm_eps", vw, 1e-6);
  t->theta = vision_rope_theta(vc, where, 100.0);
  t->act = parse_act(vc.value("hidden_activation", std::string("gelu_pytorch_tanh")), where,
                     "vision_config.hidden_activation");
  const int64_t depth = cfg::get_int(vc, "num_hidden_layers", vw, 16);
  const bool clipped = cfg::get_bool(vc, "use_clipped_linears", vw, false);
  const bool standardize = cfg::get_bool(vc, "standardize", vw, false);
  if (cfg::present(vc, "output_proj_dims")) cfg::fail(where, "vision_config.output_proj_dims", "is not read");
  if (!cfg::present(config, "text_config") || !config.at("text_config").is_object())
    cfg::fail(where, "text_config", "expected an object");
  t->text_hidden = cfg::get_int(config.at("text_config"), "hidden_size", where + " text_config", 2304);
  for (const int64_t v : {t->hidden, t->heads, t->kv_heads, t->head_dim, t->inter, t->patch, t->table, depth})
    if (v < 1) cfg::fail(where, "vision_config", "sizes must be positive");
  if (t->heads % t->kv_heads) cfg::fail(where, "vision_config.num_key_value_heads", "must divide num_attention_heads");
  if (t->head_dim % 4) cfg::fail(where, "vision_config.head_dim", "must be a multiple of 4 (the 2-D rotary)");
  // transformers skips the pooler's averaging at kernel 1 and then keeps the padding rows instead of the image's.
  if (t->pool < 2) cfg::fail(where, "vision_config.pooling_kernel_size", "must be at least 2");
  t->dtype = opt.compute_dtype;
  t->device = opt.device;

  const TowerWeights w(ckpt, {"model.vision_tower.", "vision_tower."}, "patch_embedder.position_embedding_table", opt);
  const TowerWeights e(ckpt, {"model.embed_vision.", "embed_vision."}, "embedding_projection.weight", opt);
  t->key_prefixes = {{"model.vision_tower.", w.prefix()}, {"model.embed_vision.", e.prefix()}};
  t->input_proj = w.dense("patch_embedder.input_proj.weight", {t->hidden, 3 * t->patch * t->patch});
  t->pos_table = w.dense("patch_embedder.position_embedding_table", {2, t->table, t->hidden});
  t->inv_freq = axial_inv_freq(t->head_dim, t->theta).to(opt.device);
  for (int64_t i = 0; i < depth; ++i) t->layers.push_back(load_layer(w, *t, i, clipped));
  if (standardize) {
    // Buffers of the model's dtype, widened where transformers applies them (.float()).
    t->std_bias = w.dense("std_bias", {t->hidden}).to(at::kFloat);
    t->std_scale = w.dense("std_scale", {t->hidden}).to(at::kFloat);
  }
  t->projection = e.dense("embedding_projection.weight", {t->text_hidden, t->hidden});
  return t;
}

}  // namespace qlora::models::vision
