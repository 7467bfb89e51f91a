#include "qlora/engine/sharded_model.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "qlora/models/architecture.h"
#include "qlora/optim/adamw.h"

namespace qlora::engine {

using Setter = std::function<void(const at::Tensor&)>;

struct ShardedDecoder::FrozenGroup {
  std::string name;
  FlatLayout layout{at::kByte, 1};
  std::vector<Setter> rebind;  // per member, while sharding: point the model's tensor at its alias
  at::Tensor full;             // [padded] bytes; its storage exists only while gathered
  at::Tensor shard;            // this rank's [padded / shards] bytes, owned
  bool gathered = false;
  WorkPtr pending;
  int64_t bf16_bytes = 0;  // the members as bf16 weights would weigh
  bool tower = false;      // a vision tower's
};

// The tower's calls (vision::Tower::hooks) on its own units.
struct ShardedDecoder::TowerHooks : models::UnitHooks {
  std::shared_ptr<ShardedDecoder> e;
  explicit TowerHooks(std::shared_ptr<ShardedDecoder> engine) : e(std::move(engine)) {}
  void before_forward(int64_t unit, bool recompute) override { e->forward_begin(e->tower_, unit, recompute); }
  void after_forward(int64_t unit, bool recompute) override { e->forward_end(e->tower_, unit, recompute); }
  void before_backward(int64_t unit) override {
    if (unit == e->tower_.layers && e->tower_backwards_due_ > 0) --e->tower_backwards_due_;  // this one runs
    e->backward_begin(e->tower_, unit);
  }
  void after_backward(int64_t unit) override { e->backward_end(e->tower_, unit); }
};

struct ShardedDecoder::TrainGroup {
  FlatLayout layout{at::kFloat, 1};
  at::Tensor full_param, full_grad;  // [padded] fp32; the adapters and their .grad are views
  at::Tensor grad_shard, rs_out;     // [padded / shards]
  size_t shard_index = 0;            // into param_shards_
  int64_t expected = 0, arrived = 0;
  bool late = false;  // reduced by finish_backward, whether or not its gradients arrived (add_tower)
  WorkPtr rs, ar;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // keeps the hooks' nodes alive
};

namespace {

// Releases / re-creates the memory behind `full` without replacing its StorageImpl, so every view
// of it (the model's tensors, tensors saved by autograd) stays valid across a reshard and regather.
void free_storage(const at::Tensor& full) {
  c10::StorageImpl* s = full.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, full.device()));
  s->set_nbytes(0);
}

void alloc_storage(const at::Tensor& full) {
  c10::StorageImpl* s = full.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(full.numel()) * full.element_size();
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

// A tensor over member `m`'s bytes of `full` with a version counter of its own. Autograd saves
// frozen weights (norms, NF4 buffers) for backward and checks their version there; a plain view
// would share `full`'s counter, which every regather bumps, and backward would refuse.
at::Tensor alias(const at::Tensor& full, const FlatMember& m) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(m.dtype));
  const int64_t byte_offset = m.offset * static_cast<int64_t>(full.element_size());
  at::Tensor t = at::empty({0}, full.options().dtype(m.dtype));
  t.set_(full.storage(), byte_offset / elem, m.shape, c10::contiguous_strides(m.shape));
  return t;
}

struct GradReadyHook : torch::autograd::FunctionPostHook {
  std::function<void()> fn;
  explicit GradReadyHook(std::function<void()> f) : fn(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn();
    return outputs;
  }
};

struct Member {
  std::string name;
  at::Tensor value;
  Setter set;
};

void add_nf4(std::vector<Member>& out, const std::string& stem, Nf4Tensor& w) {
  out.push_back({stem + ".codes", w.codes, [&w](const at::Tensor& v) { w.codes = v; }});
  out.push_back({stem + ".scalers", w.scalers, [&w](const at::Tensor& v) { w.scalers = v; }});
  out.push_back({stem + ".factors", w.factors, [&w](const at::Tensor& v) { w.factors = v; }});
  out.push_back({stem + ".mean", w.mean, [&w](const at::Tensor& v) { w.mean = v; }});
}

void add_dense(std::vector<Member>& out, const std::string& name, at::Tensor& t) {
  out.push_back({name, t, [&t](const at::Tensor& v) { t = v; }});
}

