// One state-dict model for a sharded run, every entry alike whether plain or NF4, sharded or full.
//
//   sharded: each rank's local pieces of every entry, with their place in the full entry (an
//            element offset into its flattened form): nothing moves, any number of ranks can
//            write their own. NF4 entries come as their components (codes, scalers, factors, mean).
//   full:    whole entries on one writer rank only: per shard group one gather to it (all of a
//            group's members and state kinds at once), never a broadcast loop or a barrier per
//            parameter. NF4 entries come as components (exact, as `qlora quantize` stores them) or
//            dequantized to a dtype (for export): saving never fails on an NF4 entry.
// Names: frozen "<group>.<member>" (e.g. "layer3.q_proj.codes", or dequantized
// "layer3.q_proj.weight"); trainable "adapter.<member>", "exp_avg.<member>", "exp_avg_sq.<member>"
// (e.g. "adapter.layer3.q_proj.lora_A").
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qlora/dist/sharded_model.h"
#include "qlora/optim/adamw.h"

namespace qlora::dist {

struct StateEntry {
  std::string name;
  at::Tensor value;                 // a piece (sharded) or the whole entry (full), in its own dtype
  std::vector<int64_t> full_shape;  // the whole entry's shape
  int64_t offset = 0;               // where value starts in the flattened whole entry
};

enum class Nf4As { Components, Dequantized };

// This rank's pieces; `opt` (may be null) adds the AdamW moments beside the adapters.
std::vector<StateEntry> sharded_state_dict(const ShardedLlama& engine, const optim::AdamW* opt, int shard_rank);

// Whole entries on shard rank `root` (empty elsewhere). A collective of the shard group. `model`
// is the sharded model (its NF4 projections are dequantized from the gathered bytes).
std::vector<StateEntry> full_state_dict(ShardedLlama& engine, const models::LlamaModel& model, const optim::AdamW* opt,
                                        Comm& shard_group, int root, Nf4As nf4, at::ScalarType dequant_dtype = at::kBFloat16);

}  // namespace qlora::dist
