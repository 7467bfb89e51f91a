#include "qlora/checkpoint/export.h"
#include "qlora/io/read_file.h"

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "qlora/checkpoint/resume.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/durable_file.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/architecture.h"
#include "qlora/models/fused_experts.h"
#include "qlora/models/key_layout.h"
#include "qlora/ops/nf4_ops.h"

namespace fs = std::filesystem;

namespace qlora::checkpoint {

namespace {

// peft's key of a trainable-tokens module's rows, after base_model.model.<module>.
constexpr const char* kTokenRowsSuffix = ".token_adapter.trainable_tokens_delta";

const char* const kCopiedFiles[] = {"config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                    "special_tokens_map.json", "generation_config.json",
                                    // the chat template, where transformers 4.43+ saves it beside the tokenizer
                                    // (.jinja) or the processor (.json)
                                    "chat_template.jinja", "chat_template.json",
                                    // a vision-language model's image processor (images/processor.h)
                                    "preprocessor_config.json", "processor_config.json"};

std::string read_file(const fs::path& path) {
  auto text = io::read_file(path.string());
  if (!text) throw ExportError("export: cannot read " + path.string());
  return std::move(*text);
}

// PEFT module name of a parameter: "...layers.0.self_attn.q_proj.lora_A.weight" -> "q_proj".
std::string module_of(const std::string& name) {
  const auto pos = name.rfind(".lora_");
  if (pos == std::string::npos) return "";
  const auto start = name.rfind('.', pos - 1);
  return name.substr(start == std::string::npos ? 0 : start + 1, pos - (start == std::string::npos ? 0 : start + 1));
}

// peft's target_parameters entry of an adapter key on fused experts (models::DecoderModel::lora_parameters):
// "...layers.0.mlp.experts.base_layer.lora_A.weight" -> "mlp.experts.gate_up_proj" (the inner wrapper),
// "...layers.0.mlp.experts.lora_B.weight" -> "mlp.experts.down_proj"; "" for any other key.
std::string expert_parameter(const std::string& name) {
  for (const auto& [tail, param] : {std::pair{".experts.base_layer.lora_", "gate_up_proj"},
                                    std::pair{".experts.lora_", "down_proj"}}) {
    const auto pos = name.rfind(tail);
    const auto layers = name.rfind("layers.", pos);
    if (pos == std::string::npos || layers == std::string::npos) continue;
    const auto module = name.find('.', layers + 7) + 1;  // past "layers.N."
    return name.substr(module, pos + 8 - module) + "." + param;  // "mlp.experts" + param
  }
  return "";
}

nlohmann::json number(double v) {
  // PEFT writes lora_alpha as given (usually an int); keep integers integral.
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) return static_cast<int64_t>(v);
  return v;
}

// One tensor of the merged checkpoint: declared up front (the safetensors header comes first),
// produced only when its turn comes, so a single merged tensor is in memory at a time.
struct Entry {
  std::string key;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::function<at::Tensor()> produce;  // CPU tensor of dtype and shape
  int64_t nbytes() const {
    int64_t n = io::dtype_size(io::from_scalar_type(dtype));
    for (int64_t s : shape) n *= s;
    return n;
  }
};

// The base weight of a projection as the model holds it, in fp32.
at::Tensor model_base_fp32(const modules::LoraLinear& l) {
  if (l.base_nf4.defined()) return ops::nf4_dequantize(l.base_nf4, at::kFloat);
  return l.base_dense.to(at::kFloat);
}

// Expert e's gate_up [2 * inter, hidden] (or down [hidden, inter]) as an export writes it, fp32: the
// original's (`original` defined) or the model's base, merged with its adapter when it has one.
at::Tensor expert_weight_fp32(const modules::Experts& ex, int64_t e, bool gate_up, const at::Tensor& original) {
  const auto i = static_cast<size_t>(e);
  at::Tensor w = original.defined() ? original.to(at::kFloat)
                 : ex.nf4()         ? ops::nf4_dequantize((gate_up ? ex.gate_up_nf4 : ex.down_nf4)[i], at::kFloat)
                                    : (gate_up ? ex.gate_up_dense : ex.down_dense)[i].to(at::kFloat);
  if (!ex.has_lora()) return w;
  return gate_up ? modules::experts_merged_gate_up(ex, e, w) : modules::experts_merged_down(ex, e, w);
}

at::ScalarType model_base_dtype(const modules::LoraLinear& l) {
  return l.base_nf4.defined() ? l.base_nf4.dtype() : l.base_dense.scalar_type();
}

void copy_file_atomic(const fs::path& from, const fs::path& to) { io::write_file_atomic(to.string(), read_file(from)); }

// A base matrix [vocab, hidden] with the rows the run replaced (DecoderModel::token_rows) written over
// it: the exports carry the rows the model trained against, not the checkpoint's. Identity when the
// run replaced none.
using RowPatch = std::function<at::Tensor(const at::Tensor&)>;
at::Tensor unchanged(const at::Tensor& w) { return w; }
RowPatch token_rows_patch(const std::vector<int64_t>& ids, const at::Tensor& rows) {
  if (ids.empty() || !rows.defined()) return unchanged;
  return [ids, rows](const at::Tensor& w) {
    at::Tensor out = w.clone();
    out.index_copy_(0, at::tensor(ids, at::kLong).to(w.device()), rows.to(w.device(), w.scalar_type()));
    return out;
  };
}

}  // namespace

