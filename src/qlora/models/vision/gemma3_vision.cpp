// Gemma 3's vision tower (Gemma3ForConditionalGeneration: model.vision_tower, a SiglipVisionModel, and
// model.multi_modal_projector), as transformers 5.23 computes get_image_features:
//   patches     pixel_values [images, C, S, S] (S = image_size: the processor's fixed square) through the
//               Conv2d of kernel = stride = patch_size, plus the learned position_embedding (one row a patch,
//               no interpolation);
//   layers      x + out_proj(attn(layer_norm1 x)), x + fc2(act(fc1(layer_norm2 x))): LayerNorms
//               (layer_norm_eps), q/k/v/out with biases, full attention over the image, scale head_dim^-0.5;
//   post_layernorm; SigLIP's attention-pooling head (vision_use_head) is not part of the image features;
//   projector   the patches [images, (S/P)^2, D] as a (S/P) x (S/P) grid average-pooled to
//               mm_tokens_per_image, Gemma's RMSNorm (1 + w, fp32, eps layer_norm_eps), then a matmul by the
//               bare mm_input_projection_weight [D, text hidden].
// Output: [images * mm_tokens_per_image, text hidden].
// Keys: vision_tower.vision_model.* (the Hub's), vision_tower.* (what transformers 5 writes) or either
// under model.; multi_modal_projector.* or model.multi_modal_projector.*.
// NF4: every layer's q/k/v/out_proj, fc1, fc2. Dense: the patch conv, position table, norms, biases, the projector.
#include <ATen/TensorOperators.h>
#include <ATen/ops/avg_pool2d.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <memory>
#include <stdexcept>

#include "qlora/models/config_json.h"
#include "qlora/models/vision/blocks.h"
#include "qlora/modules/rms_norm.h"
#include "qlora/ops/segment_attention_ops.h"

namespace qlora::models::vision {
namespace {

struct SiglipLayer {
  at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;
  modules::LoraLinear q, k, v, o, fc1, fc2;
};

class Gemma3Tower final : public Tower {
 public:
  int64_t hidden = 0, heads = 0, inter = 0, channels = 0, image = 0, patch = 0, text_hidden = 0, tokens = 0;
  double eps = 1e-6;
  Act act = Act::kGeluTanh;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Tensor patch_w, patch_b, pos_embed, post_w, post_b;
  std::vector<SiglipLayer> layers;
  at::Tensor soft_norm_w, projection;  // the projector: mm_soft_emb_norm.weight [D], mm_input_projection_weight [D, text]
  std::string tower_prefix, projector_prefix;

  void check(const PixelInputs& in) const {
    const at::Tensor& px = in.pixel_values;
    if (!px.defined() || px.dim() != 4 || px.size(1) != channels || px.size(2) != image || px.size(3) != image)
      throw std::invalid_argument("Gemma 3 vision tower: pixel_values must be [images, " + std::to_string(channels) +
                                  ", " + std::to_string(image) + ", " + std::to_string(image) +
                                  "] (vision_config.image_size)");
  }

  std::vector<int64_t> tokens_per_image(const PixelInputs& in) const override {
    check(in);
    return std::vector<int64_t>(static_cast<size_t>(in.pixel_values.size(0)), tokens);
  }

  Unbiased attention(const SiglipLayer& l, const at::Tensor& x) const {
    const int64_t b = x.size(0), n = x.size(1), hd = hidden / heads;
    // [images * patches, heads, hd], each image its own segment (ops/segment_attention_ops.h).
    const auto rows_of = [&](const modules::LoraLinear& p) { return linear(p, x, training).view({b * n, heads, hd}); };
    const at::Tensor o = ops::segment_attention(rows_of(l.q), rows_of(l.k), rows_of(l.v), std::vector<int64_t>(b, n),
                                                1.0 / std::sqrt(static_cast<double>(hd)));
    return linear_unbiased(l.o, o.reshape({b, n, hidden}), training);
  }

