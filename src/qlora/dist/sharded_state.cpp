#include "qlora/dist/sharded_state.h"

#include <ATen/ATen.h>

#include <map>
#include <stdexcept>

namespace qlora::dist {
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

std::vector<std::vector<at::Tensor>> gather_groups_to(Comm& comm, int root,
                                                      const std::vector<std::vector<at::Tensor>>& shards,
                                                      const std::vector<int64_t>& used) {
  const bool me = comm.rank() == root;
  std::vector<at::Tensor> outs;
  std::vector<WorkPtr> works;
  for (size_t g = 0; g < shards.size(); ++g) {
    const at::Tensor in = at::cat(shards[g]);  // [kinds * S]: every kind of this rank's shard
    at::Tensor out = me ? at::empty({in.numel() * comm.size()}, in.options()) : at::empty({0}, in.options());
    works.push_back(comm.gather_to(root, out, in));
    outs.push_back(out);
  }
  for (auto& w : works) wait(w);
  std::vector<std::vector<at::Tensor>> full(me ? shards.size() : 0);
  for (size_t g = 0; me && g < shards.size(); ++g) {
    const int64_t kinds = static_cast<int64_t>(shards[g].size()), s = shards[g][0].numel();
    // [rank][kind][S] -> per kind [rank * S], then the padding cut off.
    const at::Tensor byk = outs[g].view({comm.size(), kinds, s}).transpose(0, 1).reshape({kinds, -1});
    for (int64_t k = 0; k < kinds; ++k) full[g].push_back(byk[k].narrow(0, 0, used[g]).clone());
  }
  return full;
}

std::vector<std::vector<at::Tensor>> gather_full_train_state(ShardedLlama& engine, const optim::AdamW& opt,
                                                             Comm& comm, int root) {
  std::map<std::string, at::Tensor> st;
  for (const auto& [name, t] : opt.state_dict()) st[name] = t;
  std::vector<std::vector<at::Tensor>> shards;
  std::vector<int64_t> used;
  for (size_t g = 0; g < engine.param_shards().size(); ++g) {
    const std::string i = std::to_string(g);
    shards.push_back({engine.param_shards()[g].detach(), st.at("exp_avg." + i), st.at("exp_avg_sq." + i)});
    used.push_back(engine.trainable_layout(g).used());
  }
  return gather_groups_to(comm, root, shards, used);
}

}  // namespace qlora::dist