MergeSource merge_source_from_name(std::string_view name) {
  return io::enum_from_name(kMergeSourceNames, name, "merge source");
}

const char* merge_source_name(MergeSource source) { return io::enum_name(kMergeSourceNames, source); }

constexpr const char* kPromptFormatFile = "qlora.json";
constexpr const char* kPromptFormatVersion = "qlora-export-v1";

void write_prompt_format(const std::string& dir, const PromptFormat& p) {
  nlohmann::ordered_json prompt = {
      {"format", p.format},
      {"template", p.template_name.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(p.template_name)},
      {"train_on_input", p.train_on_input},
      {"add_bos", p.add_bos},
      {"add_eos", p.add_eos}};
  if (!p.chat_template.empty()) {
    prompt["chat_template"] = p.chat_template;
    prompt["chat_template_origin"] = p.chat_template_origin;
    prompt["template_kwargs"] = p.template_kwargs;
  }
  const nlohmann::ordered_json j = {{"format", kPromptFormatVersion}, {"prompt", std::move(prompt)}};
  io::write_file_atomic((fs::path(dir) / kPromptFormatFile).string(), j.dump(2) + "\n");
}

std::optional<PromptFormat> read_prompt_format(const std::string& dir) {
  const fs::path path = fs::path(dir) / kPromptFormatFile;
  if (!fs::exists(path)) return std::nullopt;
  const auto j = nlohmann::json::parse(read_file(path), nullptr, false);
  const auto bad = [&](const std::string& what) { return ExportError(path.string() + ": " + what); };
  if (j.is_discarded() || !j.is_object()) throw bad("not a JSON object");
  if (j.value("format", "") != kPromptFormatVersion)
    throw bad("\"format\" is not \"" + std::string(kPromptFormatVersion) + "\" (written by another qlora release?)");
  const auto it = j.find("prompt");
  if (it == j.end() || !it->is_object()) throw bad("no \"prompt\" object");
  const auto& q = *it;
  const auto need = [&](const char* key, bool (nlohmann::json::*is)() const noexcept) -> const nlohmann::json& {
    if (!q.contains(key) || !(q[key].*is)()) throw bad("prompt." + std::string(key) + " is missing or of the wrong type");
    return q[key];
  };
  PromptFormat p;
  p.format = need("format", &nlohmann::json::is_string).get<std::string>();
  if (q.contains("template") && !q["template"].is_null())
    p.template_name = need("template", &nlohmann::json::is_string).get<std::string>();
  p.train_on_input = need("train_on_input", &nlohmann::json::is_boolean).get<bool>();
  p.add_bos = need("add_bos", &nlohmann::json::is_boolean).get<bool>();
  p.add_eos = need("add_eos", &nlohmann::json::is_boolean).get<bool>();
  if (q.contains("chat_template")) {
    p.chat_template = need("chat_template", &nlohmann::json::is_string).get<std::string>();
    if (q.contains("chat_template_origin"))
      p.chat_template_origin = need("chat_template_origin", &nlohmann::json::is_string).get<std::string>();
    if (q.contains("template_kwargs"))
      p.template_kwargs = nlohmann::ordered_json::parse(need("template_kwargs", &nlohmann::json::is_object).dump());
  }
  if (p.template_name == "auto" && p.chat_template.empty()) throw bad("prompt.template is \"auto\" but prompt.chat_template is missing");
  return p;
}

