#include "qlora/models/vision/qwen3_5_vision.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>

#include "qlora/models/config_json.h"
#include "qlora/models/vision/blocks.h"

namespace qlora::models::vision {

namespace {

// One axis' two taps for grid position `index` of `size`, from a table side of `side`, with
// transformers' fp32 arithmetic (align_corners: src = index * (side - 1) / max(size - 1, 1)).
void axis_taps(int64_t index, int64_t size, int64_t side, int64_t taps[2], float weights[2]) {
  const float src = static_cast<float>(index * (side - 1)) / static_cast<float>(std::max<int64_t>(size - 1, 1));
  const float floor = std::floor(src);
  for (int o = 0; o < 2; ++o) {
    taps[o] = std::clamp<int64_t>(static_cast<int64_t>(floor) + o, 0, side - 1);
    const float distance = std::fabs(src - floor - static_cast<float>(o));
    weights[o] = std::max(1.0f - distance, 0.0f);
  }
}

}  // namespace

PosInterpolation qwen_pos_interpolation(const at::Tensor& grid_thw, int64_t side, int64_t merge) {
  const at::Tensor g = grid_thw.to(at::kCPU, at::kLong).contiguous();
  const int64_t* thw = g.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < g.size(0); ++i) total += thw[3 * i] * thw[3 * i + 1] * thw[3 * i + 2];
  PosInterpolation out;
  out.indices = at::empty({total, 4}, at::kLong);
  out.weights = at::empty({total, 4}, at::kFloat);
  out.rows = at::empty({total}, at::kLong);
  out.cols = at::empty({total}, at::kLong);
  int64_t* idx = out.indices.data_ptr<int64_t>();
  float* wts = out.weights.data_ptr<float>();
  int64_t *rows = out.rows.data_ptr<int64_t>(), *cols = out.cols.data_ptr<int64_t>();
  int64_t p = 0;
  for (int64_t i = 0; i < g.size(0); ++i) {
    const int64_t t = thw[3 * i], h = thw[3 * i + 1], w = thw[3 * i + 2], blocks_w = w / merge;
    for (int64_t f = 0; f < t; ++f)
      for (int64_t within = 0; within < h * w; ++within, ++p) {
        // Spatial-merge-block order: (block row, block col, row in block, col in block).
        const int64_t in_col = within % merge, in_row = (within / merge) % merge;
        const int64_t block_col = (within / (merge * merge)) % blocks_w, block_row = within / (merge * merge * blocks_w);
        rows[p] = block_row * merge + in_row;
        cols[p] = block_col * merge + in_col;
        int64_t ht[2], wt[2];
        float hw[2], ww[2];
        axis_taps(rows[p], h, side, ht, hw);
        axis_taps(cols[p], w, side, wt, ww);
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b) {
            idx[4 * p + 2 * a + b] = ht[a] * side + wt[b];
            wts[4 * p + 2 * a + b] = hw[a] * ww[b];
          }
      }
  }
  return out;
}

namespace {

struct Block {
  at::Tensor norm1_w, norm1_b, norm2_w, norm2_b;
  modules::LoraLinear qkv, proj, fc1, fc2;
};

class Qwen35Tower final : public Tower {
 public:
  int64_t hidden = 0, heads = 0, inter = 0, channels = 0, patch = 0, temporal = 0, merge = 0, out_hidden = 0, side = 0;
  double theta = 10000.0;
  Act act = Act::kGeluTanh;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Tensor patch_w, patch_b, pos_embed, inv_freq;
  std::vector<Block> blocks;
  // The merger (the projector): LayerNorm(hidden), linear_fc1, linear_fc2.
  at::Tensor m_norm_w, m_norm_b, m_fc1_w, m_fc1_b, m_fc2_w, m_fc2_b;

  int64_t patch_dim() const { return channels * temporal * patch * patch; }

