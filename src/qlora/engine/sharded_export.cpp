#include "qlora/engine/sharded_export.h"

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

namespace qlora::engine {

void export_epoch(const std::string& output_dir, int64_t epoch, const models::DecoderModel& model, ShardedDecoder& engine,
                  World& world, const checkpoint::AdapterInfo& info, bool adapter_only,
                  const std::string& base_checkpoint_dir, checkpoint::MergeSource source,
                  const std::string& tokenizer_path, std::function<void(const std::string& dir)> before_commit,
                  const std::vector<bool>& in_lead_dir) {
  // Writing may outlast any collective timeout; liveness is the heartbeat's job.
  const auto patient = std::chrono::hours(24);
  Comm& c = world.shard();
  checkpoint::ExportRanks ranks;
  ranks.lead = world.rank() == 0;
  ranks.writes_model = world.replica().rank() == 0;
  ranks.writer = c.rank();
  ranks.barrier = [&] { world.world().barrier(patient); };
  ranks.writers_barrier = [&] { c.barrier(patient); };
  ranks.before_commit = std::move(before_commit);
  // The shard group's ranks that may own units: those that see rank 0's output_dir.
  std::vector<int> owners;
  for (int k = 0; k < c.size(); ++k)
    if (in_lead_dir.empty() || in_lead_dir.at(static_cast<size_t>(c.global_ranks()[static_cast<size_t>(k)])))
      owners.push_back(k);
  // Rounds of one unit per owner: every owner merges and writes its own at the same time.
  ranks.for_my_units = [&](const std::vector<int64_t>& units, const std::function<void(int64_t)>& write) {
    const size_t n = owners.size();
    for (size_t first = 0; first < units.size(); first += n) {
      std::vector<std::pair<int64_t, WorkPtr>> round;
      for (size_t k = first; k < units.size() && k < first + n; ++k) {
        const int owner = owners[k % n];
        round.emplace_back(owner == c.rank() ? units[k] : INT64_MIN, engine.gather_unit_to(units[k], owner));
      }
      for (auto& [mine, work] : round) {
        wait(work);
        if (mine == INT64_MIN) continue;
        write(mine);
        engine.release_unit(mine);
      }
    }
  };
  // A trained tower's merged linears read their bases: gathered on every rank (a tower is small).
  const bool tower = !adapter_only && model.tower && !models::vision::adapted_modules(*model.tower).empty();
  if (tower) engine.unshard_tower();
  checkpoint::export_epoch(output_dir, epoch, model, info, adapter_only, base_checkpoint_dir, source, tokenizer_path,
                           ranks);
  if (tower) engine.reshard_tower();
}

}  // namespace qlora::engine
