// TOML → RecipeConfig. One table (visit_fields) lists every key once, with its section, its
// member and whether it affects exactness; parsing, overrides, emitting, equality, hashing and the
// resume check are all driven by it, so adding a key is one line and cannot be half-wired.
#include "qlora/config/config.h"
#include "qlora/gguf/ggml_types.h"
#include "qlora/io/enum_names.h"
#include "qlora/io/read_file.h"
#include "qlora/models/architecture.h"

#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>

namespace qlora::config {
namespace {

// ---- enum keys ------------------------------------------------------------------------------
// Every enum key is spelled by one name table. The components own theirs; config owns only the
// compute dtypes the models support and BaseFormat, which no component has.
// "auto" is ScalarType::Undefined until the recipe resolves it for its device (resolve_compute_dtype).
constexpr io::EnumName<at::ScalarType> kComputeDtypeNames[] = {
    {at::kBFloat16, "bf16"}, {at::kFloat, "fp32"}, {at::ScalarType::Undefined, "auto"}};
constexpr io::EnumName<BaseFormat> kBaseFormatNames[] = {
    {BaseFormat::NF4, "nf4"}, {BaseFormat::BF16, "bf16"}, {BaseFormat::FP32, "fp32"}};

// The table of each enum type a key holds (found by overload: names_of(T{})).
constexpr const auto& names_of(at::ScalarType) { return kComputeDtypeNames; }
constexpr const auto& names_of(BaseFormat) { return kBaseFormatNames; }
constexpr const auto& names_of(data::DatasetKind) { return data::kDatasetKindNames; }
constexpr const auto& names_of(data::TemplateKind) { return data::kTemplateKindNames; }
constexpr const auto& names_of(optim::ScheduleKind) { return optim::kScheduleKindNames; }
constexpr const auto& names_of(checkpoint::MergeSource) { return checkpoint::kMergeSourceNames; }
constexpr const auto& names_of(report::ProgressMode) { return report::kProgressModeNames; }
constexpr const auto& names_of(train::NonFinitePolicy) { return train::kNonFinitePolicyNames; }
constexpr const auto& names_of(train::PreferenceLoss) { return train::kPreferenceLossNames; }
constexpr const auto& names_of(train::UntrainedTokensPolicy) { return train::kUntrainedTokensPolicyNames; }
constexpr const auto& names_of(train::RewardKind) { return train::kRewardKindNames; }
constexpr const auto& names_of(train::GrpoLossType) { return train::kGrpoLossTypeNames; }
constexpr const auto& names_of(train::ImportanceSamplingLevel) { return train::kImportanceSamplingLevelNames; }
constexpr const auto& names_of(train::RewardScaling) { return train::kRewardScalingNames; }

// An optional enum key (data.template) spells its absence "none", after the table's names.
constexpr const char* kAbsent = "none";

// Named keys: an enum, or an optional enum.
template <class T>
struct IsNamed : std::is_enum<T> {};
template <class E>
struct IsNamed<std::optional<E>> : std::is_enum<E> {};
template <class T>
constexpr bool is_named = IsNamed<T>::value;

template <class E>
const char* enum_name(const E& v) {
  return io::enum_name(names_of(v), v);
}
template <class E>
const char* enum_name(const std::optional<E>& v) {
  return v ? enum_name(*v) : kAbsent;
}

template <class E>
std::string enum_allowed(const E&) {
  return io::enum_names(names_of(E{}));
}
template <class E>
std::string enum_allowed(const std::optional<E>&) {
  return enum_allowed(E{}) + ", " + kAbsent;
}

// False when `name` is not one of the allowed names; out is then untouched.
template <class E>
bool enum_set(E& out, std::string_view name) {
  const auto v = io::enum_value(names_of(out), name);
  if (v) out = *v;
  return v.has_value();
}
template <class E>
bool enum_set(std::optional<E>& out, std::string_view name) {
  if (name == kAbsent) return out.reset(), true;
  E value{};
  if (!enum_set(value, name)) return false;
  out = value;
  return true;
}

const char* const kSections[] = {"model",      "lora",    "data", "optim", "training",
                                 "checkpoint", "logging", "dist", "dpo",   "grpo"};

// ---- the key table ----------------------------------------------------------------------------
// Exactness: a key is "exact" when changing it between a checkpoint and its resume changes the
// numbers training produces. Locations (model.checkpoint_dir, data.path, checkpoint.output_dir)
// are not: a moved model or data set is still the same run; the recipe fingerprints the weights and
// data it actually reads. activation_checkpointing is counted as exact, conservatively: recompute
// must reproduce dropout masks and reduction order, and we do not promise that across the switch.
// dist.shard_size changes reduce-scatter grouping and so summation order.
template <class Cfg, class V>
void visit_fields(Cfg& c, V&& v) {
  v("model", "checkpoint_dir", c.model.checkpoint_dir, false);
  v("model", "name", c.model.name, false);
  v("model", "tokenizer", c.model.tokenizer, false);
  // "auto" and "cuda" may name the same device: the recipe checks the resolved device type instead.
  v("model", "device", c.model.device, false);
  v("model", "dtype", c.model.dtype, true);
  v("model", "base", c.model.base, true);
  v("model", "activation_checkpointing", c.model.activation_checkpointing, true);
  // "mean" changes rows the run trains against ("error" trains only where no row needs it).
  v("model", "untrained_tokens", c.model.untrained_tokens, true);
  v("lora", "rank", c.lora.rank, true);
  v("lora", "alpha", c.lora.alpha, true);
  v("lora", "dropout", c.lora.dropout, true);
  v("lora", "targets", c.lora.targets, true);
  v("lora", "use_rslora", c.lora.use_rslora, true);
  v("lora", "use_dora", c.lora.use_dora, true);
  v("lora", "vision_targets", c.lora.vision_targets, true);
  v("lora", "train_projector", c.lora.train_projector, true);
  v("data", "path", c.data.path, false);
  v("data", "split", c.data.split, false);  // a location too: the file it picks is fingerprinted
  v("data", "val_path", c.data.val_path, false);
  v("data", "val_fraction", c.data.val_fraction, true);  // what it holds out is not trained on
  v("data", "format", c.data.format, true);
  v("data", "template", c.data.template_, true);
  v("data", "template_kwargs", c.data.template_kwargs, true);
  v("data", "add_bos", c.data.add_bos, true);
  v("data", "add_eos", c.data.add_eos, true);
  v("data", "max_seq_len", c.data.max_seq_len, true);
  v("data", "train_on_input", c.data.train_on_input, true);
  v("data", "packing", c.data.packing, true);
  v("data", "shuffle", c.data.shuffle, true);
  v("data", "instruction_field", c.data.instruction_field, true);
  v("data", "input_field", c.data.input_field, true);
  v("data", "output_field", c.data.output_field, true);
  v("data", "messages_field", c.data.messages_field, true);
  v("data", "text_field", c.data.text_field, true);
  v("optim", "lr", c.optim.lr, true);
  v("optim", "weight_decay", c.optim.weight_decay, true);
  v("optim", "betas", c.optim.betas, true);
  v("optim", "eps", c.optim.eps, true);
  v("optim", "warmup_steps", c.optim.warmup_steps, true);
  v("optim", "schedule", c.optim.schedule, true);
  v("optim", "min_lr_ratio", c.optim.min_lr_ratio, true);
  v("optim", "max_grad_norm", c.optim.max_grad_norm, true);
  v("training", "epochs", c.training.epochs, true);  // total steps shape the cosine schedule
  v("training", "batch_size", c.training.batch_size, true);
  v("training", "grad_accum", c.training.grad_accum, true);
  v("training", "max_steps_per_epoch", c.training.max_steps_per_epoch, true);
  v("training", "seed", c.training.seed, true);
  // Evaluation draws no random numbers and updates nothing.
  v("training", "eval_every_steps", c.training.eval_every_steps, false);
  // A finite run is the same under either; a run stopped at a non-finite step may resume with "skip".
  v("training", "on_nonfinite", c.training.on_nonfinite, false);
  v("training", "max_consecutive_skips", c.training.max_consecutive_skips, false);
  v("checkpoint", "output_dir", c.checkpoint.output_dir, false);
  v("checkpoint", "save_every_steps", c.checkpoint.save_every_steps, false);
  v("checkpoint", "keep_last_n", c.checkpoint.keep_last_n, false);
  v("checkpoint", "adapter_only", c.checkpoint.adapter_only, false);
  v("checkpoint", "merge_from", c.checkpoint.merge_from, false);  // export only, not training
  v("checkpoint", "resume", c.checkpoint.resume, false);
  v("checkpoint", "gguf", c.checkpoint.gguf, false);  // export only
  v("logging", "log_every_steps", c.logging.log_every_steps, false);
  v("logging", "progress", c.logging.progress, false);
  v("logging", "tensorboard", c.logging.tensorboard, false);
  v("dist", "shard_size", c.dist.shard_size, true);
  v("dist", "collective_timeout_s", c.dist.collective_timeout_s, false);
  // Scheduling only: the sharded engine's results do not depend on them (tested).
  v("dist", "reshard_after_forward", c.dist.reshard_after_forward, false);
  v("dist", "prefetch", c.dist.prefetch, false);
  v("dist", "reduce_scatter_every_micro_batch", c.dist.reduce_scatter_every_micro_batch, false);
  v("dpo", "loss", c.dpo.loss, true);
  v("dpo", "beta", c.dpo.beta, true);
  v("dpo", "label_smoothing", c.dpo.label_smoothing, true);
  v("dpo", "simpo_gamma", c.dpo.simpo_gamma, true);
  // Precomputed or per step, the reference log-probabilities are the same numbers.
  v("dpo", "precompute_reference", c.dpo.precompute_reference, false);
  v("dpo", "max_prompt_len", c.dpo.max_prompt_len, true);
  v("grpo", "rewards", c.grpo.rewards, true);
  // The command's text, not its program's contents: editing the script between resumes is the user's call.
  v("grpo", "reward_command", c.grpo.reward_command, true);
  v("grpo", "reward_command_weight", c.grpo.reward_command_weight, true);
  v("grpo", "reward_timeout_s", c.grpo.reward_timeout_s, false);
  v("grpo", "num_generations", c.grpo.num_generations, true);
  v("grpo", "max_completion_length", c.grpo.max_completion_length, true);
  v("grpo", "temperature", c.grpo.temperature, true);
  v("grpo", "top_p", c.grpo.top_p, true);
  v("grpo", "top_k", c.grpo.top_k, true);
  v("grpo", "loss_type", c.grpo.loss_type, true);
  v("grpo", "importance_sampling_level", c.grpo.importance_sampling_level, true);
  v("grpo", "scale_rewards", c.grpo.scale_rewards, true);
  v("grpo", "epsilon", c.grpo.epsilon, true);
  v("grpo", "epsilon_high", c.grpo.epsilon_high, true);
  v("grpo", "beta", c.grpo.beta, true);
  v("grpo", "num_iterations", c.grpo.num_iterations, true);
  v("grpo", "mask_truncated_completions", c.grpo.mask_truncated_completions, true);
  v("grpo", "use_bias_correction_kl", c.grpo.use_bias_correction_kl, true);
}

using RewardSpecs = std::vector<train::RewardSpec>;

template <class T>
constexpr bool is_string_like = std::is_same_v<T, std::string> || is_named<T>;

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, bool>) return "a boolean";
  else if constexpr (std::is_same_v<T, std::optional<bool>>) return "a boolean or \"auto\"";
  else if constexpr (std::is_same_v<T, nlohmann::ordered_json>) return "a table of keyword arguments";
  else if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  else if constexpr (std::is_same_v<T, double>) return "a number";
  else if constexpr (std::is_same_v<T, std::string>) return "a string";
  else if constexpr (is_named<T>) return "a string (one of " + enum_allowed(T{}) + ")";
  else if constexpr (std::is_same_v<T, std::vector<std::string>>) return "an array of strings";
  else if constexpr (std::is_same_v<T, RewardSpecs>) return "an array of tables ([[grpo.rewards]] kind = ...)";
  else return "an array of 2 numbers";
}