  std::vector<int64_t> tokens_per_image(const PixelInputs& in) const override {
    check(in);
    std::vector<int64_t> out;
    const at::Tensor g = in.grid_thw.to(at::kCPU, at::kLong).contiguous();
    for (int64_t i = 0; i < g.size(0); ++i)
      out.push_back(g[i][0].item<int64_t>() * g[i][1].item<int64_t>() * g[i][2].item<int64_t>() / (merge * merge));
    return out;
  }

  // The grid's frames (attention segments) after checking it against the pixel rows.
  std::vector<int64_t> check(const PixelInputs& in) const {
    const at::Tensor& g = in.grid_thw;
    if (!g.defined() || g.dim() != 2 || g.size(1) != 3 || g.size(0) < 1 || at::isFloatingType(g.scalar_type()))
      throw std::invalid_argument("Qwen3.5 vision tower: image_grid_thw must be an integer [images, 3] tensor");
    const at::Tensor& x = in.pixel_values;
    if (!x.defined() || x.dim() != 2 || x.size(1) != patch_dim())
      throw std::invalid_argument("Qwen3.5 vision tower: pixel_values must be [patches, " + std::to_string(patch_dim()) +
                                  "] (channels * temporal_patch_size * patch_size^2)");
    const at::Tensor gc = g.to(at::kCPU, at::kLong).contiguous();
    std::vector<int64_t> segments;
    int64_t rows = 0;
    for (int64_t i = 0; i < gc.size(0); ++i) {
      const int64_t t = gc[i][0].item<int64_t>(), h = gc[i][1].item<int64_t>(), w = gc[i][2].item<int64_t>();
      // Each dimension at most the pixel rows, so their products stay far from overflowing.
      if (t < 1 || h < 1 || w < 1 || h % merge || w % merge || t > x.size(0) || h > x.size(0) || w > x.size(0))
        throw std::invalid_argument("Qwen3.5 vision tower: image " + std::to_string(i) + "'s grid (" +
                                    std::to_string(t) + ", " + std::to_string(h) + ", " + std::to_string(w) +
                                    ") must be positive, at most the pixel rows, with h and w multiples of "
                                    "spatial_merge_size " + std::to_string(merge));
      for (int64_t f = 0; f < t; ++f) segments.push_back(h * w);
      rows += t * h * w;
    }
    if (rows != x.size(0))
      throw std::invalid_argument("Qwen3.5 vision tower: image_grid_thw holds " + std::to_string(rows) +
                                  " patches, pixel_values " + std::to_string(x.size(0)));
    return segments;
  }

  Unbiased attention(const Block& b, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<int64_t>& segments) const {
    const int64_t n = x.size(0), hd = hidden / heads;
    const std::vector<at::Tensor> qkv = linear(b.qkv, x, training).reshape({n, 3, heads, hd}).permute({1, 0, 2, 3}).unbind(0);
    const at::Tensor q = rotate_in_fp32(qkv[0], cos, sin), k = rotate_in_fp32(qkv[1], cos, sin);
    const at::Tensor o = segment_attention(q, k, qkv[2], segments, 1.0 / std::sqrt(static_cast<double>(hd)));
    return linear_unbiased(b.proj, o, training);
  }

