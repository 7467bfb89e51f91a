#include "qlora/engine/sharded_export.h"

#include <chrono>
#include <filesystem>
#include <map>
#include <vector>

#include "qlora/checkpoint/resume.h"
#include "qlora/io/safetensors.h"

namespace fs = std::filesystem;

namespace qlora::engine {

void export_epoch_sharded(const std::string& output_dir, int64_t epoch, const models::LlamaModel& model,
                          ShardedLlama& engine, World& world, const checkpoint::AdapterInfo& info, bool adapter_only,
                          const std::string& base_checkpoint_dir, checkpoint::MergeSource source,
                          const std::string& tokenizer_path) {
  const fs::path final_dir = fs::path(output_dir) / ("epoch_" + std::to_string(epoch));
  const fs::path tmp = final_dir.string() + ".tmp";
  // Writing may outlast any collective timeout; liveness is the heartbeat's job.
  const auto patient = std::chrono::hours(24);
  if (world.rank() == 0) {
    fs::create_directories(output_dir);
    fs::remove_all(tmp);  // an export that crashed: incomplete by construction
    fs::create_directories(tmp);
    checkpoint::write_peft_adapter((tmp / "adapter").string(), model.lora_parameters(), info);
  }
  world.world().barrier(patient);
  if (!adapter_only && world.replica().rank() == 0) {
    Comm& c = world.shard();
    const checkpoint::MergedModelWriter w(tmp.string(), model, base_checkpoint_dir, source);
    if (c.rank() == 0) w.create_files();
    c.barrier(patient);
    std::map<int64_t, std::vector<size_t>> entries_of;  // unit -> its entries
    for (size_t i = 0; i < w.num_entries(); ++i) entries_of[w.unit_of(i)].push_back(i);
    std::vector<int64_t> units;
    for (const auto& [u, e] : entries_of) units.push_back(u);
    // Rounds of one unit per rank: every rank merges and writes its own at the same time.
    for (size_t first = 0; first < units.size(); first += static_cast<size_t>(c.size())) {
      std::vector<std::pair<int64_t, WorkPtr>> round;
      for (size_t k = first; k < units.size() && k < first + static_cast<size_t>(c.size()); ++k) {
        const int owner = static_cast<int>(k % static_cast<size_t>(c.size()));
        round.emplace_back(owner == c.rank() ? units[k] : INT64_MIN, engine.gather_unit_to(units[k], owner));
      }
      for (auto& [mine, work] : round) {
        wait(work);
        if (mine == INT64_MIN) continue;
        for (size_t i : entries_of[mine]) w.write_entry(i);
        engine.release_unit(mine);
      }
    }
    w.sync_written();
    c.barrier(patient);  // every entry is durable
    if (c.rank() == 0) w.write_extras(tokenizer_path);
  }
  world.world().barrier(patient);
  if (world.rank() == 0) {
    io::fsync_path(tmp.string());
    checkpoint::commit_directory(tmp.string(), final_dir.string());
  }
  world.world().barrier(patient);
}

}  // namespace qlora::engine