const char* node_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    default: return "a date/time";
  }
}

// Where an error happened: "config FILE" or "override 'k=v'", and whether lines mean anything.
struct Origin {
  std::string prefix;
  bool has_lines = true;
};

std::string at_line(const Origin& o, const toml::node& n) {
  if (!o.has_lines || n.source().begin.line == 0) return "";
  return " (line " + std::to_string(n.source().begin.line) + ")";
}

[[noreturn]] void fail(const Origin& o, const std::string& msg) {
  throw ConfigError(o.prefix + ": " + msg);
}

bool read_number(const toml::node& n, double& out) {
  if (auto f = n.as_floating_point()) return out = f->get(), true;
  if (auto i = n.as_integer()) return out = static_cast<double>(i->get()), true;
  return false;
}

// How deep template keyword arguments may nest: the config is written back as TOML (to_toml, kept
// in every resume checkpoint) with nested inline tables, and TOML parsers stop at 256 levels.
constexpr int kMaxKwargsDepth = 64;

// A TOML value as JSON, for template keyword arguments (dates are refused).
nlohmann::ordered_json toml_to_json(const toml::node& n, const Origin& o, const std::string& key, int depth = 0) {
  if ((n.is_table() || n.is_array()) && depth >= kMaxKwargsDepth)
    fail(o, "key '" + key + "'" + at_line(o, n) + ": nests tables or arrays more than " +
                std::to_string(kMaxKwargsDepth) + " levels deep");
  if (auto t = n.as_table()) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (auto&& [k, v] : *t) j[std::string(k.str())] = toml_to_json(v, o, key + "." + std::string(k.str()), depth + 1);
    return j;
  }
  if (auto a = n.as_array()) {
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (const toml::node& e : *a) j.push_back(toml_to_json(e, o, key, depth + 1));
    return j;
  }
  if (auto b = n.as_boolean()) return b->get();
  if (auto i = n.as_integer()) return i->get();
  if (auto f = n.as_floating_point()) return f->get();
  if (auto s = n.as_string()) return s->get();
  fail(o, "key '" + key + "'" + at_line(o, n) + ": a date/time cannot be a template argument");
}

