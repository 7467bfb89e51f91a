// The per-epoch export of a sharded run, written by several ranks at once: the same epoch_<N>/
// directory as checkpoint::export_epoch (PEFT adapter + merged HF safetensors + index + config +
// tokenizer files), byte for byte. Within one shard group (replicas hold the same and stay idle),
// each unit (embedding, layer, head) has an owner rank; its NF4 group is gathered to the owner
// only, which merges that unit's tensors and writes them in place into the shard files rank 0
// created with their headers; rank 0 writes the adapter, the index and the copied files and
// commits the directory once every rank's part is durable.
#pragma once

#include <cstdint>
#include <string>

#include "qlora/checkpoint/export.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"

namespace qlora::engine {

void export_epoch_sharded(const std::string& output_dir, int64_t epoch, const models::LlamaModel& model,
                          ShardedLlama& engine, World& world, const checkpoint::AdapterInfo& info, bool adapter_only,
                          const std::string& base_checkpoint_dir, checkpoint::MergeSource source,
                          const std::string& tokenizer_path);

}  // namespace qlora::engine
