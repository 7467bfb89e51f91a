#include "qlora/dist/state_dict.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <string>

#include "qlora/dist/sharded_state.h"
#include "qlora/ops/nf4_ops.h"

namespace qlora::dist {
namespace {

// The pieces of a group's members inside [lo, lo + buffer.numel()) of the group's flat buffer.
void pieces(std::vector<StateEntry>& out, const std::string& prefix, const FlatLayout& l, const at::Tensor& buffer,
            int64_t lo) {
  const int64_t hi = lo + buffer.numel();
  for (const FlatMember& m : l.members()) {
    const int64_t b = std::max(lo, m.offset), e = std::min(hi, m.offset + m.units);
    if (b >= e) continue;
    at::Tensor piece = buffer.narrow(0, b - lo, e - b);
    if (l.buffer_dtype() == at::kByte && m.dtype != at::kByte) piece = piece.view(m.dtype);  // aligned: see FlatLayout
    const int64_t unit_bytes = l.buffer_dtype() == at::kByte ? static_cast<int64_t>(c10::elementSize(m.dtype)) : 1;
    out.push_back({prefix + m.name, piece, m.shape, (b - m.offset) / unit_bytes});
  }
}

int64_t unit_of(const std::string& group, int64_t num_layers) {
  if (group == "embed") return -1;
  if (group == "head") return num_layers;
  return std::stoll(group.substr(5));  // "layer<i>"
}

// The frozen tensors of one unit as weights: NF4 projections dequantized, the rest as stored.
void dequantized(std::vector<StateEntry>& out, const models::LlamaModel& m, int64_t unit, const std::string& group,
                 at::ScalarType dtype) {
  auto add = [&](const std::string& name, const at::Tensor& t) {
    out.push_back({group + "." + name, t.clone(), t.sizes().vec(), 0});
  };
  auto proj = [&](const std::string& name, const modules::LoraLinear& l) {
    add(name + ".weight", l.base_nf4.defined() ? ops::nf4_dequantize(l.base_nf4, dtype) : l.base_dense);
  };
  if (unit == -1) return add("embed_tokens", m.embed_tokens);
  if (unit == static_cast<int64_t>(m.layers.size())) {
    add("norm", m.norm);
    if (m.lm_head.base_dense.defined() && m.lm_head.base_dense.is_same(m.embed_tokens)) return add("embed_tokens", m.embed_tokens);
    return proj("lm_head", m.lm_head);
  }
  const modules::DecoderLayer& L = m.layers.at(static_cast<size_t>(unit));
  const std::pair<const char*, const modules::LoraLinear*> projs[] = {
      {"q_proj", &L.q_proj},       {"k_proj", &L.k_proj}, {"v_proj", &L.v_proj},    {"o_proj", &L.o_proj},
      {"gate_proj", &L.gate_proj}, {"up_proj", &L.up_proj}, {"down_proj", &L.down_proj}};
  for (const auto& [name, l] : projs) proj(name, *l);
  add("input_layernorm", L.input_layernorm);
  add("post_attention_layernorm", L.post_attention_layernorm);
}

std::vector<std::pair<std::string, at::Tensor>> kinds_of(const ShardedLlama& engine, const optim::AdamW* opt, size_t g,
                                                         const std::map<std::string, at::Tensor>& st) {
  std::vector<std::pair<std::string, at::Tensor>> k = {{"adapter", engine.param_shards()[g].detach()}};
  if (opt) {
    k.emplace_back("exp_avg", st.at("exp_avg." + std::to_string(g)));
    k.emplace_back("exp_avg_sq", st.at("exp_avg_sq." + std::to_string(g)));
  }
  return k;
}

}  // namespace

std::vector<StateEntry> sharded_state_dict(const ShardedLlama& engine, const optim::AdamW* opt, int shard_rank) {
  std::vector<StateEntry> out;
  for (const auto& fg : engine.frozen_groups())
    pieces(out, fg.name + ".", *fg.layout, fg.shard, shard_rank * fg.layout->shard_numel());
  std::map<std::string, at::Tensor> st;
  if (opt)
    for (const auto& [name, t] : opt->state_dict()) st[name] = t;
  for (size_t g = 0; g < engine.param_shards().size(); ++g) {
    const FlatLayout& l = engine.trainable_layout(g);
    for (const auto& [kind, t] : kinds_of(engine, opt, g, st)) pieces(out, kind + ".", l, t, shard_rank * l.shard_numel());
  }
  return out;
}

std::vector<StateEntry> full_state_dict(ShardedLlama& engine, const models::LlamaModel& model, const optim::AdamW* opt,
                                        Comm& comm, int root, Nf4As nf4, at::ScalarType dequant_dtype) {
  const bool me = comm.rank() == root;
  std::vector<StateEntry> out;
  const int64_t layers = static_cast<int64_t>(model.layers.size());
  for (const auto& fg : engine.frozen_groups()) {
    const int64_t unit = unit_of(fg.name, layers);
    wait(engine.gather_unit_to(unit, root));
    if (!me) continue;
    if (nf4 == Nf4As::Components) {
      for (const FlatMember& m : fg.layout->members())
        out.push_back({fg.name + "." + m.name, fg.layout->view(fg.full, m).clone(), m.shape, 0});
    } else {
      dequantized(out, model, unit, fg.name, dequant_dtype);
    }
    engine.release_unit(unit);
  }
  std::map<std::string, at::Tensor> st;
  if (opt)
    for (const auto& [name, t] : opt->state_dict()) st[name] = t;
  std::vector<std::vector<at::Tensor>> shards;
  std::vector<int64_t> used;
  std::vector<std::vector<std::string>> kind_names;
  for (size_t g = 0; g < engine.param_shards().size(); ++g) {
    shards.emplace_back();
    kind_names.emplace_back();
    for (const auto& [kind, t] : kinds_of(engine, opt, g, st)) {
      shards.back().push_back(t);
      kind_names.back().push_back(kind);
    }
    used.push_back(engine.trainable_layout(g).used());
  }
  const auto full = gather_groups_to(comm, root, shards, used);
  for (size_t g = 0; me && g < full.size(); ++g)
    for (size_t k = 0; k < full[g].size(); ++k)
      for (const FlatMember& m : engine.trainable_layout(g).members())
        out.push_back({kind_names[g][k] + "." + m.name, full[g][k].narrow(0, m.offset, m.units).view(m.shape).clone(),
                       m.shape, 0});
  return out;
}

}  // namespace qlora::dist