void write_peft_adapter(const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& lora_params,
                        const AdapterInfo& info, at::ScalarType dtype) {
  if (lora_params.empty()) throw ExportError("write_peft_adapter " + dir + ": no LoRA parameters to write");
  if (info.r <= 0) throw ExportError("write_peft_adapter " + dir + ": r must be positive");
  std::set<std::string> derived, parameters;
  std::vector<std::pair<std::string, at::Tensor>> cpu;
  bool dora = false;
  for (const auto& [name, t] : lora_params) {
    const auto ends = [&n = name](const std::string& tail) {
      return n.size() > tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
    };
    const bool is_a = ends(".lora_A.weight"), is_b = ends(".lora_B.weight"), is_m = ends(".lora_magnitude_vector");
    const bool is_rows = ends(kTokenRowsSuffix) && !info.trainable_token_indices.is_null();
    const bool is_saved = std::any_of(info.modules_to_save.begin(), info.modules_to_save.end(),
                                      [&n = name](const std::string& m) { return n.rfind("base_model.model." + m + ".", 0) == 0; });
    if (is_saved) {  // a module peft trains whole: its tensors as they are
      cpu.emplace_back(name, t.detach().to(at::kCPU, dtype).contiguous());
      continue;
    }
    if (name.rfind("base_model.model.", 0) != 0 || !(is_a || is_b || is_m || is_rows)) {
      throw ExportError("write_peft_adapter " + dir + ": '" + name +
                        "' is not a PEFT LoRA key (base_model.model.<module>.lora_{A,B}.weight, "
                        ".lora_magnitude_vector, or with trainable_token_indices " + kTokenRowsSuffix + ")");
    }
    if (is_rows) {
      if (t.dim() != 2) throw ExportError("write_peft_adapter " + dir + ": '" + name + "' must be 2-D [ids, hidden]");
      cpu.emplace_back(name, t.detach().to(at::kCPU, dtype).contiguous());
      continue;
    }
    // LoRA on fused experts stacks every expert's rank: r * E rows (A) or columns (B).
    const std::string param = expert_parameter(name);
    const int64_t rank_dim = !t.defined() || t.dim() != 2 ? -1 : is_a ? t.size(0) : t.size(1);
    if (is_m ? !t.defined() || t.dim() != 1
             : rank_dim < 0 || (param.empty() ? rank_dim != info.r : rank_dim % info.r != 0)) {
      throw ExportError("write_peft_adapter " + dir + ": '" + name + "' must be " +
                        (is_m ? std::string("1-D [out]")
                              : "2-D with rank " + std::to_string(info.r) + (param.empty() ? "" : " x experts") +
                                    (is_a ? " rows" : " columns")));
    }
    dora = dora || is_m;
    if (param.empty()) derived.insert(module_of(name));
    else parameters.insert(param);
    cpu.emplace_back(name, t.detach().to(at::kCPU, dtype).contiguous());
  }
  fs::create_directories(dir);
  io::save_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), cpu, {{"format", "pt"}});

  // The experts are target_parameters, not a module.
  std::vector<std::string> targets =
      info.target_modules.empty() ? std::vector<std::string>(derived.begin(), derived.end()) : info.target_modules;
  targets.erase(std::remove(targets.begin(), targets.end(), models::kExpertsTarget), targets.end());
  nlohmann::json base = info.base_model_name_or_path.empty() ? nlohmann::json(nullptr)
                                                             : nlohmann::json(info.base_model_name_or_path);
  nlohmann::json cfg = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base},
      {"r", info.r},
      {"lora_alpha", number(info.alpha)},
      {"lora_dropout", info.dropout},
      {"target_modules", info.target_pattern.empty() ? nlohmann::json(targets) : nlohmann::json(info.target_pattern)},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"modules_to_save", info.modules_to_save.empty() ? nlohmann::json(nullptr) : nlohmann::json(info.modules_to_save)},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"revision", nullptr},
      {"use_rslora", info.use_rslora},  // scale alpha / sqrt(r) when true, else alpha / r
      {"use_dora", dora},
  };
  // Written only when set: older peft releases reject fields they do not know.
  if (!info.trainable_token_indices.is_null()) cfg["trainable_token_indices"] = info.trainable_token_indices;
  if (!parameters.empty()) cfg["target_parameters"] = std::vector<std::string>(parameters.begin(), parameters.end());
  // json's object keys are sorted, as PEFT's own json.dumps(sort_keys=True) writes them.
  io::write_file_atomic((fs::path(dir) / "adapter_config.json").string(), cfg.dump(2) + "\n");
}

namespace {

// A trained vision tower's tensors by their keys in the checkpoint it was loaded from: its adapted
// linears (<module>.weight) and its trained projector's tensors.
struct TowerTensors {
  std::map<std::string, const modules::LoraLinear*> linears;
  std::map<std::string, at::Tensor> projector;
};

TowerTensors trained_tower_tensors(const models::DecoderModel& model) {
  TowerTensors out;
  if (!model.tower) return out;
  models::vision::Tower& tower = *model.tower;
  for (auto& [module, lin] : tower.linears())
    if (lin->has_lora()) out.linears[tower.checkpoint_key(module + ".weight")] = lin;
  for (auto& [name, t] : tower.projector())
    if (t->requires_grad()) out.projector[tower.checkpoint_key(name)] = *t;
  return out;
}

}  // namespace

struct MergedModelWriter::Impl {
  std::string dir, base_dir;
  io::CheckpointDir orig;
  std::vector<Entry> entries;
  std::vector<int64_t> unit;                       // per entry
  std::vector<std::pair<size_t, size_t>> place;    // per entry: (file, index in the file's header)
  std::vector<std::string> names;                  // per file
  std::vector<io::SafetensorsHeader> headers;          // per file
  std::map<std::string, std::string> weight_map;
  int64_t total = 0;
  bool untie = false;
  bool mxfp4_experts = false;  // the original's experts are MXFP4; the merged ones bf16
  std::set<size_t> written;  // files this process wrote entries into, to fsync once each
};

