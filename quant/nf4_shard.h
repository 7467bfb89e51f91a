// Sharding an NF4 tensor over W ranks so that an all-gather (concatenation of every rank's
// buffers in rank order) restores it exactly, for any W and any shape.
//
// Shards are whole double-quantization groups of the flat (row-major, dim 0 outermost)
// tensor: each rank holds groups_per_rank = ceil(n_groups / W) groups of codes, scalers and
// factors; ranks past the end hold padding groups (codes kZeroByte, scalers 0, factor +inf,
// i.e. what quantizing zeros gives), so every rank's buffers have the same size. torchao
// instead requires numel % (64 * 256 * W) == 0 and refuses other shapes.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "quant/nf4_tensor.h"

namespace qlora {

struct Nf4ShardLayout {
  int64_t world = 1;
  int64_t groups_per_rank = 0;
  int64_t group_numel = 0;
  int64_t scaler_block_size = 0;
  int64_t code_bytes() const { return groups_per_rank * group_numel / 2; }
  int64_t n_scalers() const { return groups_per_rank * scaler_block_size; }
  int64_t n_factors() const { return groups_per_rank; }
};
Nf4ShardLayout nf4_shard_layout(const nf4::Layout& layout, int64_t world);

// One rank's piece. mean, shape and layout describe the whole tensor (replicated).
struct Nf4Shard {
  at::Tensor codes, scalers, factors;  // this rank's groups, padded
  at::Tensor mean;
  std::vector<int64_t> shape;
  nf4::Layout layout;
  int64_t rank = 0, world = 1;
};

// A copy of rank's piece of t (any device).
Nf4Shard nf4_shard(const Nf4Tensor& t, int64_t rank, int64_t world);

// The tensor from the concatenation, in rank order, of every rank's codes, scalers and factors
// (views into the given buffers: no copy). Throws if sizes do not match shape and world.
Nf4Tensor nf4_unshard(const at::Tensor& codes, const at::Tensor& scalers,
                      const at::Tensor& factors, const Nf4Shard& any_shard);

// Convenience: every rank's shard concatenated and unsharded (what an all-gather then does).
Nf4Tensor nf4_unshard(const std::vector<Nf4Shard>& shards);

}  // namespace qlora
