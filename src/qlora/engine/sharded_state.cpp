#include "qlora/engine/sharded_state.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace qlora::engine {
namespace {

const at::Tensor& find(const NamedTensors& ts, const std::string& name, size_t rank) {
  for (const auto& [n, t] : ts)
    if (n == name) return t;
  throw std::invalid_argument("sharded resume state of old rank " + std::to_string(rank) + " has no '" + name + "'");
}

// Group g's unpadded vector, joined from every old rank's shard of `kind`.
at::Tensor joined(const std::vector<NamedTensors>& old_ranks, const std::string& kind, size_t g, int64_t used) {
  std::vector<at::Tensor> parts;
  for (size_t r = 0; r < old_ranks.size(); ++r) parts.push_back(find(old_ranks[r], kind + std::to_string(g), r).reshape({-1}));
  at::Tensor all = at::cat(parts);
  if (all.numel() < used)
    throw std::invalid_argument("sharded resume state: " + kind + std::to_string(g) + " holds " +
                                std::to_string(all.numel()) + " values, the model's group needs " + std::to_string(used) +
                                " (a checkpoint of another model or LoRA config?)");
  return all.narrow(0, 0, used);
}

}  // namespace

NamedTensors sharded_train_state(const ShardedLlama& engine, const optim::AdamW& opt) {
  NamedTensors out;
  const auto& shards = engine.param_shards();
  for (size_t g = 0; g < shards.size(); ++g) out.emplace_back("param." + std::to_string(g), shards[g].detach());
  for (const auto& [name, t] : opt.state_dict()) out.emplace_back("optim." + name, t);
  return out;
}

void load_sharded_train_state(ShardedLlama& engine, optim::AdamW& opt, const std::vector<NamedTensors>& old_ranks) {
  if (old_ranks.empty()) throw std::invalid_argument("sharded resume state: no ranks");
  const size_t groups = engine.param_shards().size();
  std::vector<at::Tensor> params;
  NamedTensors ostate;
  for (size_t g = 0; g < groups; ++g) {
    const int64_t used = engine.trainable_layout(g).used();
    params.push_back(joined(old_ranks, "param.", g, used));
    ostate.emplace_back("exp_avg." + std::to_string(g), engine.shard_of_unpadded(g, joined(old_ranks, "optim.exp_avg.", g, used)));
    ostate.emplace_back("exp_avg_sq." + std::to_string(g),
                        engine.shard_of_unpadded(g, joined(old_ranks, "optim.exp_avg_sq.", g, used)));
  }
  ostate.emplace_back("step", find(old_ranks[0], "optim.step", 0));  // the same on every rank
  opt.load_state_dict(ostate);
  engine.load_params(params);
}

}  // namespace qlora::engine
