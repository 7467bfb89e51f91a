// Tests for models/vision: Qwen3.5's position-table interpolation (the spatial-merge order of its patches,
// align_corners bilinear taps that reproduce a linear table exactly) and the axial rotary's frequencies;
// the tower loader's refusal of a checkpoint without a tower; a tiny Gemma 3 tower written here: its shapes,
// LoRA on named linears (and the refusal of others), the trainable projector's and adapters' gradients, bad input.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qlora/io/safetensors.h"
#include "qlora/models/vision/blocks.h"
#include "qlora/models/vision/qwen3_5_vision.h"

using namespace qlora::models::vision;

namespace {

at::Tensor grid(int64_t t, int64_t h, int64_t w) {
  return at::tensor(std::vector<int64_t>{t, h, w}, at::TensorOptions().dtype(at::kLong)).view({1, 3});
}

TEST(VisionPosInterpolation, PatchesComeInSpatialMergeBlocks) {
  const PosInterpolation p = qwen_pos_interpolation(grid(1, 4, 6), 4, 2);
  // Block (0, 0): (0,0) (0,1) (1,0) (1,1); then block (0, 1): (0,2) (0,3) (1,2) (1,3); ...
  const int64_t rows[] = {0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3};
  const int64_t cols[] = {0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 0, 1, 0, 1};
  ASSERT_EQ(p.rows.numel(), 24);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(p.rows[i].item<int64_t>(), rows[i]) << i;
    EXPECT_EQ(p.cols[i].item<int64_t>(), cols[i]) << i;
  }
}

TEST(VisionPosInterpolation, SameSizeGridIsTheTableItself) {
  const PosInterpolation p = qwen_pos_interpolation(grid(1, 4, 4), 4, 2);
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t own = p.rows[i].item<int64_t>() * 4 + p.cols[i].item<int64_t>();
    EXPECT_EQ(p.indices[i][0].item<int64_t>(), own);
    EXPECT_EQ(p.weights[i][0].item<float>(), 1.0f);
    for (int k = 1; k < 4; ++k) EXPECT_EQ(p.weights[i][k].item<float>(), 0.0f);
  }
}

// Bilinear interpolation reproduces a table linear in (row, col): at grid position (r, c) of an h x w image
// the result is a * r (side-1)/(h-1) + b * c (side-1)/(w-1), with align_corners.
TEST(VisionPosInterpolation, LinearTableIsReproduced) {
  const int64_t side = 4, h = 6, w = 10, frames = 2;
  const PosInterpolation p = qwen_pos_interpolation(grid(frames, h, w), side, 2);
  ASSERT_EQ(p.indices.size(0), frames * h * w);
  const double a = 1.0, b = 10.0;
  for (int64_t i = 0; i < p.indices.size(0); ++i) {
    double value = 0.0, total = 0.0;
    for (int k = 0; k < 4; ++k) {
      const int64_t idx = p.indices[i][k].item<int64_t>();
      const double wk = p.weights[i][k].item<float>();
      value += wk * (a * static_cast<double>(idx / side) + b * static_cast<double>(idx % side));
      total += wk;
    }
    const double r = static_cast<double>(p.rows[i].item<int64_t>()), c = static_cast<double>(p.cols[i].item<int64_t>());
    EXPECT_NEAR(total, 1.0, 1e-6) << i;
    EXPECT_NEAR(value, a * r * (side - 1) / (h - 1) + b * c * (side - 1) / (w - 1), 1e-5) << i;
  }
  // The second frame repeats the first.
  EXPECT_TRUE(p.indices.narrow(0, 0, h * w).equal(p.indices.narrow(0, h * w, h * w)));
}

TEST(VisionRotary, AxialFrequenciesSpanHalfTheHead) {
  // head_dim 16: each axis rotates 8 channels, 4 frequencies 1 / theta^(2i / 8).
  const at::Tensor f = axial_inv_freq(16, 10000.0);
  ASSERT_EQ(f.numel(), 4);
  for (int64_t i = 0; i < 4; ++i)
    EXPECT_NEAR(f[i].item<float>(), 1.0 / std::pow(10000.0, 2.0 * static_cast<double>(i) / 8.0), 1e-7);
}