MergedModelWriter::MergedModelWriter(const std::string& dir, const models::DecoderModel& model,
                                     const std::string& base_checkpoint_dir, MergeSource source,
                                     int64_t max_shard_bytes)
    : impl_(new Impl{dir, base_checkpoint_dir, io::CheckpointDir{}, {}, {}, {}, {}, {}, {}, 0, false, false, {}}) {
  if (max_shard_bytes <= 0) throw ExportError("write_merged_model " + dir + ": max_shard_bytes must be positive");
  if (base_checkpoint_dir.empty() || !fs::is_regular_file(fs::path(base_checkpoint_dir) / "config.json")) {
    throw ExportError("write_merged_model " + dir + ": base checkpoint '" + base_checkpoint_dir +
                      "' has no config.json (needed for the merged model's config)");
  }
  impl_->orig = io::CheckpointDir::open(base_checkpoint_dir);
  const io::CheckpointDir& orig = impl_->orig;
  std::vector<Entry>& entries = impl_->entries;
  int64_t current_unit = -1;
  auto push = [&](Entry e) {
    entries.push_back(std::move(e));
    impl_->unit.push_back(current_unit);
  };
  auto from_orig = [&orig](const std::string& key) {
    return [&orig, key]() { return orig.tensor(key).contiguous(); };
  };
  auto patched_orig = [&orig](const std::string& key, const RowPatch& patch) {
    return [&orig, key, patch]() { return patch(orig.tensor(key)).contiguous(); };
  };
  // A frozen non-projection tensor: the original's bytes when it has the key (with the replaced rows
  // of `patch` over them), else the model's.
  auto plain = [&](const std::string& key, const at::Tensor& t, const RowPatch& patch = unchanged) {
    if (orig.contains(key)) {
      const io::TensorInfo& ti = orig.file_of(key).info(key);
      push({key, io::to_scalar_type(ti.dtype), ti.shape, patched_orig(key, patch)});
    } else {
      push({key, t.scalar_type(), t.sizes().vec(), [t]() { return t.detach().cpu().contiguous(); }});
    }
  };
  // `patch`: the replaced rows of the output head, written over its base before any merge.
  auto projection = [&](const std::string& key, const modules::LoraLinear& l, const RowPatch& patch = unchanged) {
    const std::vector<int64_t> shape = {l.out_features, l.in_features};
    const bool have = orig.contains(key);
    if (have && orig.file_of(key).info(key).shape != shape) {
      throw ExportError("write_merged_model: " + key + " in " + base_checkpoint_dir + " has another shape than the model's");
    }
    const at::ScalarType out = have ? io::to_scalar_type(orig.file_of(key).info(key).dtype) : model_base_dtype(l);
    if (!l.has_lora()) {
      if (have) {
        push({key, out, shape, patched_orig(key, patch)});
      } else {  // the model's base: its rows are the replaced ones already
        push({key, out, shape, [&l, out]() { return model_base_fp32(l).to(out).cpu().contiguous(); }});
      }
      return;
    }
    if (source == MergeSource::Original && !have) {
      throw ExportError("write_merged_model: merge source 'original' needs " + key + ", which " + base_checkpoint_dir +
                        " does not contain");
    }
    const bool use_orig = source == MergeSource::Original;
    push({key, out, shape, [&l, &orig, key, out, use_orig, patch]() {
                         // [out, in]
                         const at::Tensor w = patch(use_orig ? orig.tensor(key).to(at::kFloat) : model_base_fp32(l));
                         return modules::lora_merged_weight(l, w).to(out).cpu().contiguous();
                       }});
  };

  const models::DecoderConfig& c = model.config;
  const models::Architecture& arch = model.architecture();
  // The table's text keys in the layout of the input files (key_layout.h).
  const auto key = [&model](const std::string& text_key) { return models::layout_key(model.key_layout, text_key); };
  // A MoE layer's router and experts in the original's layout (fused, or a tensor per expert and
  // projection), each expert merged with its adapter; without adapters, the original's bytes.
  auto experts = [&](const modules::DecoderLayer& L, int64_t i) {
    const models::ExpertsRow& row = *arch.experts;
    const modules::Experts& ex = L.experts;
    const std::string fused = key(models::hf_module(row.fused, i));
    const bool is_fused = row.transposed_interleaved || orig.contains(fused + ".gate_up_proj");
    const std::string router = key(models::hf_module(is_fused ? row.fused_router : row.split_router, i));
    plain(router + ".weight", L.router);
    if (row.biases) {  // gpt-oss's, in its own order
      plain(router + ".bias", L.router_bias);
      // Re-interleaved only where the original lacks it: a sharded model's tensors are not resident here.
      const std::string gu_bias = fused + ".gate_up_proj_bias";
      plain(gu_bias, row.transposed_interleaved && !orig.contains(gu_bias) ? modules::interleave_gate_up(ex.gate_up_bias, 1)
                                                                           : ex.gate_up_bias);
      plain(fused + ".down_proj_bias", ex.down_bias);
    }
    const bool use_orig = source == MergeSource::Original;
    const int64_t I = ex.inter;
    // (key, its expert, gate_up or down, the rows of that weight it holds)
    struct Part { std::string key; int64_t e; bool gate_up; int64_t row0, rows; };
    std::vector<Part> parts;
    if (is_fused) {
      parts = {{fused + ".gate_up_proj", -1, true, 0, 2 * I}, {fused + ".down_proj", -1, false, 0, ex.hidden}};
    } else {
      for (int64_t e = 0; e < ex.num_experts; ++e) {
        const std::string stem = key(models::hf_module(row.split, i)) + "." + std::to_string(e) + ".";
        parts.push_back({stem + row.gate + ".weight", e, true, 0, I});
        parts.push_back({stem + row.up + ".weight", e, true, I, I});
        parts.push_back({stem + row.down + ".weight", e, false, 0, ex.hidden});
      }
    }
    // A fused tensor: every expert merged (the original's, or the model's base), in the checkpoint's
    // layout; an MXFP4 original in bf16 (merging into MXFP4 would round it), which write_extras says.
    // Experts without adapters keep an MXFP4 original's blocks and scales, bit for bit.
    auto fused_part = [&](const std::string& k, bool gate_up) {
      const bool mxfp4 = models::is_mxfp4(orig, row, k);
      if (mxfp4) impl_->mxfp4_experts = true;
      const models::FusedExperts src = use_orig ? models::read_fused_experts(orig, row, gate_up, k, ex.num_experts,
                                                                             ex.hidden, ex.inter)
                                                : models::FusedExperts{};
      const at::ScalarType out = mxfp4 ? at::kBFloat16 : io::to_scalar_type(orig.file_of(k).info(k).dtype);
      push({k, out, models::fused_expert_shape(row, gate_up, ex.num_experts, ex.hidden, ex.inter),
            [&ex, &row, gate_up, src, out, use_orig]() {
              std::vector<at::Tensor> all;
              for (int64_t e = 0; e < ex.num_experts; ++e) {
                const at::Tensor w = expert_weight_fp32(ex, e, gate_up, use_orig ? src.expert(e) : at::Tensor());
                all.push_back(models::expert_to_checkpoint(row, gate_up, w).to(out).cpu());
              }
              return at::stack(all);
            }});
    };
    for (const Part& p : parts) {
      const bool mxfp4 = p.e < 0 && models::is_mxfp4(orig, row, p.key);
      if (!ex.has_lora() && mxfp4 && use_orig) {  // unchanged MXFP4 experts: the original's bytes
        plain(p.key + "_blocks", at::Tensor());
        plain(p.key + "_scales", at::Tensor());
        continue;
      }
      if (!ex.has_lora() && !mxfp4) {
        plain(p.key, at::Tensor());
        continue;
      }
      if (p.e < 0) {
        fused_part(p.key, p.gate_up);
        continue;
      }
      const io::TensorInfo& ti = orig.file_of(p.key).info(p.key);
      const at::ScalarType out = io::to_scalar_type(ti.dtype);
      // The original's matrix of expert e (gate over up).
      const auto original = [&orig, p, use_orig, stem = p.key.substr(0, p.key.rfind('.', p.key.size() - 8) + 1),
                             row]() -> at::Tensor {
        if (!use_orig) return at::Tensor();
        if (!p.gate_up) return orig.tensor(p.key);
        return at::cat({orig.tensor(stem + row.gate + ".weight"), orig.tensor(stem + row.up + ".weight")});
      };
      push({p.key, out, ti.shape, [&ex, p, out, original]() {
              return expert_weight_fp32(ex, p.e, p.gate_up, original()).narrow(0, p.row0, p.rows).to(out).cpu().contiguous();
            }});
    }
  };
  const models::DecoderModel::TokenRows& token_rows = model.token_rows;
  const RowPatch embed_rows = token_rows_patch(token_rows.ids, token_rows.embed);
  // A tied head's rows are the embedding's.
  const RowPatch head_rows =
      token_rows_patch(token_rows.ids, token_rows.head.defined() ? token_rows.head : token_rows.embed);
  plain(key(arch.embed_key), model.embed_tokens, embed_rows);
  if (models::has_embed_rows(c))
    for (const models::EmbedRow& row : arch.embed_rows) plain(key(row.hf_key), model.per_layer_inputs.*row.member);
  for (size_t i = 0; i < model.layers.size(); ++i) {
    current_unit = static_cast<int64_t>(i);
    const modules::DecoderLayer& L = model.layers[i];
    for (const models::NormRow& n : arch.layer_norms)
      if (models::in_layer(n.mixer, c, current_unit)) plain(key(models::hf_key(n, current_unit)), L.*n.member);
    for (const models::ProjectionRow& row : arch.projections) {
      if (!row.member || !models::in_layer(row.mixer, c, current_unit)) continue;
      projection(key(models::hf_key(row, current_unit)), L.*row.member);
      if ((L.*row.member).bias.defined()) plain(key(models::hf_bias_key(row, current_unit)), (L.*row.member).bias);
    }
    if (L.is_moe()) experts(L, current_unit);
  }
  current_unit = static_cast<int64_t>(model.layers.size());
  plain(key(arch.final_norm_key), model.norm);
  const std::string head_key = key(models::hf_key(models::output_projection(arch), 0));
  const bool untie = c.tie_word_embeddings && model.lm_head.has_lora();
  if (!c.tie_word_embeddings || untie) {
    if (untie && !orig.contains(head_key)) {
      // Tied: the original has no lm_head.weight; the merged head starts from the embedding.
      const std::string embed = key(arch.embed_key);
      const at::ScalarType out = io::to_scalar_type(orig.file_of(embed).info(embed).dtype);
      const modules::LoraLinear& l = model.lm_head;
      push({head_key, out, {l.out_features, l.in_features}, [&l, &orig, embed, out, source, head_rows]() {
                           const bool use_orig = source == MergeSource::Original;
                           const at::Tensor w = head_rows(use_orig ? orig.tensor(embed).to(at::kFloat) : model_base_fp32(l));
                           return modules::lora_merged_weight(l, w).to(out).cpu().contiguous();
                         }});
    } else {
      projection(head_key, model.lm_head, head_rows);
    }
  }

  impl_->untie = untie;
  // What no text computation reads (a multimodal checkpoint's vision tower and projector, Qwen3.5's
  // mtp.*): copied as it is, but for a trained tower's adapted linears (merged) and projector (the
  // trained tensors, in the checkpoint's dtype), under the checkpoint's keys.
  const TowerTensors tower = trained_tower_tensors(model);
  for (const std::string& k : orig.tensor_names()) {
    if (models::is_language_model_key(model.key_layout, k)) continue;
    const io::TensorInfo& ti = orig.file_of(k).info(k);
    if (const auto lin = tower.linears.find(k); lin != tower.linears.end()) {
      projection(k, *lin->second);
    } else if (const auto p = tower.projector.find(k); p != tower.projector.end()) {
      if (p->second.sizes().vec() != ti.shape)
        throw ExportError("write_merged_model: " + k + " in " + base_checkpoint_dir + " has another shape than the model's projector");
      push({k, io::to_scalar_type(ti.dtype), ti.shape,
            [t = p->second, out = io::to_scalar_type(ti.dtype)]() { return t.detach().to(out).cpu().contiguous(); }});
    } else {
      push({k, io::to_scalar_type(ti.dtype), ti.shape, from_orig(k)});
    }
  }

  // Greedy sharding in checkpoint order, as transformers' split_torch_state_dict_into_shards.
  std::vector<std::vector<size_t>> shards(1);
  int64_t cur = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const int64_t n = entries[i].nbytes();
    if (!shards.back().empty() && cur + n > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += n;
    impl_->total += n;
  }
  impl_->place.resize(entries.size());
  char name[64];
  for (size_t s = 0; s < shards.size(); ++s) {
    if (shards.size() == 1) std::snprintf(name, sizeof name, "model.safetensors");
    else std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    // Wider dtypes first within a shard, so every tensor is naturally aligned for zero-copy reads.
    std::vector<size_t> idx = shards[s];
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
      return c10::elementSize(entries[a].dtype) > c10::elementSize(entries[b].dtype);
    });
    std::vector<io::EntrySpec> specs;
    for (size_t k = 0; k < idx.size(); ++k) {
      specs.push_back({entries[idx[k]].key, io::from_scalar_type(entries[idx[k]].dtype), entries[idx[k]].shape});
      impl_->place[idx[k]] = {s, k};
      impl_->weight_map[entries[idx[k]].key] = name;
    }
    impl_->names.push_back(name);
    impl_->headers.push_back(io::safetensors_header((fs::path(dir) / name).string(), specs, {{"format", "pt"}}));
  }
}

