// A rank's part of a sharded resume checkpoint (its flat adapter and AdamW shards), and the way
// back on any number of ranks: every old rank's pieces are joined into each group's unpadded
// vector and cut again for the new mesh, so 4 -> 2, 2 -> 3 or HSDP <-> full sharding all resume.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "qlora/engine/sharded_model.h"
#include "qlora/optim/adamw.h"

namespace qlora::engine {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// param.<g>, optim.exp_avg.<g>, optim.exp_avg_sq.<g> (this rank's shards of trainable group g)
// and optim.step. `opt` must be the AdamW over engine.param_shards().
NamedTensors sharded_train_state(const ShardedLlama& engine, const optim::AdamW& opt);

// Restores from the states every rank of the old run saved (old_ranks[k] = rank k's tensors):
// the adapters are set and gathered into the model on every rank, the optimizer gets this rank's
// new shards. Errors name the missing tensor or the group whose size does not match the model.
void load_sharded_train_state(ShardedLlama& engine, optim::AdamW& opt, const std::vector<NamedTensors>& old_ranks);

}  // namespace qlora::engine
