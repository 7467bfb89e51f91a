// Flat shard-group buffers: members round-trip through pack/view, any shard count splits any set of
// shapes evenly, typed views in a byte buffer are aligned, and misuse names the member.
#include "qlora/engine/flat_layout.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

using qlora::engine::FlatLayout;

namespace {

struct Spec {
  const char* name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

at::Tensor random_of(const Spec& s, int64_t seed) {
  at::manual_seed(seed);
  if (at::isFloatingType(s.dtype)) return at::randn(s.shape).to(s.dtype);
  return at::randint(-100, 100, s.shape).to(s.dtype);
}

}  // namespace

TEST(FlatLayout, ByteBufferHoldsNf4PiecesAndNormsForEveryShardCount) {
  // One decoder layer's frozen group in miniature: odd sizes on purpose.
  const std::vector<Spec> specs = {{"q.codes", at::kByte, {37}},     {"q.scalers", at::kChar, {3}},
                                   {"q.factors", at::kBFloat16, {1}}, {"q.mean", at::kBFloat16, {}},
                                   {"norm", at::kFloat, {5}},         {"k.codes", at::kByte, {1}},
                                   {"k.factors", at::kDouble, {2}}};
  for (int64_t w = 1; w <= 8; ++w) {
    FlatLayout layout(at::kByte, w);
    for (const auto& s : specs) layout.add(s.name, s.dtype, s.shape);
    at::Tensor full = layout.empty_full(at::TensorOptions());
    EXPECT_EQ(layout.padded_numel() % w, 0);
    EXPECT_EQ(layout.shard_numel() % FlatLayout::kAlign, 0) << "each shard starts aligned";
    std::vector<at::Tensor> values;
    for (size_t i = 0; i < specs.size(); ++i) {
      values.push_back(random_of(specs[i], 100 + i));
      layout.pack(full, specs[i].name, values.back());
    }
    // Shards reassemble to the buffer, and every member reads back from it exactly.
    std::vector<at::Tensor> shards;
    for (int64_t r = 0; r < w; ++r) shards.push_back(layout.shard_of(full, r).clone());
    const at::Tensor again = at::cat(shards);
    ASSERT_TRUE(at::equal(again, full)) << "w=" << w;
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& m = layout.member(specs[i].name);
      EXPECT_EQ(m.offset % FlatLayout::kAlign, 0) << m.name;
      const at::Tensor v = layout.view(again, m);
      EXPECT_EQ(v.scalar_type(), specs[i].dtype);
      EXPECT_EQ(v.sizes().vec(), specs[i].shape);
      EXPECT_TRUE(at::equal(v, values[i])) << m.name << " w=" << w;
    }
  }
}

TEST(FlatLayout, FloatBufferPacksTightAndViewsShareMemory) {
  FlatLayout layout(at::kFloat, 3);
  layout.add("a", at::kFloat, {2, 5});
  layout.add("b", at::kFloat, {7});
  EXPECT_EQ(layout.member("b").offset, 10);
  EXPECT_EQ(layout.used(), 17);
  EXPECT_EQ(layout.padded_numel() % 3, 0);
  EXPECT_GE(layout.padded_numel(), 17);
  at::Tensor full = layout.empty_full(at::TensorOptions());
  at::Tensor a = layout.view(full, layout.member("a"));
  a.fill_(2.0f);
  EXPECT_EQ(full.narrow(0, 0, 10).sum().item<float>(), 20.0f);
  EXPECT_EQ(full.narrow(0, 10, full.numel() - 10).abs().sum().item<float>(), 0.0f) << "padding stays zero";
}

TEST(FlatLayout, MisuseNamesTheMember) {
  FlatLayout layout(at::kFloat, 2);
  layout.add("lora_A", at::kFloat, {4, 2});
  EXPECT_THROW(layout.add("lora_A", at::kFloat, {1}), std::invalid_argument);
  try {
    layout.add("half", at::kHalf, {2});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'half'"), std::string::npos);
  }
  at::Tensor full = layout.empty_full(at::TensorOptions());
  EXPECT_THROW(layout.pack(full, "lora_A", at::zeros({3})), std::invalid_argument);
  EXPECT_THROW(layout.member("nope"), std::out_of_range);
  EXPECT_THROW(FlatLayout(at::kByte, 0), std::invalid_argument);
}