void read_rewards(const toml::array& a, RewardSpecs& out, const Origin& o, const std::string& key);

// Every key a grpo.rewards table may hold, in train::reward_keys' order; each kind takes some.
template <class Spec, class V>
void visit_reward_keys(Spec& r, V&& v) {
  v("kind", r.kind);
  v("weight", r.weight);
  v("field", r.field);
  v("tolerance", r.tolerance);
  v("pattern", r.pattern);
  v("target", r.target);
  v("max", r.max);
}

template <class T>
void read_field(const toml::node& n, T& out, const Origin& o, const std::string& key) {
  auto wrong_type = [&]() {
    fail(o, "key '" + key + "'" + at_line(o, n) + " expects " + type_name<T>() + ", got " +
                node_type_name(n));
  };
  if constexpr (std::is_same_v<T, bool>) {
    auto b = n.as_boolean();
    if (!b) wrong_type();
    out = b->get();
  } else if constexpr (std::is_same_v<T, std::optional<bool>>) {
    if (auto b = n.as_boolean()) out = b->get();
    else if (auto s = n.as_string(); s && s->get() == "auto") out.reset();
    else wrong_type();
  } else if constexpr (std::is_same_v<T, nlohmann::ordered_json>) {
    auto t = n.as_table();
    if (!t) wrong_type();
    out = toml_to_json(*t, o, key);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    auto i = n.as_integer();
    if (!i) wrong_type();
    out = i->get();
  } else if constexpr (std::is_same_v<T, double>) {
    if (!read_number(n, out)) wrong_type();
  } else if constexpr (std::is_same_v<T, std::string>) {
    auto s = n.as_string();
    if (!s) wrong_type();
    out = s->get();
  } else if constexpr (is_named<T>) {
    auto s = n.as_string();
    if (!s) wrong_type();
    if (!enum_set(out, s->get()))
      fail(o, "invalid value '" + s->get() + "' for '" + key + "'" + at_line(o, n) +
                  "; allowed: " + enum_allowed(out));
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    auto a = n.as_array();
    if (!a) wrong_type();
    T values;
    for (const toml::node& e : *a) {
      auto s = e.as_string();
      if (!s) wrong_type();
      values.push_back(s->get());
    }
    out = std::move(values);
  } else if constexpr (std::is_same_v<T, RewardSpecs>) {
    auto a = n.as_array();
    if (!a) wrong_type();
    read_rewards(*a, out, o, key);
  } else {
    auto a = n.as_array();
    if (!a || a->size() != out.size()) wrong_type();
    T values{};
    for (size_t i = 0; i < values.size(); ++i)
      if (!read_number(*a->get(i), values[i])) wrong_type();
    out = values;
  }
}