MergedModelWriter::~MergedModelWriter() = default;

size_t MergedModelWriter::num_entries() const { return impl_->entries.size(); }
int64_t MergedModelWriter::unit_of(size_t i) const { return impl_->unit.at(i); }

void MergedModelWriter::create_files() const {
  fs::create_directories(impl_->dir);
  for (size_t f = 0; f < impl_->names.size(); ++f)
    io::create_safetensors_file((fs::path(impl_->dir) / impl_->names[f]).string(), impl_->headers[f]);
}

void MergedModelWriter::write_entry(size_t i) const {
  const c10::NoGradGuard no_grad;
  const Entry& e = impl_->entries.at(i);
  const at::Tensor t = e.produce();
  if (t.scalar_type() != e.dtype || t.sizes().vec() != e.shape) {
    throw ExportError("write_merged_model: internal error, " + e.key + " produced the wrong dtype or shape");
  }
  const auto [file, k] = impl_->place[i];
  io::write_safetensors_entry((fs::path(impl_->dir) / impl_->names[file]).string(), impl_->headers[file], k, t);
  impl_->written.insert(file);
  if (impl_->orig.contains(e.key)) impl_->orig.file_of(e.key).release(e.key);  // keep RSS flat on 7B bases
}

void MergedModelWriter::sync_written() const {
  for (size_t f : impl_->written) io::fsync_path((fs::path(impl_->dir) / impl_->names[f]).string());
  impl_->written.clear();
}