void add_nf4(std::vector<Member>& out, const std::string& stem, modules::LoraLinear& l) {
  if (l.base_nf4.defined()) add_nf4(out, stem, l.base_nf4);
  else add_dense(out, stem + ".weight", l.base_dense);
}

// A MoE layer's router and each expert's weights ("experts.3.gate_up_proj.codes", ...).
void add_experts(std::vector<Member>& out, modules::DecoderLayer& L) {
  if (!L.is_moe()) return;
  add_dense(out, "mlp.gate", L.router);
  modules::Experts& ex = L.experts;
  // gpt-oss's biases: the router's and the experts'.
  if (L.router_bias.defined()) add_dense(out, "mlp.gate.bias", L.router_bias);
  if (ex.gate_up_bias.defined()) add_dense(out, "experts.gate_up_proj_bias", ex.gate_up_bias);
  if (ex.down_bias.defined()) add_dense(out, "experts.down_proj_bias", ex.down_bias);
  for (int64_t e = 0; e < ex.num_experts; ++e) {
    const std::string stem = "experts." + std::to_string(e) + ".";
    const auto i = static_cast<size_t>(e);
    if (ex.nf4()) {
      add_nf4(out, stem + "gate_up_proj", ex.gate_up_nf4[i]);
      add_nf4(out, stem + "down_proj", ex.down_nf4[i]);
    } else {
      add_dense(out, stem + "gate_up_proj.weight", ex.gate_up_dense[i]);
      add_dense(out, stem + "down_proj.weight", ex.down_dense[i]);
    }
  }
}

// What a member would weigh as bf16 weights: NF4 codes hold two weights a byte; scalers,
// factors and means are NF4 overhead that bf16 would not have; anything else is a weight.
int64_t bf16_bytes_of(const Member& mb) {
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return mb.name.size() >= s.size() && mb.name.compare(mb.name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with(".codes")) return mb.value.numel() * 2 * 2;
  if (ends_with(".scalers") || ends_with(".factors") || ends_with(".mean")) return 0;
  return mb.value.numel() * 2;
}

}  // namespace

ShardedDecoder::ShardedDecoder(World& world, ShardingOptions options) : world_(world), opt_(options) {}

ShardedDecoder::~ShardedDecoder() = default;

namespace {

// Packs `members` into a new group's full buffer, points the model's tensors at their aliases of
// it, keeps this rank's shard and releases the full buffer.
std::unique_ptr<ShardedDecoder::FrozenGroup> make_frozen(const std::string& name, const std::vector<Member>& members,
                                                       int64_t shards, int64_t me, at::Device dev);

}  // namespace

std::shared_ptr<ShardedDecoder> ShardedDecoder::begin(World& world, ShardingOptions options) {
  std::shared_ptr<ShardedDecoder> self(new ShardedDecoder(world, options));
  self->frozen_.resize(1);  // the embedding's slot; layers append theirs
  return self;
}

std::shared_ptr<ShardedDecoder> ShardedDecoder::shard(models::DecoderModel& m, World& world, ShardingOptions options) {
  auto self = begin(world, options);
  for (size_t i = 0; i < m.layers.size(); ++i) self->shard_layer(static_cast<int64_t>(i), m.layers[i], m.architecture());
  self->finish(m);
  return self;
}