  at::Tensor forward(const PixelInputs& in) const override {
    check(in);
    enter(-1);
    at::Tensor x = at::conv2d(in.pixel_values.to(device, dtype), patch_w, patch_b, {patch, patch});
    x = x.flatten(2).transpose(1, 2) + pos_embed;  // [images, patches, D]
    leave(-1, x);
    for (int64_t i = 0; i < depth(); ++i) {
      const SiglipLayer& l = layers[static_cast<size_t>(i)];
      enter(i);
      x = residual(x, attention(l, at::layer_norm(x, {hidden}, l.ln1_w, l.ln1_b, eps)));
      at::Tensor h = at::layer_norm(x, {hidden}, l.ln2_w, l.ln2_b, eps);
      x = residual(x, linear_unbiased(l.fc2, activate(linear_unbiased(l.fc1, h, training), act), training));
      leave(i, x);
    }
    enter(depth());
    x = at::layer_norm(x, {hidden}, post_w, post_b, eps);
    // The projector: average-pool the patch grid to tokens_per_side^2, RMSNorm (1 + w), matmul.
    const int64_t b = x.size(0), per_side = image / patch;
    const int64_t kernel = per_side / static_cast<int64_t>(std::sqrt(static_cast<double>(tokens)));
    at::Tensor grid = x.transpose(1, 2).reshape({b, hidden, per_side, per_side}).contiguous();
    at::Tensor pooled = at::avg_pool2d(grid, {kernel, kernel}, {kernel, kernel}).flatten(2).transpose(1, 2);
    at::Tensor normed = modules::rms_norm(pooled, as_dtype(soft_norm_w, dtype), eps, modules::RmsScale::kOnePlusWeight);
    at::Tensor out = at::matmul(normed, as_dtype(projection, dtype)).to(dtype).reshape({-1, text_hidden});
    leave(depth(), out);
    return out;
  }
  int64_t depth() const override { return static_cast<int64_t>(layers.size()); }

  std::vector<std::pair<std::string, modules::LoraLinear*>> linears() override {
    std::vector<std::pair<std::string, modules::LoraLinear*>> out;
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string p = "model.vision_tower.encoder.layers." + std::to_string(i) + ".";
      SiglipLayer& l = layers[i];
      for (auto [name, lin] : {std::pair{"self_attn.q_proj", &l.q}, {"self_attn.k_proj", &l.k},
                               {"self_attn.v_proj", &l.v}, {"self_attn.out_proj", &l.o}, {"mlp.fc1", &l.fc1},
                               {"mlp.fc2", &l.fc2}})
        out.emplace_back(p + name, lin);
    }
    return out;
  }
  std::vector<std::pair<std::string, at::Tensor*>> projector() override {
    return {{"model.multi_modal_projector.mm_input_projection_weight", &projection},
            {"model.multi_modal_projector.mm_soft_emb_norm.weight", &soft_norm_w}};
  }
  std::vector<std::pair<std::string, at::Tensor*>> frozen() override {
    const std::string v = "model.vision_tower.";
    std::vector<std::pair<std::string, at::Tensor*>> out = {
        {v + "embeddings.patch_embedding.weight", &patch_w}, {v + "embeddings.patch_embedding.bias", &patch_b},
        {v + "embeddings.position_embedding.weight", &pos_embed}};
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string p = v + "encoder.layers." + std::to_string(i) + ".";
      SiglipLayer& l = layers[i];
      for (auto [name, t] : {std::pair{"layer_norm1.weight", &l.ln1_w}, {"layer_norm1.bias", &l.ln1_b},
                             {"layer_norm2.weight", &l.ln2_w}, {"layer_norm2.bias", &l.ln2_b}})
        out.emplace_back(p + name, t);
    }
    out.emplace_back(v + "post_layernorm.weight", &post_w);
    out.emplace_back(v + "post_layernorm.bias", &post_b);
    return out;
  }
  std::vector<std::string> target_names() const override {
    return {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"};
  }
};

SiglipLayer load_layer(const TowerWeights& w, int64_t i, int64_t D, int64_t I) {
  const std::string p = "encoder.layers." + std::to_string(i) + ".";
  SiglipLayer l;
  l.ln1_w = w.dense(p + "layer_norm1.weight", {D});
  l.ln1_b = w.dense(p + "layer_norm1.bias", {D});
  l.ln2_w = w.dense(p + "layer_norm2.weight", {D});
  l.ln2_b = w.dense(p + "layer_norm2.bias", {D});
  l.q = w.linear(p + "self_attn.q_proj", D, D, true, true);
  l.k = w.linear(p + "self_attn.k_proj", D, D, true, true);
  l.v = w.linear(p + "self_attn.v_proj", D, D, true, true);
  l.o = w.linear(p + "self_attn.out_proj", D, D, true, true);
  l.fc1 = w.linear(p + "mlp.fc1", I, D, true, true);
  l.fc2 = w.linear(p + "mlp.fc2", D, I, true, true);
  return l;
}

}  // namespace