void MergedModelWriter::write_extras(const std::string& tokenizer_path) const {
  const std::string& dir = impl_->dir;
  const std::string& base_checkpoint_dir = impl_->base_dir;
  if (impl_->names.size() > 1) {
    io::write_safetensors_index((fs::path(dir) / io::kSafetensorsIndexName).string(), impl_->weight_map,
                            static_cast<uint64_t>(impl_->total));
  }
  // Config and tokenizer files: the base checkpoint's, then an explicit tokenizer overriding them.
  for (const char* f : kCopiedFiles) {
    const fs::path p = fs::path(base_checkpoint_dir) / f;
    if (fs::is_regular_file(p)) copy_file_atomic(p, fs::path(dir) / f);
  }
  if (!tokenizer_path.empty()) {
    const fs::path tp(tokenizer_path);
    if (fs::is_directory(tp)) {
      for (const char* f : kCopiedFiles) {
        if (std::string(f) != "config.json" && fs::is_regular_file(tp / f)) copy_file_atomic(tp / f, fs::path(dir) / f);
      }
      // The tokenizer's template, not the base's: a base's chat_template.jinja would win over the one in
      // the tokenizer's tokenizer_config.json.
      if (!fs::is_regular_file(tp / "chat_template.jinja")) fs::remove(fs::path(dir) / "chat_template.jinja");
    } else if (fs::is_regular_file(tp)) {
      copy_file_atomic(tp, fs::path(dir) / tp.filename());
    } else {
      throw ExportError("write_merged_model " + dir + ": tokenizer path '" + tokenizer_path + "' does not exist");
    }
  }
  if (impl_->untie || impl_->mxfp4_experts) {
    const fs::path cfg_path = fs::path(dir) / "config.json";
    nlohmann::json cfg = nlohmann::json::parse(read_file(cfg_path));
    if (impl_->untie) {
      cfg["tie_word_embeddings"] = false;
      // A multimodal config's language model says it too (transformers reads the top-level key).
      if (cfg.contains("text_config") && cfg["text_config"].is_object())
        cfg["text_config"]["tie_word_embeddings"] = false;
    }
    if (impl_->mxfp4_experts) {  // the experts are bf16 now: no quantization_config
      cfg.erase("quantization_config");
      std::printf("note: %s stores its experts in MXFP4; the merged model %s holds them in bf16 (LoRA merged into "
                  "MXFP4 would be rounded to it)\n", base_checkpoint_dir.c_str(), dir.c_str());
    }
    io::write_file_atomic(cfg_path.string(), cfg.dump(2) + "\n");
  }
}