void ShardedDecoder::shard_layer(int64_t index, modules::DecoderLayer& L, const models::Architecture& arch) {
  if (index != num_layers_)
    throw std::invalid_argument("ShardedDecoder::shard_layer: layer " + std::to_string(index) + " out of order (expected " +
                                std::to_string(num_layers_) + ")");
  const int64_t n = world_.shard().size(), me = world_.shard().rank();
  std::vector<Member> ms;
  std::vector<modules::LoraLinear*> projs;
  std::vector<std::string> stems;
  // What this layer holds (a Qwen3.5 layer holds its mixer's rows only), read right after loading.
  for (const models::ProjectionRow& row : arch.projections) {
    if (!row.member || (L.*row.member).out_features == 0) continue;
    add_nf4(ms, row.peft_name, L.*row.member);
    modules::LoraLinear& l = L.*row.member;
    if (l.bias.defined()) ms.push_back({std::string(row.peft_name) + ".bias", l.bias, [&l](const at::Tensor& v) { l.bias = v; }});
    projs.push_back(&(L.*row.member));
    stems.push_back("layer" + std::to_string(index) + "." + row.peft_name);
  }
  for (const models::NormRow& nr : arch.layer_norms) {
    at::Tensor modules::DecoderLayer::*member = nr.member;
    if (!(L.*member).defined()) continue;
    ms.push_back({nr.name, L.*member, [&L, member](const at::Tensor& v) { L.*member = v; }});
  }
  add_experts(ms, L);
  frozen_.push_back(make_frozen("layer" + std::to_string(index), ms, n, me, L.post_attention_layernorm.device()));
  std::vector<std::pair<at::Tensor*, std::string>> expert_adapters;
  if (L.experts.has_lora()) {
    const std::string stem = "layer" + std::to_string(index) + ".experts.";
    modules::Experts& ex = L.experts;
    expert_adapters = {{&ex.gate_up_a, stem + "gate_up_proj.lora_A"}, {&ex.gate_up_b, stem + "gate_up_proj.lora_B"},
                       {&ex.down_a, stem + "down_proj.lora_A"}, {&ex.down_b, stem + "down_proj.lora_B"}};
  }
  add_trainable(projs, stems, expert_adapters);
  ++num_layers_;
}

void ShardedDecoder::finish(models::DecoderModel& m) {
  if (num_layers_ != static_cast<int64_t>(m.layers.size()))
    throw std::invalid_argument("ShardedDecoder::finish: " + std::to_string(num_layers_) + " of " +
                                std::to_string(m.layers.size()) + " layers were sharded");
  const int64_t n = world_.shard().size(), me = world_.shard().rank();
  const at::Device dev = m.embed_tokens.device();
  // Tied: the head's base is a view of the embedding's storage (lora_linear_dense keeps a detached
  // handle, another TensorImpl, so is_same would never see it): one copy, in the head's group.
  const at::Tensor& hb = m.lm_head.base_dense;
  const bool tied = hb.defined() && hb.is_alias_of(m.embed_tokens) && hb.data_ptr() == m.embed_tokens.data_ptr() &&
                    hb.sizes() == m.embed_tokens.sizes() && hb.strides() == m.embed_tokens.strides();
  const Member embed{"embed_tokens", m.embed_tokens, [&m, tied](const at::Tensor& v) {
                       m.embed_tokens = v;
                       if (tied) m.lm_head.base_dense = v;
                     }};
  // The embedding unit's group (the head's when tied): embed_tokens and what else the unit reads
  // (Gemma 4's per-layer input projection and norm; the table stays in host memory, EmbedRow::host).
  std::vector<Member> embed_unit = {embed};
  if (models::has_embed_rows(m.config)) {
    for (const models::EmbedRow& row : m.architecture().embed_rows) {
      at::Tensor modules::PerLayerInputs::*member = row.member;
      if (!row.host)
        embed_unit.push_back({row.name, m.per_layer_inputs.*member,
                              [&m, member](const at::Tensor& v) { m.per_layer_inputs.*member = v; }});
    }
  }
  if (!tied) frozen_[0] = make_frozen("embed", embed_unit, n, me, dev);
  std::vector<Member> head = {{"norm", m.norm, [&m](const at::Tensor& v) { m.norm = v; }}};
  const char* head_name = models::output_projection(m.architecture()).peft_name;
  if (tied) head.insert(head.end(), embed_unit.begin(), embed_unit.end());
  else add_nf4(head, head_name, m.lm_head);
  frozen_.push_back(make_frozen("head", head, n, me, dev));
  add_trainable({&m.lm_head}, {head_name});
  if (!whole()) m.hooks = shared_from_this();  // a whole model has nothing to gather around its units
}

namespace {

// Which of a tower's units holds tensor `name`: encoder layer i for a name with the component i
// ("model.visual.blocks.3.attn.qkv"); the rest (index `layers`) for one with none.
size_t tower_unit_of(const std::string& name, int64_t layers) {
  for (size_t at = 0, dot; at < name.size(); at = dot + 1) {
    dot = std::min(name.find('.', at), name.size());
    const std::string c = name.substr(at, dot - at);
    if (c.empty() || c.find_first_not_of("0123456789") != std::string::npos) continue;
    if (c.size() > 9 || std::stoll(c) >= layers)
      throw std::invalid_argument("ShardedDecoder::add_tower: " + name + " names encoder layer " + c + ", but the tower has " +
                                  std::to_string(layers));
    return static_cast<size_t>(std::stoll(c));
  }
  return static_cast<size_t>(layers);
}

}  // namespace

