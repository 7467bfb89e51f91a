// Sharding: concatenating every rank's buffers (an all-gather) restores the tensor exactly,
// for W = 1..8 and shapes that torchao could not shard.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "qlora/ops/nf4_ops.h"
#include "quant/nf4_shard.h"

namespace qlora {
namespace {

TEST(Nf4Shard, AllGatherRestoresExactlyForEveryWorldSize) {
  for (auto shape : std::vector<std::vector<int64_t>>{{4096, 64}, {333, 65}, {3, 7}, {1000, 130}}) {
    at::Tensor x = at::randn(shape).to(at::kBFloat16);
    Nf4Tensor t = ops::nf4_quantize(x, "w");
    const at::Tensor expect = ops::nf4_dequantize(t, at::kBFloat16);
    for (int64_t world = 1; world <= 8; ++world) {
      std::vector<Nf4Shard> shards;
      for (int64_t r = 0; r < world; ++r) shards.push_back(nf4_shard(t, r, world));
      for (const auto& s : shards) {  // equal sizes: what all_gather_into_tensor needs
        ASSERT_EQ(s.codes.numel(), shards[0].codes.numel());
        ASSERT_EQ(s.scalers.numel(), shards[0].scalers.numel());
        ASSERT_EQ(s.factors.numel(), shards[0].factors.numel());
      }
      Nf4Tensor back = nf4_unshard(shards);
      EXPECT_TRUE(at::equal(back.codes, t.codes)) << world;
      EXPECT_TRUE(at::equal(back.scalers, t.scalers)) << world;
      EXPECT_TRUE(at::equal(back.factors, t.factors)) << world;
      EXPECT_TRUE(at::equal(back.mean, t.mean));
      EXPECT_EQ(back.shape, t.shape);
      EXPECT_TRUE(at::equal(ops::nf4_dequantize(back, at::kBFloat16), expect)) << world;
    }
  }
}

TEST(Nf4Shard, ShardsSplitTheWorkEvenly) {
  Nf4Tensor t = ops::nf4_quantize(at::randn({64, 1024}), "w");  // 4 groups
  const auto l = nf4_shard_layout(t.layout, 3);
  EXPECT_EQ(l.groups_per_rank, 2);
  Nf4Shard last = nf4_shard(t, 2, 3);  // groups 4 and 5: both padding
  EXPECT_TRUE(at::all(last.codes == nf4::kZeroByte).item<bool>());
  EXPECT_TRUE(at::all(last.scalers == 0).item<bool>());
  EXPECT_TRUE(at::all(last.factors.isinf()).item<bool>());
  Nf4Shard first = nf4_shard(t, 0, 3);
  EXPECT_TRUE(at::equal(first.codes, t.codes.narrow(0, 0, 2 * 8192)));
}

TEST(Nf4Shard, RejectsMismatchedGathers) {
  Nf4Tensor t = ops::nf4_quantize(at::randn({64, 64}), "w");
  std::vector<Nf4Shard> shards = {nf4_shard(t, 0, 2), nf4_shard(t, 1, 2)};
  EXPECT_THROW(nf4_unshard({shards[1], shards[0]}), std::invalid_argument);
  EXPECT_THROW(nf4_unshard(shards[0].codes, shards[0].scalers, shards[0].factors, shards[0]),
               std::invalid_argument);
  EXPECT_THROW(nf4_shard(t, 2, 2), std::invalid_argument);
}

}  // namespace
}  // namespace qlora