namespace {

// A multimodal model's adapter names its targets by a pattern that only the language model's modules
// match (models::peft_target_pattern); a list of short names would also wrap the vision tower's. The
// tower's adapted modules join the pattern, its trained projector modules_to_save.
AdapterInfo adapter_info_for(const models::DecoderModel& model, AdapterInfo info) {
  if (!model.config.multimodal) return info;
  std::vector<std::string> names = info.target_modules;
  std::vector<std::string> tower_modules;
  if (model.tower) {
    tower_modules = models::vision::adapted_modules(*model.tower);
    const std::string projector = models::vision::projector_module(*model.tower);
    if (!projector.empty()) info.modules_to_save.push_back(projector);
  }
  const size_t tower_tensors = model.tower ? models::vision::tower_trainable(*model.tower).size() : 0;
  const auto params = model.lora_parameters();
  if (names.empty())  // the language model's: lora_parameters() ends with the tower's
    for (size_t k = 0; k + tower_tensors < params.size(); ++k)
      if (expert_parameter(params[k].first).empty()) names.push_back(module_of(params[k].first));
  info.target_pattern =
      models::peft_target_pattern(model.architecture(), models::peft_layout(model.config), names, tower_modules);
  return info;
}

// The rows the run replaced (DecoderModel::token_rows) as peft's trainable tokens: their ids in the
// config, their rows among the adapter's tensors. A tied head: the ids as a list, for which peft
// wraps the input embedding and ties the head to its rows; else one entry per module.
void add_token_rows(const models::DecoderModel& model, AdapterInfo& info,
                    std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  const models::DecoderModel::TokenRows& rows = model.token_rows;
  if (rows.ids.empty()) return;
  const auto module = [&model](const std::string& text_key) {  // "model.embed_tokens.weight" -> "model.embed_tokens"
    const std::string k = models::layout_key(model.key_layout, text_key);
    return k.substr(0, k.rfind(".weight"));
  };
  const auto last = [](const std::string& m) { return m.substr(m.rfind('.') + 1); };  // peft's name for the module
  const std::string embed = module(model.architecture().embed_key);
  tensors.emplace_back("base_model.model." + embed + kTokenRowsSuffix, rows.embed);
  if (!rows.head.defined()) {
    info.trainable_token_indices = rows.ids;
    return;
  }
  const std::string head = module(models::hf_key(models::output_projection(model.architecture()), 0));
  tensors.emplace_back("base_model.model." + head + kTokenRowsSuffix, rows.head);
  info.trainable_token_indices = {{last(embed), rows.ids}, {last(head), rows.ids}};
}

void call(const std::function<void()>& f) {
  if (f) f();
}

// The merged model's files, written by every writer of `ranks` together: writer 0 creates the
// files with their headers, each writer fills in the entries of the units it owns, writer 0
// adds the index, config and tokenizer files once every entry is durable.
void write_merged(const std::string& dir, const models::DecoderModel& model, const std::string& base_checkpoint_dir,
                  MergeSource source, int64_t max_shard_bytes, const std::string& tokenizer_path,
                  const ExportRanks& ranks) {
  const MergedModelWriter w(dir, model, base_checkpoint_dir, source, max_shard_bytes);
  if (ranks.writer == 0) w.create_files();
  call(ranks.writers_barrier);
  std::map<int64_t, std::vector<size_t>> entries_of;  // unit -> its entries
  for (size_t i = 0; i < w.num_entries(); ++i) entries_of[w.unit_of(i)].push_back(i);
  std::vector<int64_t> units;
  for (const auto& [u, e] : entries_of) units.push_back(u);
  const auto write = [&](int64_t u) {
    for (size_t i : entries_of[u]) w.write_entry(i);
  };
  if (ranks.for_my_units) ranks.for_my_units(units, write);
  else
    for (int64_t u : units) write(u);
  w.sync_written();
  call(ranks.writers_barrier);  // every entry is durable
  if (ranks.writer == 0) w.write_extras(tokenizer_path);
}

}  // namespace