// grpo.rewards: each table's kind first, then only that kind's keys (train::reward_keys).
void read_rewards(const toml::array& a, RewardSpecs& out, const Origin& o, const std::string& key) {
  RewardSpecs specs(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string at = key + "[" + std::to_string(i) + "]";
    const toml::table* t = a.get(i)->as_table();
    if (!t)
      fail(o, "key '" + at + "'" + at_line(o, *a.get(i)) + " expects a table ({ kind = \"" +
                  io::enum_names(train::kRewardKindNames) + "\", weight = ... }), got " + node_type_name(*a.get(i)));
    train::RewardSpec& r = specs[i];
    const toml::node* kind = t->get("kind");
    if (!kind) fail(o, "key '" + at + ".kind'" + at_line(o, *a.get(i)) + " is missing; one of " + enum_allowed(r.kind));
    read_field(*kind, r.kind, o, at + ".kind");
    const std::vector<std::string> keys = train::reward_keys(r.kind);
    for (auto&& [k, node] : *t) {
      const std::string name(k.str()), full = at + "." + name;
      visit_reward_keys(r, [&, &node = node](const char* k2, auto& member) {
        if (name == k2 && name != "kind") read_field(node, member, o, full);
      });
      if (std::find(keys.begin(), keys.end(), name) == keys.end()) {
        std::string known;
        for (const std::string& s : keys) known += (known.empty() ? "" : ", ") + s;
        fail(o, "unknown key '" + full + "'" + at_line(o, node) + " for kind \"" + enum_name(r.kind) +
                    "\"; its keys: " + known);
      }
    }
  }
  out = std::move(specs);
}

// ---- writing (toml++) ----------------------------------------------------------------------
// The config is written as a toml::table streamed by toml++'s formatter: one table per section,
// keys in toml++'s order (sorted), template_kwargs and grpo.rewards as inline tables. toml++ (as
// built on Linux) writes a float with 17 significant digits, which is exact but shows 0.0002 as
// 0.00020000000000000001, or with relaxed_float_precision with 6, which is not always exact: a text
// is written with 6 where it then reads back to the same values, else with 17.