  at::Tensor forward(const PixelInputs& in) const override {
    const std::vector<int64_t> segments = check(in);
    enter(-1);
    // transformers' Conv3d with kernel = stride = one patch, as the product it is: each row of pixel_values is one
    // patch flattened as the kernel is (channel, frame, row, column). ATen's bf16 conv3d took ~100x the
    // linear's time on a 3072-patch image (2-core Xeon).
    at::Tensor x = at::linear(in.pixel_values.to(device, dtype).reshape({-1, patch_w[0].numel()}),
                              patch_w.reshape({hidden, -1}), patch_b);
    const PosInterpolation pi = qwen_pos_interpolation(in.grid_thw, side, merge);
    // bf16 rows times fp32 weights promote to fp32; summed there, then cast (transformers' order).
    const at::Tensor pos = (at::embedding(pos_embed, pi.indices.to(device)) * pi.weights.to(device).unsqueeze(-1)).sum(1);
    x = x + pos.to(dtype);
    leave(-1, x);
    // Rotary: fp32 angles [patches, 2, head_dim / 4] -> (rows ++ cols) twice over head_dim.
    const at::Tensor freqs = at::stack({pi.rows, pi.cols}, 1).to(device).unsqueeze(-1).to(at::kFloat) * inv_freq;
    const auto table = [](const at::Tensor& f) {
      at::Tensor hw = at::cat({f.select(1, 0), f.select(1, 1)}, -1);
      return at::cat({hw, hw}, -1).unsqueeze(-2);  // [patches, 1, head_dim]
    };
    const at::Tensor cos = table(at::cos(freqs)), sin = table(at::sin(freqs));
    for (int64_t i = 0; i < depth(); ++i) {
      const Block& b = blocks[static_cast<size_t>(i)];
      enter(i);
      x = residual(x, attention(b, at::layer_norm(x, {hidden}, b.norm1_w, b.norm1_b, 1e-6), cos, sin, segments));
      at::Tensor h = at::layer_norm(x, {hidden}, b.norm2_w, b.norm2_b, 1e-6);
      x = residual(x, linear_unbiased(b.fc2, activate(linear_unbiased(b.fc1, h, training), act), training));
      leave(i, x);
    }
    enter(depth());
    at::Tensor m = at::layer_norm(x, {hidden}, as_dtype(m_norm_w, dtype), as_dtype(m_norm_b, dtype), 1e-6);
    m = m.reshape({-1, hidden * merge * merge});
    m = activate(at::linear(m, as_dtype(m_fc1_w, dtype), as_dtype(m_fc1_b, dtype)), Act::kGelu);
    at::Tensor out = at::linear(m, as_dtype(m_fc2_w, dtype), as_dtype(m_fc2_b, dtype));
    leave(depth(), out);
    return out;
  }
  int64_t depth() const override { return static_cast<int64_t>(blocks.size()); }

  std::vector<std::pair<std::string, modules::LoraLinear*>> linears() override {
    std::vector<std::pair<std::string, modules::LoraLinear*>> out;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string b = "model.visual.blocks." + std::to_string(i) + ".";
      out.emplace_back(b + "attn.qkv", &blocks[i].qkv);
      out.emplace_back(b + "attn.proj", &blocks[i].proj);
      out.emplace_back(b + "mlp.linear_fc1", &blocks[i].fc1);
      out.emplace_back(b + "mlp.linear_fc2", &blocks[i].fc2);
    }
    return out;
  }
  std::vector<std::pair<std::string, at::Tensor*>> projector() override {
    const std::string m = "model.visual.merger.";
    return {{m + "norm.weight", &m_norm_w},       {m + "norm.bias", &m_norm_b},
            {m + "linear_fc1.weight", &m_fc1_w}, {m + "linear_fc1.bias", &m_fc1_b},
            {m + "linear_fc2.weight", &m_fc2_w}, {m + "linear_fc2.bias", &m_fc2_b}};
  }
  std::vector<std::pair<std::string, at::Tensor*>> frozen() override {
    std::vector<std::pair<std::string, at::Tensor*>> out = {{"model.visual.patch_embed.proj.weight", &patch_w},
                                                            {"model.visual.patch_embed.proj.bias", &patch_b},
                                                            {"model.visual.pos_embed.weight", &pos_embed}};
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string b = "model.visual.blocks." + std::to_string(i) + ".";
      Block& k = blocks[i];
      for (auto [name, t] : {std::pair{"norm1.weight", &k.norm1_w}, {"norm1.bias", &k.norm1_b},
                             {"norm2.weight", &k.norm2_w}, {"norm2.bias", &k.norm2_b}})
        out.emplace_back(b + name, t);
    }
    return out;
  }
  std::vector<std::string> target_names() const override { return {"qkv", "proj", "linear_fc1", "linear_fc2"}; }
};

}  // namespace