void write_merged_model(const std::string& dir, const models::DecoderModel& model, const std::string& base_checkpoint_dir,
                        MergeSource source, int64_t max_shard_bytes, const std::string& tokenizer_path) {
  write_merged(dir, model, base_checkpoint_dir, source, max_shard_bytes, tokenizer_path, {});
  io::fsync_path(dir);
}

void export_epoch(const std::string& output_dir, int64_t epoch, const models::DecoderModel& model, const AdapterInfo& info,
                  bool adapter_only, const std::string& base_checkpoint_dir, MergeSource source,
                  const std::string& tokenizer_path, const ExportRanks& ranks) {
  if (epoch < 0) throw ExportError("export_epoch: negative epoch " + std::to_string(epoch));
  const fs::path final_dir = fs::path(output_dir) / ("epoch_" + std::to_string(epoch));
  const fs::path tmp = final_dir.string() + ".tmp";
  if (ranks.lead) {
    fs::create_directories(output_dir);
    fs::remove_all(tmp);  // an export that crashed: incomplete by construction
    fs::create_directories(tmp);
    std::vector<std::pair<std::string, at::Tensor>> tensors = model.peft_parameters();
    AdapterInfo adapter = adapter_info_for(model, info);
    add_token_rows(model, adapter, tensors);
    write_peft_adapter((tmp / "adapter").string(), tensors, adapter);
    if (info.prompt) write_prompt_format(tmp.string(), *info.prompt);
  }
  call(ranks.barrier);
  if (!adapter_only && ranks.writes_model)
    write_merged(tmp.string(), model, base_checkpoint_dir, source, 5LL << 30, tokenizer_path, ranks);
  call(ranks.barrier);
  if (ranks.lead) {
    if (ranks.before_commit) ranks.before_commit(tmp.string());
    io::fsync_path(tmp.string());
    commit_directory(tmp.string(), final_dir.string());
  }
  call(ranks.barrier);
}

}  // namespace qlora::checkpoint
