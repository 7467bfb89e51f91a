#include "qlora/engine/sharded_state.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "qlora/checkpoint/xxh64.h"

namespace qlora::engine {
namespace {

const at::Tensor& find(const NamedTensors& ts, const std::string& name, size_t rank) {
  for (const auto& [n, t] : ts)
    if (n == name) return t;
  throw std::invalid_argument("the state of old rank " + std::to_string(rank) + " has no '" + name + "'");
}

// The single-process format of earlier releases named each adapter (model.<PEFT name>) and kept
// AdamW per adapter (optim.exp_avg.<i>, in lora_parameters() order): the same values as one
// rank's flat groups, in the same order. Returns them as rank 0 of 1 of today's format.
NamedTensors from_legacy(const ShardedDecoder& engine, const models::DecoderModel& model, const NamedTensors& old) {
  const auto lora = model.lora_parameters();
  std::vector<at::Tensor> params, avg, avg_sq;
  for (size_t i = 0; i < lora.size(); ++i) {
    params.push_back(find(old, "model." + lora[i].first, 0).reshape({-1}));
    avg.push_back(find(old, "optim.exp_avg." + std::to_string(i), 0).reshape({-1}));
    avg_sq.push_back(find(old, "optim.exp_avg_sq." + std::to_string(i), 0).reshape({-1}));
  }
  const at::Tensor all_p = at::cat(params), all_m = at::cat(avg), all_v = at::cat(avg_sq);
  const at::Tensor steps = find(old, "optim.step", 0);
  if (steps.numel() == 0 || !at::equal(steps, at::full_like(steps, steps[0].item<int64_t>())))
    throw std::invalid_argument("optim.step differs between adapters: not a checkpoint this recipe wrote");
  const size_t groups = engine.param_shards().size();
  NamedTensors out;
  int64_t at_ = 0;
  for (size_t g = 0; g < groups; ++g) {
    const int64_t n = engine.trainable_layout(g).used();
    if (at_ + n > all_p.numel()) break;
    const std::string i = std::to_string(g);
    out.emplace_back("param." + i, all_p.narrow(0, at_, n));
    out.emplace_back("optim.exp_avg." + i, all_m.narrow(0, at_, n));
    out.emplace_back("optim.exp_avg_sq." + i, all_v.narrow(0, at_, n));
    at_ += n;
  }
  if (at_ != all_p.numel() || out.size() != 3 * groups)
    throw std::invalid_argument("its adapters hold " + std::to_string(all_p.numel()) + " values, the model's " +
                                std::to_string(at_) + " (a checkpoint of another model or LoRA config?)");
  out.emplace_back("optim.step", at::full({static_cast<int64_t>(groups)}, steps[0].item<int64_t>(), at::kLong));
  return out;
}

// Group g's unpadded vector, joined from every old rank's shard of `kind`.
at::Tensor joined(const std::vector<NamedTensors>& old_ranks, const std::string& kind, size_t g, int64_t used) {
  std::vector<at::Tensor> parts;
  for (size_t r = 0; r < old_ranks.size(); ++r) parts.push_back(find(old_ranks[r], kind + std::to_string(g), r).reshape({-1}));
  at::Tensor all = at::cat(parts);
  if (all.numel() < used)
    throw std::invalid_argument(kind + std::to_string(g) + " holds " +
                                std::to_string(all.numel()) + " values, the model's group needs " + std::to_string(used) +
                                " (a checkpoint of another model or LoRA config?)");
  return all.narrow(0, 0, used);
}

}  // namespace

NamedTensors train_state(const ShardedDecoder& engine, const optim::AdamW& opt) {
  NamedTensors out;
  const auto& shards = engine.param_shards();
  for (size_t g = 0; g < shards.size(); ++g) out.emplace_back("param." + std::to_string(g), shards[g].detach());
  for (const auto& [name, t] : opt.state_dict()) out.emplace_back("optim." + name, t);
  return out;
}

void load_train_state(ShardedDecoder& engine, optim::AdamW& opt, const checkpoint::ResumeCheckpoint& ckpt,
                      const models::DecoderModel& model, const std::string& where) {
  try {
    if (ckpt.ranks.empty()) throw std::invalid_argument("no ranks");
    const std::vector<NamedTensors> old_ranks =
        ckpt.legacy_single_process ? std::vector<NamedTensors>{from_legacy(engine, model, ckpt.ranks[0])} : ckpt.ranks;
    const size_t groups = engine.param_shards().size();
    std::vector<at::Tensor> params;
    NamedTensors ostate;
    for (size_t g = 0; g < groups; ++g) {
      const int64_t used = engine.trainable_layout(g).used();
      const std::string i = std::to_string(g);
      params.push_back(joined(old_ranks, "param.", g, used));
      ostate.emplace_back("exp_avg." + i, engine.shard_of_unpadded(g, joined(old_ranks, "optim.exp_avg.", g, used)));
      ostate.emplace_back("exp_avg_sq." + i, engine.shard_of_unpadded(g, joined(old_ranks, "optim.exp_avg_sq.", g, used)));
    }
    ostate.emplace_back("step", find(old_ranks[0], "optim.step", 0));  // the same on every rank
    opt.load_state_dict(ostate);
    engine.load_params(params);
  } catch (const std::exception& e) {
    throw std::invalid_argument("cannot resume " + where + ": " + e.what());
  }
}

void share_rank_states(World& world, checkpoint::ResumeCheckpoint& ckpt, c10::Device device) {
  if (ckpt.ranks_here.empty()) return;
  const NamedTensors& mine = ckpt.ranks.at(static_cast<size_t>(world.rank()));
  // Every rank's state has the same tensors (train_state and the RNG states): checked before any
  // moves, by their count, then each one's name (hashed), dtype and size.
  const auto same_everywhere = [&](const std::vector<int64_t>& v, const char* what) {
    const at::Tensor own = at::tensor(v, at::kLong).to(device);
    at::Tensor all = at::empty({world.size() * own.numel()}, own.options());
    wait(world.world().all_gather(all, own));
    if (!at::equal(all.view({world.size(), -1}), own.expand({world.size(), own.numel()})))
      throw std::invalid_argument(std::string("the nodes' resume checkpoints hold different ") + what +
                                  " (checkpoints of different runs?)");
  };
  same_everywhere({static_cast<int64_t>(mine.size())}, "numbers of tensors");
  std::vector<int64_t> signature;
  for (const auto& [name, t] : mine) {
    signature.push_back(static_cast<int64_t>(checkpoint::xxh64(name.data(), name.size())));
    signature.push_back(static_cast<int64_t>(t.scalar_type()));
    signature.push_back(t.numel());
  }
  same_everywhere(signature, "tensors (names, dtypes or sizes)");
  std::vector<NamedTensors> ranks(static_cast<size_t>(world.size()));
  for (const auto& [name, t] : mine) {
    const at::Tensor in = t.contiguous().view({-1}).to(device);
    at::Tensor out = at::empty({world.size() * in.numel()}, in.options());
    wait(world.world().all_gather(out, in));
    const at::Tensor gathered = out.cpu().view({world.size(), -1});
    for (int r = 0; r < world.size(); ++r) ranks[static_cast<size_t>(r)].emplace_back(name, gathered[r].view(t.sizes()).clone());
  }
  ckpt.ranks = std::move(ranks);
  ckpt.ranks_here.clear();
}

}  // namespace qlora::engine
