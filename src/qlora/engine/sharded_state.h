// The train state of the engine, saved and restored on any number of ranks: each rank's flat
// adapter and AdamW shards go into its part of the resume checkpoint, and on the way back every
// old rank's pieces are joined into each group's unpadded vector and cut again for this mesh, so
// 1 -> N, 4 -> 2, 2 -> 3 or HSDP <-> full sharding all resume. A checkpoint of the earlier
// single-process format (per-adapter names) is converted on the way in.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "qlora/checkpoint/resume.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/optim/adamw.h"

namespace qlora::engine {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// param.<g>, optim.exp_avg.<g>, optim.exp_avg_sq.<g> (this rank's shards of trainable group g)
// and optim.step. `opt` must be the AdamW over engine.param_shards().
NamedTensors train_state(const ShardedDecoder& engine, const optim::AdamW& opt);

// Restores from the states every rank of the old run saved (ckpt.ranks[k] = rank k's tensors):
// the adapters are set and gathered into the model on every rank, the optimizer gets this rank's
// new shards. `model` names the adapters of a legacy single-process checkpoint. Errors name
// `where` (the checkpoint) and the missing tensor, or the group whose size does not match.
void load_train_state(ShardedDecoder& engine, optim::AdamW& opt, const checkpoint::ResumeCheckpoint& ckpt,
                      const models::DecoderModel& model, const std::string& where);

// A checkpoint written with node-local output dirs holds only its node's ranks' files
// (ckpt.ranks_here): fills in every other rank's tensors from the ranks that hold them, so every
// rank ends with the whole checkpoint, as one shared directory gives it. The job must have the
// checkpoint's world size, each rank holding its own file (the caller checks the layout).
// Collective over world (on `device`: NCCL moves CUDA tensors only). Nothing to do without ranks_here.
void share_rank_states(World& world, checkpoint::ResumeCheckpoint& ckpt, c10::Device device);

}  // namespace qlora::engine