std::unique_ptr<toml::node> json_node(const nlohmann::ordered_json& j) {
  if (j.is_object() || j.is_null()) {  // null: no keyword arguments, {}
    auto t = std::make_unique<toml::table>();
    t->is_inline(true);
    for (const auto& [k, v] : j.items()) t->insert(k, std::move(*json_node(v)));
    return t;
  }
  if (j.is_array()) {
    auto a = std::make_unique<toml::array>();
    for (const auto& v : j) a->push_back(std::move(*json_node(v)));
    return a;
  }
  if (j.is_string()) return std::make_unique<toml::value<std::string>>(j.get<std::string>());
  if (j.is_number_float()) return std::make_unique<toml::value<double>>(j.get<double>());
  if (j.is_boolean()) return std::make_unique<toml::value<bool>>(j.get<bool>());
  return std::make_unique<toml::value<int64_t>>(j.get<int64_t>());  // toml_to_json makes no other kind
}

// A member as the TOML value it is written as.
template <class T>
std::unique_ptr<toml::node> to_node(const T& v) {
  if constexpr (std::is_same_v<T, std::optional<bool>>) {
    return v ? to_node(*v) : to_node(std::string("auto"));
  } else if constexpr (std::is_same_v<T, nlohmann::ordered_json>) {
    return json_node(v);
  } else if constexpr (is_named<T>) {
    return to_node(std::string(enum_name(v)));
  } else if constexpr (std::is_same_v<T, RewardSpecs>) {
    auto a = std::make_unique<toml::array>();
    for (const train::RewardSpec& r : v) {
      toml::table t;  // its kind's keys only
      t.is_inline(true);
      const std::vector<std::string> keys = train::reward_keys(r.kind);
      visit_reward_keys(r, [&](const char* k, const auto& member) {
        if (std::find(keys.begin(), keys.end(), k) != keys.end()) t.insert(k, std::move(*to_node(member)));
      });
      a->push_back(std::move(t));
    }
    return a;
  } else if constexpr (std::is_same_v<T, std::vector<std::string>> || std::is_same_v<T, std::array<double, 2>>) {
    auto a = std::make_unique<toml::array>();
    for (const auto& e : v) a->push_back(e);
    return a;
  } else {  // bool, int64_t, double, std::string
    return std::make_unique<toml::value<T>>(v);
  }
}

// Keys added after checkpoints existed are written only when set, so that the text (and the
// hash) of every config that leaves them unset stays what it was.
template <class T>
bool written(const T& v) {
  if constexpr (std::is_same_v<T, std::optional<bool>>) return v.has_value();
  else if constexpr (std::is_same_v<T, nlohmann::ordered_json>) return !v.empty();
  else return true;
}

// The keys passing `keep`, one table per section.
template <class Keep>
toml::table to_table(const RecipeConfig& cfg, Keep keep) {
  toml::table root;
  visit_fields(cfg, [&](const char* section, const char* key, const auto& member, bool exact) {
    if (!keep(exact) || !written(member)) return;
    root.emplace<toml::table>(section).first->second.as_table()->insert(key, std::move(*to_node(member)));
  });
  return root;
}

// toml++'s text of `doc`, with floats as short as reads back exactly (see above); no final newline.
std::string toml_text(const toml::table& doc) {
  constexpr auto kFlags = toml::format_flags::allow_unicode_strings | toml::format_flags::indent_array_elements;
  std::ostringstream relaxed;
  relaxed << toml::toml_formatter(doc, kFlags | toml::format_flags::relaxed_float_precision);
  try {
    if (toml::parse(relaxed.str()) == doc) return relaxed.str();
  } catch (const toml::parse_error&) {  // not expected; the exact form below is written then
  }
  std::ostringstream exact;
  exact << toml::toml_formatter(doc, kFlags);
  return exact.str();
}

// One value as to_toml writes it ("\"q\"", "[ \"q\", \"v\" ]", "0.0002").
template <class T>
std::string value_text(const T& v) {
  toml::table doc;
  doc.insert("v", std::move(*to_node(v)));
  return toml_text(doc).substr(4);  // after "v = "
}

// ---- parsing --------------------------------------------------------------------------------
using LineMap = std::map<std::string, uint32_t>;  // "section.key" -> line, for range errors

bool known_section(std::string_view s) {
  for (const char* k : kSections)
    if (s == k) return true;
  return false;
}

std::string keys_in_section(std::string_view section) {
  std::string out;
  RecipeConfig dummy;
  visit_fields(dummy, [&](const char* s, const char* key, auto&, bool) {
    if (section == s) out += (out.empty() ? "" : ", ") + std::string(key);
  });
  return out;
}