TEST(VisionRotary, RotateHalf) {
  // x = (1, 2, 3, 4), cos 0, sin 1: rotate_half(x) = (-3, -4, 1, 2).
  const at::Tensor x = at::arange(1, 5, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor y = rotate(x, at::zeros({4}), at::ones({4}));
  const float want[] = {-3, -4, 1, 2};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(y[i].item<float>(), want[i]);
}

TEST(VisionTower, TextOnlyCheckpointIsRefused) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "qlora_vision_text_only";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "llama"})";
  try {
    load_tower(dir.string(), {});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no vision tower"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("qwen3_5"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// A Gemma 3 checkpoint with a tiny SigLIP tower: hidden 8, 2 heads, 2 x 2 patches of 4 pooled to 1 token.
std::filesystem::path tiny_gemma3(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "gemma3", "mm_tokens_per_image": 1,
    "text_config": {"hidden_size": 6},
    "vision_config": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "image_size": 8, "patch_size": 4, "model_type": "siglip_vision_model"}})";
  std::vector<std::pair<std::string, at::Tensor>> t;
  const auto add = [&](const std::string& key, std::vector<int64_t> shape) { t.emplace_back(key, at::randn(shape)); };
  const std::string l = "vision_tower.encoder.layers.0.";
  add("vision_tower.embeddings.patch_embedding.weight", {8, 3, 4, 4});
  add("vision_tower.embeddings.patch_embedding.bias", {8});
  add("vision_tower.embeddings.position_embedding.weight", {4, 8});
  for (const char* n : {"layer_norm1", "layer_norm2"}) {
    add(l + n + ".weight", {8});
    add(l + n + ".bias", {8});
  }
  for (const char* n : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"}) {
    add(l + n + ".weight", {8, 8});
    add(l + n + ".bias", {8});
  }
  add(l + "mlp.fc1.weight", {16, 8});
  add(l + "mlp.fc1.bias", {16});
  add(l + "mlp.fc2.weight", {8, 16});
  add(l + "mlp.fc2.bias", {8});
  add("vision_tower.post_layernorm.weight", {8});
  add("vision_tower.post_layernorm.bias", {8});
  add("multi_modal_projector.mm_soft_emb_norm.weight", {8});
  add("multi_modal_projector.mm_input_projection_weight", {8, 6});
  qlora::io::save_safetensors((dir / "model.safetensors").string(), t);
  return dir;
}

TEST(VisionTower, TinyGemma3ShapesLoraAndGradients) {
  const std::filesystem::path dir = tiny_gemma3("qlora_vision_tiny_gemma3");
  std::unique_ptr<Tower> tower = load_tower(dir.string(), {});
  PixelInputs in;
  in.pixel_values = at::randn({2, 3, 8, 8});
  EXPECT_EQ(tower->tokens_per_image(in), (std::vector<int64_t>{1, 1}));
  const at::Tensor loaded = tower->forward(in);
  EXPECT_EQ(loaded.sizes().vec(), (std::vector<int64_t>{2, 6}));

  at::Generator gen = at::detail::createCPUGenerator(0);
  EXPECT_THROW(add_tower_lora(*tower, {"qkv"}, 2, 4.0, false, 0.0, gen), std::invalid_argument);
  EXPECT_EQ(add_tower_lora(*tower, {"q_proj", "fc2"}, 2, 4.0, false, 0.0, gen), 2);
  train_projector(*tower);
  const auto trainable = tower_trainable(*tower);
  ASSERT_EQ(trainable.size(), 6u);  // two adapters' A and B, the projection, the projector's norm
  EXPECT_EQ(trainable[0].first, "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(trainable[4].first, "base_model.model.model.multi_modal_projector.mm_input_projection_weight");
  tower->forward(in).pow(2).sum().backward();
  for (const auto& [name, t] : trainable) {
    ASSERT_TRUE(t.grad().defined()) << name;
    // B starts at 0, so A's gradient is 0 too; every other tensor's is not.
    if (name.find("lora_A") == std::string::npos) EXPECT_GT(t.grad().abs().max().item<float>(), 0.0f) << name;
  }
  // A reference policy's view (OriginalProjector): the projector as loaded while it lives, the trained copies after.
  at::NoGradGuard no_grad;
  for (auto& [name, t] : tower->projector()) t->add_(0.25);  // as an update would (lora_B is still 0)
  const at::Tensor moved = tower->forward(in);
  EXPECT_FALSE(at::allclose(moved, loaded));
  {
    OriginalProjector original(tower.get());
    EXPECT_TRUE(at::equal(tower->forward(in), loaded));
  }
  EXPECT_TRUE(at::equal(tower->forward(in), moved));
  EXPECT_TRUE(tower->projector()[0].second->is_same(trainable[4].second));

  in.pixel_values = at::randn({2, 3, 8, 12});
  EXPECT_THROW(tower->forward(in), std::invalid_argument);
  std::filesystem::remove_all(dir);
}

}  // namespace
