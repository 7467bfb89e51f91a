#include "quant/nf4_shard.h"

#include <ATen/ATen.h>

#include <limits>
#include <stdexcept>
#include <string>

namespace qlora {

Nf4ShardLayout nf4_shard_layout(const nf4::Layout& layout, int64_t world) {
  if (world < 1) throw std::invalid_argument("nf4 shard: world size must be >= 1");
  Nf4ShardLayout s;
  s.world = world;
  s.groups_per_rank = (layout.n_groups() + world - 1) / world;
  s.group_numel = layout.group_numel();
  s.scaler_block_size = layout.scaler_block_size;
  return s;
}

namespace {
// Rank's slice [begin, begin + per_rank) of a flat buffer of `total` items, padded with `fill`.
at::Tensor padded_slice(const at::Tensor& buf, int64_t rank, int64_t per_rank, double fill) {
  const int64_t total = buf.numel(), begin = rank * per_rank;
  const int64_t real = std::max<int64_t>(0, std::min(per_rank, total - begin));
  at::Tensor out = at::empty({per_rank}, buf.options());
  if (real > 0) out.narrow(0, 0, real).copy_(buf.narrow(0, begin, real));
  if (real < per_rank) out.narrow(0, real, per_rank - real).fill_(fill);
  return out;
}
}  // namespace

Nf4Shard nf4_shard(const Nf4Tensor& t, int64_t rank, int64_t world) {
  t.validate("nf4 shard input");
  if (rank < 0 || rank >= world)
    throw std::invalid_argument("nf4 shard: rank " + std::to_string(rank) + " outside world " +
                                std::to_string(world));
  const Nf4ShardLayout s = nf4_shard_layout(t.layout, world);
  Nf4Shard out;
  out.codes = padded_slice(t.codes, rank, s.code_bytes(), nf4::kZeroByte);
  out.scalers = padded_slice(t.scalers, rank, s.n_scalers(), 0);
  out.factors = padded_slice(t.factors, rank, s.n_factors(), std::numeric_limits<double>::infinity());
  out.mean = t.mean.clone();
  out.shape = t.shape;
  out.layout = t.layout;
  out.rank = rank;
  out.world = world;
  return out;
}

Nf4Tensor nf4_unshard(const at::Tensor& codes, const at::Tensor& scalers,
                      const at::Tensor& factors, const Nf4Shard& like) {
  const Nf4ShardLayout s = nf4_shard_layout(like.layout, like.world);
  if (codes.numel() != s.code_bytes() * s.world || scalers.numel() != s.n_scalers() * s.world ||
      factors.numel() != s.n_factors() * s.world)
    throw std::invalid_argument("nf4 unshard: gathered buffers do not match " +
                                std::to_string(s.world) + " shards of this tensor");
  Nf4Tensor t;
  t.codes = codes.flatten().narrow(0, 0, like.layout.code_bytes());
  t.scalers = scalers.flatten().narrow(0, 0, like.layout.n_blocks());
  t.factors = factors.flatten().narrow(0, 0, like.layout.n_groups());
  t.mean = like.mean;
  t.shape = like.shape;
  t.layout = like.layout;
  t.validate("nf4 unshard result");
  return t;
}

Nf4Tensor nf4_unshard(const std::vector<Nf4Shard>& shards) {
  if (shards.empty()) throw std::invalid_argument("nf4 unshard: no shards");
  std::vector<at::Tensor> c, s, f;
  for (size_t r = 0; r < shards.size(); ++r) {
    if (shards[r].rank != static_cast<int64_t>(r) ||
        shards[r].world != static_cast<int64_t>(shards.size()))
      throw std::invalid_argument("nf4 unshard: shards must be given in rank order, all of them");
    c.push_back(shards[r].codes);
    s.push_back(shards[r].scalers);
    f.push_back(shards[r].factors);
  }
  return nf4_unshard(at::cat(c), at::cat(s), at::cat(f), shards[0]);
}

}  // namespace qlora