void merge_table(RecipeConfig& cfg, const toml::table& root, const Origin& o, LineMap& lines) {
  for (auto&& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    if (!known_section(section)) {
      std::string all;
      for (const char* s : kSections) all += (all.empty() ? "" : ", ") + std::string(s);
      fail(o, "unknown " + std::string(section_node.is_table() ? "section" : "key") + " '" +
                  section + "'" + at_line(o, section_node) + "; known sections: " + all);
    }
    const toml::table* table = section_node.as_table();
    if (!table)
      fail(o, "'" + section + "'" + at_line(o, section_node) + " must be a table ([" + section +
                  "]), got " + node_type_name(section_node));
    for (auto&& [key, node] : *table) {
      const std::string name = section + "." + std::string(key.str()), key_name(key.str());
      bool found = false;
      visit_fields(cfg, [&, &node = node](const char* s, const char* k, auto& member, bool) {
        if (found || section != s || key_name != k) return;
        found = true;
        read_field(node, member, o, name);
      });
      if (!found)
        fail(o, "unknown key '" + name + "'" + at_line(o, node) + "; known keys in [" + section +
                    "]: " + keys_in_section(section));
      lines[name] = node.source().begin.line;
    }
  }
}

bool is_device_name(const std::string& d) {
  if (d == "auto" || d == "cpu" || d == "cuda") return true;
  if (d.rfind("cuda:", 0) != 0 || d.size() == 5 || d.size() > 8) return false;
  for (size_t k = 5; k < d.size(); ++k)
    if (!std::isdigit(static_cast<unsigned char>(d[k]))) return false;
  return true;
}