std::unique_ptr<Tower> load_gemma3_tower(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                         const TowerLoadOptions& opt) {
  const std::string where = ckpt.path() + "/config.json";
  const nlohmann::json& vc = vision_config(config, where);
  const std::string vw = where + " vision_config";
  auto t = std::make_unique<Gemma3Tower>();
  t->hidden = cfg::get_int(vc, "hidden_size", vw, 768);
  t->heads = cfg::get_int(vc, "num_attention_heads", vw, 12);
  t->inter = cfg::get_int(vc, "intermediate_size", vw, 3072);
  t->channels = cfg::get_int(vc, "num_channels", vw, 3);
  t->image = cfg::get_int(vc, "image_size", vw, 224);
  t->patch = cfg::get_int(vc, "patch_size", vw, 16);
  t->eps = cfg::get_num(vc, "layer_norm_eps", vw, 1e-6);
  t->act = parse_act(vc.value("hidden_act", std::string("gelu_pytorch_tanh")), where, "vision_config.hidden_act");
  const int64_t depth = cfg::get_int(vc, "num_hidden_layers", vw, 12);
  t->tokens = cfg::get_int(config, "mm_tokens_per_image", where, 256);
  if (!cfg::present(config, "text_config") || !config.at("text_config").is_object())
    cfg::fail(where, "text_config", "expected an object");
  t->text_hidden = cfg::get_int(config.at("text_config"), "hidden_size", where + " text_config", 2304);
  for (const int64_t v : {t->hidden, t->heads, t->inter, t->channels, t->image, t->patch, t->tokens, depth})
    if (v < 1) cfg::fail(where, "vision_config", "sizes must be positive");
  if (t->hidden % t->heads) cfg::fail(where, "vision_config.num_attention_heads", "must divide hidden_size");
  const int64_t per_side = t->image / t->patch, tokens_side = static_cast<int64_t>(std::sqrt(double(t->tokens)));
  if (t->image % t->patch || tokens_side * tokens_side != t->tokens || per_side % tokens_side)
    cfg::fail(where, "mm_tokens_per_image", "must be a square whose side divides image_size / patch_size (" +
                                                std::to_string(per_side) + ")");
  t->dtype = opt.compute_dtype;
  t->device = opt.device;

  const TowerWeights w(ckpt, {"vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                              "model.vision_tower."},
                       "post_layernorm.weight", opt);
  const TowerWeights p(ckpt, {"multi_modal_projector.", "model.multi_modal_projector."}, "mm_soft_emb_norm.weight", opt);
  t->key_prefixes = {{"model.vision_tower.", w.prefix()}, {"model.multi_modal_projector.", p.prefix()}};
  const int64_t D = t->hidden;
  t->patch_w = w.dense("embeddings.patch_embedding.weight", {D, t->channels, t->patch, t->patch});
  t->patch_b = w.dense("embeddings.patch_embedding.bias", {D});
  t->pos_embed = w.dense("embeddings.position_embedding.weight", {per_side * per_side, D});
  for (int64_t i = 0; i < depth; ++i) t->layers.push_back(load_layer(w, i, D, t->inter));
  t->post_w = w.dense("post_layernorm.weight", {D});
  t->post_b = w.dense("post_layernorm.bias", {D});
  t->soft_norm_w = p.dense("mm_soft_emb_norm.weight", {D});
  t->projection = p.dense("mm_input_projection_weight", {D, t->text_hidden});
  return t;
}

}  // namespace qlora::models::vision