void ShardedDecoder::add_tower(models::vision::Tower& tower) {
  if (tower_.layers >= 0) throw std::logic_error("ShardedDecoder::add_tower: the model has a tower already");
  const int64_t n = world_.shard().size(), me = world_.shard().rank(), depth = tower.depth();
  std::vector<std::vector<Member>> units(static_cast<size_t>(depth + 1));  // encoder layers, then the rest
  std::vector<modules::LoraLinear*> linears;
  std::vector<std::string> stems;
  tower_first_adapted_ = depth;
  for (auto& [module, lin] : tower.linears()) {
    const size_t u = tower_unit_of(module, depth);
    add_nf4(units[u], module, *lin);
    if (lin->bias.defined()) add_dense(units[u], module + ".bias", lin->bias);
    if (lin->has_lora()) tower_first_adapted_ = std::min(tower_first_adapted_, static_cast<int64_t>(u));
    linears.push_back(lin);
    stems.push_back(module);
  }
  for (auto& [name, t] : tower.frozen()) add_dense(units[tower_unit_of(name, depth)], name, *t);
  std::vector<std::pair<at::Tensor*, std::string>> projector;
  for (auto& [name, t] : tower.projector()) {
    if (t->requires_grad()) projector.emplace_back(t, name);
    else add_dense(units.back(), name, *t);
  }
  tower_ = {frozen_.size(), depth, true};
  frozen_.emplace_back();  // unit -1 runs on the rest's group (the last)
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].empty())
      throw std::invalid_argument("ShardedDecoder::add_tower: the tower's " +
                                  (u < units.size() - 1 ? "encoder layer " + std::to_string(u) : std::string("rest")) +
                                  " holds no tensor");
    const std::string name = u + 1 < units.size() ? "tower" + std::to_string(u) : std::string("tower");
    frozen_.push_back(make_frozen(name, units[u], n, me, units[u].front().value.device()));
    frozen_.back()->tower = true;
  }
  add_trainable(linears, stems, projector, /*late=*/true);
  if (!whole()) tower.hooks = std::make_shared<TowerHooks>(shared_from_this());
}

int64_t ShardedDecoder::tower_bytes_held() const {
  int64_t bytes = 0;
  for (const auto& g : frozen_)
    if (g && g->tower) bytes += whole() ? g->layout.used() : g->shard.numel();
  return bytes;
}

namespace {

std::unique_ptr<ShardedDecoder::FrozenGroup> make_frozen(const std::string& name, const std::vector<Member>& members,
                                                       int64_t shards, int64_t me, at::Device dev) {
  auto g = std::make_unique<ShardedDecoder::FrozenGroup>();
  g->name = name;
  g->layout = FlatLayout(at::kByte, shards);
  for (const Member& mb : members) {
    g->layout.add(mb.name, mb.value.scalar_type(), mb.value.sizes().vec());
    g->bf16_bytes += bf16_bytes_of(mb);
  }
  // The whole group is this rank's (one rank per shard group): the model's tensors stay where they
  // are, nothing is packed, gathered or released, and memory is exactly that of the tensors.
  if (shards == 1) {
    g->gathered = true;
    return g;
  }
  g->full = g->layout.empty_full(at::TensorOptions().device(dev));
  for (const Member& mb : members) {
    g->layout.pack(g->full, mb.name, mb.value);
    g->rebind.push_back(mb.set);
  }
  const auto& ms = g->layout.members();
  for (size_t k = 0; k < ms.size(); ++k) g->rebind[k](alias(g->full, ms[k]));
  g->rebind.clear();  // they point into the model: not to be called again
  g->shard = g->layout.shard_of(g->full, me).clone();
  free_storage(g->full);
  return g;
}

}  // namespace