std::unique_ptr<Tower> load_qwen3_5_tower(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                          const TowerLoadOptions& opt) {
  const std::string where = ckpt.path() + "/config.json";
  const nlohmann::json& vc = vision_config(config, where);
  const std::string vw = where + " vision_config";
  auto t = std::make_unique<Qwen35Tower>();
  t->hidden = cfg::get_int(vc, "hidden_size", vw, 1152);
  t->heads = cfg::get_int(vc, "num_heads", vw, 16);
  t->inter = cfg::get_int(vc, "intermediate_size", vw, 4304);
  t->channels = cfg::get_int(vc, "in_channels", vw, 3);
  t->patch = cfg::get_int(vc, "patch_size", vw, 16);
  t->temporal = cfg::get_int(vc, "temporal_patch_size", vw, 2);
  t->merge = cfg::get_int(vc, "spatial_merge_size", vw, 2);
  t->out_hidden = cfg::get_int(vc, "out_hidden_size", vw, 3584);
  const int64_t positions = cfg::get_int(vc, "num_position_embeddings", vw, 2304);
  const int64_t depth = cfg::get_int(vc, "depth", vw, 27);
  t->side = static_cast<int64_t>(std::sqrt(static_cast<double>(positions)));  // int(n ** 0.5)
  t->theta = vision_rope_theta(vc, where, 10000.0);
  t->act = parse_act(vc.value("hidden_act", std::string("gelu_pytorch_tanh")), where, "vision_config.hidden_act");
  for (const int64_t v : {t->hidden, t->heads, t->inter, t->channels, t->patch, t->temporal, t->merge, t->out_hidden,
                          positions, depth})
    if (v < 1) cfg::fail(where, "vision_config", "sizes must be positive");
  if (t->hidden % t->heads || (t->hidden / t->heads) % 4)
    cfg::fail(where, "vision_config.num_heads", "hidden_size / num_heads must be a multiple of 4 (the axial rotary)");
  t->dtype = opt.compute_dtype;
  t->device = opt.device;

  const TowerWeights w(ckpt, {"model.visual.", "visual."}, "pos_embed.weight", opt);
  t->key_prefixes = {{"model.visual.", w.prefix()}};
  const int64_t D = t->hidden, M = D * t->merge * t->merge;
  t->patch_w = w.dense("patch_embed.proj.weight", {D, t->channels, t->temporal, t->patch, t->patch});
  t->patch_b = w.dense("patch_embed.proj.bias", {D});
  t->pos_embed = w.dense("pos_embed.weight", {positions, D});
  t->inv_freq = axial_inv_freq(D / t->heads, t->theta).to(opt.device);
  for (int64_t i = 0; i < depth; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    Block k;
    k.norm1_w = w.dense(b + "norm1.weight", {D});
    k.norm1_b = w.dense(b + "norm1.bias", {D});
    k.norm2_w = w.dense(b + "norm2.weight", {D});
    k.norm2_b = w.dense(b + "norm2.bias", {D});
    k.qkv = w.linear(b + "attn.qkv", 3 * D, D, true, true);
    k.proj = w.linear(b + "attn.proj", D, D, true, true);
    k.fc1 = w.linear(b + "mlp.linear_fc1", t->inter, D, true, true);
    k.fc2 = w.linear(b + "mlp.linear_fc2", D, t->inter, true, true);
    t->blocks.push_back(std::move(k));
  }
  t->m_norm_w = w.dense("merger.norm.weight", {D});
  t->m_norm_b = w.dense("merger.norm.bias", {D});
  t->m_fc1_w = w.dense("merger.linear_fc1.weight", {M, M});
  t->m_fc1_b = w.dense("merger.linear_fc1.bias", {M});
  t->m_fc2_w = w.dense("merger.linear_fc2.weight", {t->out_hidden, M});
  t->m_fc2_b = w.dense("merger.linear_fc2.bias", {t->out_hidden});
  return t;
}

}  // namespace qlora::models::vision
