// The per-epoch export of the engine, on 1..N ranks: checkpoint::export_epoch with the ranks as
// its writers. Within one shard group (replicas hold the same and stay idle) each unit
// (embedding, layer, head) has an owner rank; its NF4 group is gathered to the owner only, which
// merges that unit's tensors and writes them in place into the shard files writer 0 created; rank
// 0 writes the adapter and commits the directory once every rank's part is durable. The files are
// byte-identical to one process's. before_commit: see checkpoint::ExportRanks (rank 0 runs it).
// in_lead_dir[r]: whether rank r sees rank 0's output_dir (node-local output dirs: the export is
// written there only, so only those ranks own units: the others' weights are gathered to them, a
// unit at a time). Empty: every rank sees it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qlora/checkpoint/export.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"

namespace qlora::engine {

void export_epoch(const std::string& output_dir, int64_t epoch, const models::DecoderModel& model, ShardedDecoder& engine,
                  World& world, const checkpoint::AdapterInfo& info, bool adapter_only,
                  const std::string& base_checkpoint_dir, checkpoint::MergeSource source,
                  const std::string& tokenizer_path,
                  std::function<void(const std::string& dir)> before_commit = {},
                  const std::vector<bool>& in_lead_dir = {});

}  // namespace qlora::engine