void ShardedDecoder::add_trainable(const std::vector<modules::LoraLinear*>& ls, const std::vector<std::string>& stems,
                                   const std::vector<std::pair<at::Tensor*, std::string>>& more, bool late) {
  const int64_t n = world_.shard().size(), me = world_.shard().rank();
  auto g = std::make_unique<TrainGroup>();
  g->late = late;
  g->layout = FlatLayout(at::kFloat, n);
  std::vector<std::pair<at::Tensor*, std::string>> slots;
  for (size_t k = 0; k < ls.size(); ++k) {
    if (!ls[k]->has_lora()) continue;
    slots.push_back({&ls[k]->lora_a, stems[k] + ".lora_A"});
    slots.push_back({&ls[k]->lora_b, stems[k] + ".lora_B"});
    if (ls[k]->has_dora()) slots.push_back({&ls[k]->magnitude, stems[k] + ".lora_magnitude_vector"});
  }
  slots.insert(slots.end(), more.begin(), more.end());
  if (slots.empty()) return;
  for (auto& [t, name] : slots) g->layout.add(name, at::kFloat, t->sizes().vec());
  const auto fopts = at::TensorOptions().device(slots[0].first->device()).dtype(at::kFloat);
  g->full_param = g->layout.empty_full(fopts);
  g->full_grad = g->layout.empty_full(fopts);
  const size_t gi = train_.size();
  for (size_t k = 0; k < slots.size(); ++k) {
    const FlatMember& mb = g->layout.members()[k];
    g->layout.view(g->full_param, mb).copy_(slots[k].first->detach());
    at::Tensor p = g->layout.view(g->full_param, mb).detach().set_requires_grad(true);
    p.mutable_grad() = g->layout.view(g->full_grad, mb);  // accumulate in place, into the flat buffer
    *slots[k].first = p;
    adapters_.push_back(p);
    auto acc = torch::autograd::impl::grad_accumulator(p);
    acc->add_post_hook(std::make_unique<GradReadyHook>([this, gi] { on_grad_ready(gi); }));
    g->accumulators.push_back(std::move(acc));
  }
  g->expected = static_cast<int64_t>(slots.size());
  // A shard group of one rank steps the full buffer itself: no second copy, no collectives.
  at::Tensor ps = n == 1 ? g->full_param : g->layout.shard_of(g->full_param, me).clone();
  g->grad_shard = n == 1 ? g->full_grad : at::zeros_like(ps);
  if (n > 1) g->rs_out = at::empty_like(ps);
  ps.mutable_grad() = g->grad_shard;
  g->shard_index = param_shards_.size();
  param_shards_.push_back(ps);
  train_.push_back(std::move(g));
}

const FlatLayout& ShardedDecoder::trainable_layout(size_t g) const { return train_.at(g)->layout; }

ShardedDecoder::FrozenGroup& ShardedDecoder::group_of(const Units& s, int64_t unit) {
  const auto& slot = frozen_.at(s.first + static_cast<size_t>(unit + 1));
  // A tied embedding lives in the head's group, the tower's unit -1 in its rest's.
  return slot ? *slot : *frozen_.at(s.first + static_cast<size_t>(s.layers + 1));
}

void ShardedDecoder::gather(FrozenGroup& g, bool wait_now) {
  alloc_storage(g.full);
  g.gathered = true;
  stats_.gathers += 1;
  stats_.bytes_gathered += g.full.numel();
  if (g.name.rfind("layer", 0) == 0) {
    stats_.layer_bytes_gathered += g.full.numel();
    stats_.layer_bytes_as_bf16 += g.bf16_bytes;
  }
  if (g.tower) {
    stats_.tower_gathers += 1;
    stats_.tower_bytes_gathered += g.full.numel();
  }
  WorkPtr w = world_.shard().all_gather(g.full, g.shard);
  if (wait_now) wait(w);
  else g.pending = std::move(w);
}

void ShardedDecoder::ensure(FrozenGroup& g) {
  if (!g.gathered) return gather(g, /*wait_now=*/true);
  if (g.pending) {
    WorkPtr w = std::move(g.pending);
    g.pending = {};
    wait(w);
  }
}

void ShardedDecoder::release(FrozenGroup& g) {
  if (!g.gathered || whole()) return;
  ensure(g);  // a collective still writing into the buffer must finish first
  free_storage(g.full);
  g.gathered = false;
}

void ShardedDecoder::prefetch(const Units& s, int64_t unit) {
  if (!opt_.prefetch || unit < -1 || unit > s.layers) return;
  FrozenGroup& g = group_of(s, unit);
  if (!g.gathered) gather(g, /*wait_now=*/false);
}