bool is_gguf_type(const std::string& name) {
  try {
    gguf::type_from_name(name);
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

void validate(const RecipeConfig& c, const Origin& o, const LineMap& lines) {
  auto check = [&](bool ok, const std::string& key, const std::string& rule,
                   const std::string& got) {
    if (ok) return;
    std::string where;
    auto it = lines.find(key);
    if (o.has_lines && it != lines.end() && it->second) where = " (line " + std::to_string(it->second) + ")";
    fail(o, "'" + key + "'" + where + " must be " + rule + ", got " + got);
  };
  const auto d = [](double x) { return value_text(x); };
  const auto i = [](int64_t x) { return std::to_string(x); };
  check(is_device_name(c.model.device), "model.device", "\"auto\", \"cpu\", \"cuda\" or \"cuda:N\"",
        "\"" + c.model.device + "\"");
  check(c.dpo.beta > 0, "dpo.beta", "> 0", d(c.dpo.beta));
  check(c.dpo.label_smoothing >= 0 && c.dpo.label_smoothing < 0.5, "dpo.label_smoothing", "in [0, 0.5)",
        d(c.dpo.label_smoothing));
  check(c.dpo.max_prompt_len >= 0 && (c.data.max_seq_len <= 0 || c.dpo.max_prompt_len < c.data.max_seq_len),
        "dpo.max_prompt_len", ">= 0 and below data.max_seq_len", i(c.dpo.max_prompt_len));
  check(c.lora.rank >= 1, "lora.rank", ">= 1", i(c.lora.rank));
  check(c.lora.alpha > 0, "lora.alpha", "> 0", d(c.lora.alpha));
  check(c.lora.dropout >= 0 && c.lora.dropout < 1, "lora.dropout", "in [0, 1)", d(c.lora.dropout));
  check(!c.lora.targets.empty(), "lora.targets", "non-empty", "[]");
  std::set<std::string> seen;
  // The short spelling only: lora.targets is compared exactly on resume, and "q" vs "q_proj" for
  // the same run would refuse it.
  // The checkpoint's family is not known here: a name some family has passes, and the loader
  // checks it against the family's own table.
  const std::string allowed = models::known_target_names();
  for (const std::string& t : c.lora.targets) {
    check(models::is_known_target(t), "lora.targets", "a list of " + allowed, "'" + t + "'");
    check(seen.insert(t).second, "lora.targets", "free of duplicates", "'" + t + "' twice");
  }
  // The names depend on the checkpoint's tower: the recipe checks them against it (vision::add_tower_lora).
  std::set<std::string> seen_vision;
  for (const std::string& t : c.lora.vision_targets)
    check(seen_vision.insert(t).second, "lora.vision_targets", "free of duplicates", "'" + t + "' twice");
  check(c.lora.vision_targets.empty() || !c.lora.use_dora, "lora.use_dora",
        "false with lora.vision_targets (DoRA on the vision tower is not supported)", "true");
  check(c.data.max_seq_len >= 1, "data.max_seq_len", ">= 1", i(c.data.max_seq_len));
  check(c.data.val_fraction >= 0 && c.data.val_fraction < 1, "data.val_fraction", "in [0, 1)", d(c.data.val_fraction));
  check(c.data.val_path.empty() || c.data.val_fraction == 0, "data.val_fraction",
        "0 when data.val_path is set (one source of validation data)", d(c.data.val_fraction));
  check(c.optim.lr > 0 && std::isfinite(c.optim.lr), "optim.lr", "> 0 and finite", d(c.optim.lr));
  check(c.optim.weight_decay >= 0, "optim.weight_decay", ">= 0", d(c.optim.weight_decay));
  for (double b : c.optim.betas) check(b >= 0 && b < 1, "optim.betas", "in [0, 1)", d(b));
  check(c.optim.eps > 0, "optim.eps", "> 0", d(c.optim.eps));
  check(c.optim.warmup_steps >= 0, "optim.warmup_steps", ">= 0", i(c.optim.warmup_steps));
  check(c.optim.min_lr_ratio >= 0 && c.optim.min_lr_ratio <= 1, "optim.min_lr_ratio", "in [0, 1]",
        d(c.optim.min_lr_ratio));
  check(!std::isnan(c.optim.max_grad_norm), "optim.max_grad_norm", "a number (<= 0 disables)", "nan");
  check(c.training.epochs >= 1, "training.epochs", ">= 1", i(c.training.epochs));
  check(c.training.batch_size >= 1, "training.batch_size", ">= 1", i(c.training.batch_size));
  check(c.training.grad_accum >= 1, "training.grad_accum", ">= 1", i(c.training.grad_accum));
  check(c.training.max_steps_per_epoch >= 0, "training.max_steps_per_epoch", ">= 0 (0 = no cap)",
        i(c.training.max_steps_per_epoch));
  check(c.training.seed >= 0, "training.seed", ">= 0", i(c.training.seed));
  check(c.training.eval_every_steps >= 0, "training.eval_every_steps", ">= 0 (0 = at each epoch end)",
        i(c.training.eval_every_steps));
  check(c.training.max_consecutive_skips >= 1, "training.max_consecutive_skips", ">= 1",
        i(c.training.max_consecutive_skips));
  check(!c.checkpoint.output_dir.empty(), "checkpoint.output_dir", "non-empty", "\"\"");
  check(c.checkpoint.save_every_steps >= 0, "checkpoint.save_every_steps", ">= 0 (0 = per epoch)",
        i(c.checkpoint.save_every_steps));
  check(c.checkpoint.keep_last_n >= 1, "checkpoint.keep_last_n", ">= 1", i(c.checkpoint.keep_last_n));
  std::set<std::string> gguf_seen;
  for (const std::string& t : c.checkpoint.gguf) {
    check(is_gguf_type(t), "checkpoint.gguf", "a list of " + gguf::type_names(), "'" + t + "'");
    check(gguf_seen.insert(t).second, "checkpoint.gguf", "free of duplicates", "'" + t + "' twice");
  }
  check(c.checkpoint.gguf.empty() || !c.checkpoint.adapter_only, "checkpoint.gguf",
        "empty when checkpoint.adapter_only = true (a GGUF is written from the merged model)", "a type list");
  check(c.logging.log_every_steps >= 1, "logging.log_every_steps", ">= 1", i(c.logging.log_every_steps));
  check(c.dist.shard_size >= 0, "dist.shard_size", ">= 0 (0 = world size)", i(c.dist.shard_size));
  check(c.dist.collective_timeout_s >= 1, "dist.collective_timeout_s", ">= 1",
        i(c.dist.collective_timeout_s));
  check(std::isfinite(c.grpo.reward_command_weight), "grpo.reward_command_weight", "a finite number",
        d(c.grpo.reward_command_weight));
  check(c.grpo.reward_timeout_s >= 1, "grpo.reward_timeout_s", ">= 1 (seconds)", i(c.grpo.reward_timeout_s));
  check(c.grpo.temperature > 0 && std::isfinite(c.grpo.temperature), "grpo.temperature", "> 0",
        d(c.grpo.temperature));
  check(c.grpo.top_p > 0 && c.grpo.top_p <= 1, "grpo.top_p", "in (0, 1]", d(c.grpo.top_p));
  check(c.grpo.top_k >= 0, "grpo.top_k", ">= 0 (0: no cut)", i(c.grpo.top_k));
  check(c.grpo.epsilon_high >= 0, "grpo.epsilon_high", ">= 0 (0: epsilon)", d(c.grpo.epsilon_high));
  try {
    train::validate(c.grpo.options());
  } catch (const std::invalid_argument& e) {
    fail(o, e.what());
  }
  try {
    train::validate_rewards(c.grpo.rewards);
  } catch (const std::invalid_argument& e) {
    const auto it = lines.find("grpo.rewards");
    const bool line = o.has_lines && it != lines.end() && it->second;
    fail(o, e.what() + (line ? " (grpo.rewards at line " + std::to_string(it->second) + ")" : std::string()));
  }
}

toml::table parse_toml(std::string_view text, const std::string& source, const Origin& o) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    fail(o, "TOML syntax error at line " + std::to_string(b.line) + ", column " +
                std::to_string(b.column) + ": " + std::string(e.description()));
  }
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

RecipeConfig parse_config(std::string_view toml_text, const std::string& source_name) {
  const Origin o{"config " + source_name, true};
  const toml::table root = parse_toml(toml_text, source_name, o);
  RecipeConfig cfg;
  LineMap lines;
  merge_table(cfg, root, o, lines);
  validate(cfg, o, lines);
  return cfg;
}

RecipeConfig load_config(const std::string& toml_path) {
  const auto text = io::read_file(toml_path);
  if (!text) throw ConfigError("config " + toml_path + ": cannot open: " + std::strerror(errno));
  return parse_config(*text, toml_path);
}

void apply_override(RecipeConfig& cfg, std::string_view override_text) {
  const Origin o{"override '" + std::string(override_text) + "'", false};
  const size_t eq = override_text.find('=');
  if (eq == std::string_view::npos) fail(o, "expected section.key=value");
  const std::string name(trim(override_text.substr(0, eq)));
  const std::string raw(trim(override_text.substr(eq + 1)));
  const size_t dot = name.find('.');
  if (dot == std::string::npos) fail(o, "expected section.key=value, got key '" + name + "'");
  const std::string section = name.substr(0, dot), key = name.substr(dot + 1);

  RecipeConfig next = cfg;  // all or nothing: a failed override leaves cfg untouched
  bool found = false;
  visit_fields(next, [&](const char* s, const char* k, auto& member, bool) {
    if (found || section != s || key != k) return;
    found = true;
    using T = std::decay_t<decltype(member)>;
    std::optional<toml::table> parsed;
    std::string error;
    try {
      parsed = toml::parse("v = " + raw, std::string_view("override"));
    } catch (const toml::parse_error& e) {
      error = std::string(e.description());
    }
    const toml::node* node = parsed ? parsed->get("v") : nullptr;
    if constexpr (is_string_like<T>) {
      // Unquoted paths and names are the common case on a command line.
      if (!node || !node->is_string()) {
        const toml::value<std::string> verbatim(raw);
        return read_field(verbatim, member, o, name);
      }
    }
    if (!node) fail(o, "value '" + raw + "' for '" + name + "' is not a TOML value: " + error);
    read_field(*node, member, o, name);
  });
  if (!found) {
    if (!known_section(section)) {
      std::string all;
      for (const char* s : kSections) all += (all.empty() ? "" : ", ") + std::string(s);
      fail(o, "unknown section '" + section + "'; known sections: " + all);
    }
    fail(o, "unknown key '" + name + "'; known keys in [" + section + "]: " + keys_in_section(section));
  }
  validate(next, o, {});
  cfg = std::move(next);
}

std::string to_toml(const RecipeConfig& cfg) {
  return toml_text(to_table(cfg, [](bool) { return true; })) + "\n";
}

std::string config_hash(const RecipeConfig& cfg, HashScope scope) {
  const std::string text = scope == HashScope::Full ? to_toml(cfg)
                                                    : toml_text(to_table(cfg, [](bool exact) { return exact; })) + "\n";
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64 offset basis
  for (unsigned char ch : text) {
    h ^= ch;
    h *= 1099511628211ull;  // FNV-1a 64 prime
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::vector<std::string> exactness_breaking_differences(const RecipeConfig& a, const RecipeConfig& b) {
  std::vector<std::string> text_a, names;
  visit_fields(a, [&](const char* s, const char* k, const auto& m, bool exact) {
    if (exact) text_a.push_back(value_text(m)), names.push_back(std::string(s) + "." + k);
  });
  std::vector<std::string> out;
  size_t i = 0;
  visit_fields(b, [&](const char*, const char*, const auto& m, bool exact) {
    if (!exact) return;
    if (value_text(m) != text_a[i]) out.push_back(names[i]);
    ++i;
  });
  return out;
}

std::vector<KeyInfo> known_keys() {
  std::vector<KeyInfo> out;
  RecipeConfig dummy;
  visit_fields(dummy, [&](const char* s, const char* k, auto&, bool exact) {
    out.push_back({std::string(s) + "." + k, exact});
  });
  return out;
}

std::vector<std::pair<std::string, std::string>> key_values(const RecipeConfig& cfg) {
  std::vector<std::pair<std::string, std::string>> out;
  visit_fields(cfg, [&](const char* s, const char* k, const auto& m, bool) {
    out.emplace_back(std::string(s) + "." + k, value_text(m));
  });
  return out;
}

bool operator==(const RecipeConfig& a, const RecipeConfig& b) { return to_toml(a) == to_toml(b); }

train::GrpoOptions GrpoConfig::options() const {
  train::GrpoOptions o;
  o.loss_type = loss_type;
  o.importance_sampling_level = importance_sampling_level;
  o.scale_rewards = scale_rewards;
  o.num_generations = num_generations;
  o.epsilon = epsilon;
  if (epsilon_high > 0) o.epsilon_high = epsilon_high;
  o.beta = beta;
  o.num_iterations = num_iterations;
  o.mask_truncated_completions = mask_truncated_completions;
  o.use_bias_correction_kl = use_bias_correction_kl;
  o.max_completion_length = max_completion_length;
  return o;
}

}  // namespace qlora::config