void ShardedDecoder::forward_begin(const Units& s, int64_t unit, bool recompute) {
  ensure(group_of(s, unit));
  if (!recompute) prefetch(s, unit + 1);
}

void ShardedDecoder::forward_end(const Units& s, int64_t unit, bool recompute) {
  const bool training = at::GradMode::is_enabled();
  if (s.tower && unit == s.layers && training && !train_.empty() && train_.back()->late) ++tower_backwards_due_;
  if (recompute || !opt_.reshard_after_forward || held_) return;
  // Backward starts with the head and the last layer: keep them rather than regather at once. (The
  // tower's backward comes after the decoder's: it gathers again.)
  if (!s.tower && training && unit >= s.layers - 1) return;
  FrozenGroup& g = group_of(s, unit);
  if (unit == -1 && &g == &group_of(s, s.layers)) return;  // tied (the tower's rest): the head needs it next
  release(g);
}

void ShardedDecoder::backward_begin(const Units& s, int64_t unit) {
  ensure(group_of(s, unit));
  // The tower's backward goes down to its first adapted layer only (a trained projector alone: none).
  if (unit > 0 && (!s.tower || unit - 1 >= tower_first_adapted_)) prefetch(s, unit - 1);
}

void ShardedDecoder::backward_end(const Units& s, int64_t unit) {
  if (unit >= 0) release(group_of(s, unit));
}

void ShardedDecoder::before_forward(int64_t unit, bool recompute) { forward_begin(decoder_units(), unit, recompute); }
void ShardedDecoder::after_forward(int64_t unit, bool recompute) { forward_end(decoder_units(), unit, recompute); }
void ShardedDecoder::before_backward(int64_t unit) { backward_begin(decoder_units(), unit); }
void ShardedDecoder::after_backward(int64_t unit) { backward_end(decoder_units(), unit); }

void ShardedDecoder::skip_tower_backwards() {
  for (; tower_backwards_due_ > 0; --tower_backwards_due_) {
    backward_begin(tower_, tower_.layers);
    for (int64_t u = tower_.layers - 1; u >= tower_first_adapted_; --u) {
      backward_end(tower_, u + 1);
      backward_begin(tower_, u);
    }
  }
}

void ShardedDecoder::on_grad_ready(size_t gi) {
  TrainGroup& g = *train_[gi];
  if (++g.arrived < g.expected) return;
  g.arrived = 0;
  if (!g.late && reducing()) reduce(gi);
}

void ShardedDecoder::reduce(size_t gi) {
  TrainGroup& g = *train_[gi];
  if (g.rs)  // rs_out and full_grad are still in use by the last backward's reduce-scatter
    throw std::logic_error("ShardedDecoder: a backward ran without finish_backward() after the previous one");
  if (!whole()) {  // a one-rank shard group's full gradient is its shard already
    g.rs = world_.shard().reduce_scatter_sum(g.rs_out, g.full_grad);
    stats_.reduce_scatters += 1;
  }
  ready_order_.push_back(gi);
}

void ShardedDecoder::finish_backward() {
  skip_tower_backwards();
  // The late groups (the tower's), after every other, in the same order on every rank.
  for (size_t gi = 0; gi < train_.size(); ++gi)
    if (train_[gi]->late && reducing()) reduce(gi);
  // Every group must have had each adapter's gradient exactly once; anything else (an adapter
  // the graph skipped, a backward cut short) would step on a stale shard, and out of step with
  // the other ranks' collectives.
  for (size_t gi = 0; gi < train_.size(); ++gi) {
    const bool issued = std::find(ready_order_.begin(), ready_order_.end(), gi) != ready_order_.end();
    const bool want = reducing();
    if (train_[gi]->arrived != 0 || issued != want)
      throw std::logic_error("ShardedDecoder::finish_backward: trainable group " + std::to_string(gi) + " (" +
                             train_[gi]->layout.members().front().name + ") received " +
                             std::to_string(train_[gi]->arrived) + " of " + std::to_string(train_[gi]->expected) +
                             " adapter gradients in this backward");
  }
  // Reduce-scatters in the order the groups became ready, then the replica all-reduces (HSDP).
  for (size_t gi : ready_order_) {
    TrainGroup& g = *train_[gi];
    if (!whole()) {
      WorkPtr w = std::move(g.rs);
      g.rs = {};
      wait(w);
      g.grad_shard.add_(g.rs_out);
      g.full_grad.zero_();
    }
    if (sync_ && world_.replica().size() > 1) g.ar = world_.replica().all_reduce_sum(g.grad_shard);
  }
  for (size_t gi : ready_order_) {
    WorkPtr w = std::move(train_[gi]->ar);
    train_[gi]->ar = {};
    wait(w);
  }
  ready_order_.clear();
  reshard_all();
}

double ShardedDecoder::clip_grad_norm(double max_norm) {
  // A whole group's gradients are the adapters' own: clip them as torch does (the norm of the
  // per-adapter norms), so one process computes exactly what torch's clip_grad_norm_ would.
  if (whole() && world_.replica().size() == 1) return optim::clip_grad_norm_(adapters_, max_norm).item<double>();
  at::Tensor sq = at::zeros({1}, param_shards_.empty() ? at::TensorOptions() : param_shards_[0].options());
  for (const auto& g : train_) sq += g->grad_shard.pow(2).sum();
  wait(world_.shard().all_reduce_sum(sq));  // replicas hold equal shards after their all-reduce
  const double total = std::sqrt(sq.item<double>());
  if (max_norm > 0) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0)
      for (auto& g : train_) g->grad_shard.mul_(coef);
  }
  return total;
}

void ShardedDecoder::gather_params() {
  std::vector<WorkPtr> works;
  for (auto& g : train_)
    if (!whole()) works.push_back(world_.shard().all_gather(g->full_param, param_shards_[g->shard_index]));
  for (auto& w : works) wait(w);
  for (auto& g : train_) {
    g->grad_shard.zero_();
    param_shards_[g->shard_index].mutable_grad() = g->grad_shard;
  }
}

at::Tensor ShardedDecoder::shard_of_unpadded(size_t g, const at::Tensor& unpadded) const {
  const FlatLayout& l = train_.at(g)->layout;
  if (unpadded.numel() != l.used())
    throw std::invalid_argument("ShardedDecoder: trainable group " + std::to_string(g) + " has " +
                                std::to_string(l.used()) + " values, got " + std::to_string(unpadded.numel()));
  at::Tensor full = l.empty_full(param_shards_.at(g).options());
  full.narrow(0, 0, l.used()).copy_(unpadded.reshape({-1}));
  return l.shard_of(full, world_.shard().rank()).clone();
}

void ShardedDecoder::load_params(const std::vector<at::Tensor>& unpadded) {
  if (unpadded.size() != train_.size())
    throw std::invalid_argument("ShardedDecoder::load_params: " + std::to_string(unpadded.size()) + " groups for " +
                                std::to_string(train_.size()));
  {
    at::NoGradGuard ng;
    for (size_t g = 0; g < train_.size(); ++g) param_shards_[g].copy_(shard_of_unpadded(g, unpadded[g]));
  }
  gather_params();
}

WorkPtr ShardedDecoder::gather_unit_to(int64_t unit, int root) {
  if (whole()) return {};  // every unit is here already
  FrozenGroup& g = group_of(unit);
  const bool me = world_.shard().rank() == root;
  at::Tensor out = at::empty({0}, g.shard.options());
  if (me && !g.gathered) {
    alloc_storage(g.full);
    g.gathered = true;
    out = g.full;
    stats_.gathers += 1;
    stats_.bytes_gathered += g.full.numel();
  } else if (me) {
    out = at::empty({g.full.numel()}, g.shard.options());  // already here (a tied group): take part, keep ours
  }
  return world_.shard().gather_to(root, out, g.shard);
}

void ShardedDecoder::release_unit(int64_t unit) { release(group_of(unit)); }

void ShardedDecoder::unshard_all() {
  for (auto& g : frozen_)
    if (g) ensure(*g);
  held_ = true;
}

void ShardedDecoder::reshard_all() {
  held_ = false;
  for (auto& g : frozen_)
    if (g) release(*g);
}

void ShardedDecoder::unshard_tower() {
  for (auto& g : frozen_)
    if (g && g->tower) ensure(*g);
}

void ShardedDecoder::reshard_tower() {
  for (auto& g : frozen_)
    if (g && g->tower) release(*g);
}

}  // namespace qlora::engine
