#include "qlora/gguf/adapter.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "qlora/gguf/arch.h"
#include "qlora/gguf/tensor_data.h"
#include "qlora/gguf/writer.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/read_file.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/architecture.h"
#include "qlora/models/key_layout.h"
#include "qlora/models/decoder_config.h"

namespace qlora::gguf {
namespace {
namespace fs = std::filesystem;

struct AdapterConfig {
  double alpha;           // llama.cpp's alpha (it multiplies by alpha / r)
  std::string base_name;  // base_model_name_or_path; empty when absent
  std::vector<std::string> target_parameters;  // peft's parameter targets (the experts' fused weights)
};

// adapter_config.json's scale as llama.cpp's alpha and the base it names; refuses what a GGUF LoRA
// adapter cannot hold.
AdapterConfig read_adapter_config(const std::string& adapter_dir) {
  const std::string file = (fs::path(adapter_dir) / "adapter_config.json").string();
  const auto text = io::read_file(file);
  if (!text) throw std::invalid_argument(file + ": cannot read it (a PEFT adapter directory has one)");
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(*text);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(file + ": " + e.what());
  }
  const auto refuse = [&](const std::string& what) {
    throw std::invalid_argument(file + ": " + what + "; a GGUF LoRA adapter holds plain LoRA matrices only");
  };
  if (c.value("peft_type", std::string("LORA")) != "LORA") refuse("peft_type is not LORA");
  if (c.value("use_dora", false)) refuse("use_dora is true (DoRA's magnitude vectors)");
  if (c.value("fan_in_fan_out", false)) refuse("fan_in_fan_out is true");
  if (c.contains("bias") && c["bias"] != "none") refuse("bias is " + c["bias"].dump());
  if (c.contains("modules_to_save") && !c["modules_to_save"].is_null() && !c["modules_to_save"].empty())
    refuse("modules_to_save is set");
  if (c.contains("trainable_token_indices") && !c["trainable_token_indices"].is_null())
    refuse("trainable_token_indices is set (token rows replaced in the base: convert the epoch's merged model, "
           "which holds them)");
  if (!c.contains("r") || !c["r"].is_number() || !c.contains("lora_alpha") || !c["lora_alpha"].is_number())
    throw std::invalid_argument(file + ": expected numbers 'r' and 'lora_alpha'");
  for (const char* k : {"rank_pattern", "alpha_pattern"})
    if (c.contains(k) && !c[k].is_null() && !c[k].empty()) refuse(std::string(k) + " is set (per-module ranks)");
  const double r = c["r"].get<double>(), alpha = c["lora_alpha"].get<double>();
  const nlohmann::json base = c.value("base_model_name_or_path", nlohmann::json());
  std::vector<std::string> params;
  if (c.contains("target_parameters") && c["target_parameters"].is_array())
    for (const auto& v : c["target_parameters"])
      if (v.is_string()) params.push_back(v.get<std::string>());
  return {c.value("use_rslora", false) ? alpha * std::sqrt(r) : alpha,  // alpha / sqrt(r) == (alpha sqrt(r)) / r
          base.is_string() ? base.get<std::string>() : "", params};
}

// Whether the base model's GGUF, which the adapter is applied to, has no output.weight: its head is the
// token embedding. The trained-on checkpoint says so, unless it is an epoch's merged export whose head
// the LoRA untied (tie_word_embeddings false there); then the base that adapter_config.json names does,
// when it is a local directory.
bool base_head_is_tied(const models::DecoderConfig& trained_on, const std::string& base_name) {
  if (trained_on.tie_word_embeddings) return true;
  if (base_name.empty() || !fs::is_regular_file(fs::path(base_name) / "config.json")) return false;
  return models::load_decoder_config(base_name).tie_word_embeddings;
}

// A LoRA on a MoE layer's experts: peft's target_parameters on the fused experts.gate_up_proj
// [E, 2I, H] and experts.down_proj [E, H, I], A [r * E, in] expert-major (expert e's rows e*r..),
// B [out, r * E] expert-minor (expert e's columns e, e + E, ..). Both targeted, peft nests the
// wrappers: gate_up_proj's A/B are experts.base_layer.lora_*, down_proj's experts.lora_*; one alone
// is experts.lora_*, named by target_parameters. llama.cpp applies a LoRA to ffn_*_exps per expert
// (mul_mat_id): lora_a [E, r, in], lora_b [E, out, r]; gate_up's B rows split into gate and up
// halves (gpt-oss: its even and odd rows), its A shared by both (gemma4's one ffn_gate_up_exps takes
// them whole).
struct ExpertLora {
  int64_t layer;
  bool gate_up;
};

std::optional<ExpertLora> expert_lora(const std::string& module, const models::DecoderConfig& c,
                                      const std::vector<std::string>& target_parameters, bool nested_pair) {
  const auto& ex = c.family->architecture().experts;
  if (!ex) return std::nullopt;
  static const std::regex layer(R"(model\.layers\.(\d+)\..+)");
  std::smatch m;
  if (!std::regex_match(module, m, layer)) return std::nullopt;
  const int64_t i = std::stoll(m[1].str());
  if (i >= c.num_hidden_layers || !c.is_moe(i)) return std::nullopt;
  const std::string fused = models::hf_module(ex->fused, i);
  if (module == fused + ".base_layer") return ExpertLora{i, true};
  if (module != fused) return std::nullopt;
  if (nested_pair) return ExpertLora{i, false};  // the outer wrapper: down_proj
  const auto ends = [](const std::string& s, const std::string& tail) {
    return s == tail || (s.size() > tail.size() && s.compare(s.size() - tail.size() - 1, tail.size() + 1, "." + tail) == 0);
  };
  bool gate_up = false, down = false;
  for (const std::string& t : target_parameters) {
    gate_up = gate_up || ends(t, "gate_up_proj");
    down = down || ends(t, "down_proj");
  }
  if (gate_up == down) return std::nullopt;  // neither or both named: not a layout peft writes
  return ExpertLora{i, gate_up};
}

struct Pair {
  std::string a_key, b_key;  // in adapter_model.safetensors
  TensorPlan target;         // the adapted matrix's GGUF name and row order
  std::optional<ExpertLora> expert{};  // a LoRA on layer expert->layer's experts (target unused)
};

// The adapter's A/B pairs in file order of their A, each with the matrix it adapts.
// A LoRA on a tied head is refused: llama.cpp finds no output.weight in the base's GGUF to apply it to
// (llama-cpp-python 0.3.36 crashed on the first decode with one), while the merged model holds it.
std::vector<Pair> pairs_of(const io::SafetensorsFile& f, const models::DecoderConfig& c, models::KeyLayout layout,
                           bool tied_head, const std::vector<std::string>& target_parameters) {
  static const std::string kPrefix = "base_model.model.", kA = ".lora_A.weight", kB = ".lora_B.weight";
  std::vector<Pair> out;
  for (const io::TensorInfo& t : f.tensors()) {
    const std::string& key = t.name;
    const bool is_a = key.size() > kA.size() && key.compare(key.size() - kA.size(), kA.size(), kA) == 0;
    const bool is_b = key.size() > kB.size() && key.compare(key.size() - kB.size(), kB.size(), kB) == 0;
    if (key.rfind(kPrefix, 0) != 0 || (!is_a && !is_b))
      throw std::invalid_argument(f.path() + ": tensor '" + key + "' is not a PEFT LoRA A/B matrix");
    if (!is_a) continue;
    const std::string module = key.substr(kPrefix.size(), key.size() - kPrefix.size() - kA.size());
    const std::string b_key = kPrefix + module + kB;
    if (!f.find(b_key)) throw std::invalid_argument(f.path() + ": '" + key + "' has no '" + b_key + "'");
    const std::string weight = module + ".weight";
    if (models::is_language_model_key(layout, weight)) {
      const std::string text = models::text_key(layout, weight);
      const std::string text_module = text.substr(0, text.size() - 7);
      const bool nested = f.find(kPrefix + module + ".base_layer" + kA) != nullptr;
      if (auto ex = expert_lora(text_module, c, target_parameters, nested)) {
        out.push_back({key, b_key, TensorPlan{}, ex});
        continue;
      }
    }
    std::optional<TensorPlan> target;
    if (models::is_language_model_key(layout, weight)) target = gguf_tensor(models::text_key(layout, weight), c);
    if (!target || target->add != 0.0f || target->neg_exp || target->squeeze || target->no_lora)
      throw std::invalid_argument(f.path() + ": '" + key + "' adapts '" + weight + "', which has no GGUF matrix a " +
                                  "LoRA adapter can apply to" +
                                  (target && target->no_lora ? " (llama.cpp multiplies it without its LoRA)" : ""));
    if (tied_head && target->name == "output.weight")
      throw std::invalid_argument(
          f.path() + ": '" + key + "' adapts the output head, which the base model ties to its token embedding " +
          "(tie_word_embeddings): the base's GGUF has no output.weight, so llama.cpp cannot apply a LoRA there. " +
          "Convert the epoch's merged model instead (qlora gguf EPOCH_DIR), which holds the trained head, or " +
          "train without \"output\" in lora.targets");
    out.push_back({key, b_key, *target});
  }
  if (out.empty()) throw std::invalid_argument(f.path() + ": no LoRA matrices");
  return out;
}

// The per-expert scale llama.cpp multiplies layer `layer`'s down products by (ffn_down_exps.scale:
// Gemma 4's router.per_expert_scale), [E] fp32, from the base checkpoint; undefined where the family
// has none. llama.cpp scales the base product alone and adds the LoRA's after it, where transformers
// scales the whole expert output (the routing weight carries the scale): the LoRA's B is written
// times it, expert by expert, so that llama.cpp's sum is transformers' s_e (W + B A) x.
at::Tensor down_exps_scale(const io::CheckpointDir& ckpt, models::KeyLayout layout, const models::DecoderConfig& c,
                           int64_t layer) {
  const std::string want = "blk." + std::to_string(layer) + ".ffn_down_exps.scale";
  for (const models::NormRow& n : c.family->architecture().layer_norms) {
    if (!models::in_layer(n.mixer, c, layer)) continue;
    const std::string key = models::hf_key(n, layer);
    const std::optional<TensorPlan> t = gguf_tensor(key, c);
    if (t && t->name == want) return ckpt.tensor(models::layout_key(layout, key)).to(at::kFloat);
  }
  return {};
}

// Adapters are small; llama.cpp's converter writes every matrix in one type, f16 where a row is not
// whole blocks of it (B's rows are r long).
GgmlType adapter_type(const std::vector<int64_t>& shape, GgmlType chosen) {
  return shape.back() % type_info(chosen).block == 0 ? chosen : GgmlType::F16;
}

}  // namespace

size_t write_adapter_gguf(const std::string& adapter_dir, const std::string& base_dir, const std::string& out_path,
                          const AdapterOptions& options) {
  if (options.type != GgmlType::F32 && options.type != GgmlType::F16 && options.type != GgmlType::BF16 &&
      options.type != GgmlType::Q8_0)
    throw std::invalid_argument(std::string("a LoRA adapter GGUF is written in f32, f16, bf16 or q8_0, not ") +
                                type_info(options.type).name);
  const AdapterConfig adapter = io::naming_file((fs::path(adapter_dir) / "adapter_config.json").string(),
                                                [&] { return read_adapter_config(adapter_dir); });
  const models::DecoderConfig c = models::load_decoder_config(base_dir);
  const ArchPlan arch = plan_architecture(c, base_dir + "/config.json");
  const auto base = io::CheckpointDir::open(base_dir);
  const models::KeyLayout layout = models::key_layout_of(base, c);
  const auto f = io::SafetensorsFile::open((fs::path(adapter_dir) / "adapter_model.safetensors").string());
  const std::vector<Pair> pairs =
      pairs_of(f, c, layout, base_head_is_tied(c, adapter.base_name), adapter.target_parameters);
  const int64_t E = c.moe.num_experts, I = c.moe.inter;
  const bool fused_gate_up = c.family->gguf.fused_gate_up_exps;  // one ffn_gate_up_exps (gemma4)
  std::vector<TensorSpec> specs;
  for (const Pair& p : pairs) {
    if (p.expert) {
      const auto& a = f.info(p.a_key).shape;
      const auto& b = f.info(p.b_key).shape;
      const int64_t in = p.expert->gate_up ? c.hidden_size : I, out = p.expert->gate_up ? 2 * I : c.hidden_size;
      if (a.size() != 2 || b.size() != 2 || a[0] % E != 0 || a[1] != in || b[0] != out || b[1] != a[0])
        throw std::invalid_argument(f.path() + ": '" + p.a_key + "' / '" + p.b_key + "' are not a LoRA on " +
                                    std::to_string(E) + " experts' " + (p.expert->gate_up ? "gate_up_proj" : "down_proj") +
                                    " (A [r * " + std::to_string(E) + ", " + std::to_string(in) + "], B [" +
                                    std::to_string(out) + ", r * " + std::to_string(E) + "])");
      const int64_t r = a[0] / E;
      const std::string blk = "blk." + std::to_string(p.expert->layer) + ".";
      const std::vector<std::string> names = !p.expert->gate_up ? std::vector<std::string>{"ffn_down_exps"}
                                             : fused_gate_up ? std::vector<std::string>{"ffn_gate_up_exps"}
                                                             : std::vector<std::string>{"ffn_gate_exps", "ffn_up_exps"};
      for (const std::string& n : names) {
        const std::vector<int64_t> sa{E, r, in}, sb{E, p.expert->gate_up && !fused_gate_up ? I : out, r};
        specs.push_back({blk + n + ".weight.lora_a", sa, adapter_type(sa, options.type)});
        specs.push_back({blk + n + ".weight.lora_b", sb, adapter_type(sb, options.type)});
      }
      continue;
    }
    for (const auto& [key, suffix] : {std::pair{p.a_key, ".lora_a"}, std::pair{p.b_key, ".lora_b"}}) {
      const auto& shape = f.info(key).shape;
      specs.push_back({p.target.name + suffix, shape, adapter_type(shape, options.type)});
    }
  }
  std::string name = options.name;
  if (name.empty()) name = fs::path(base_dir).lexically_normal().filename().string();
  Metadata metadata = {{"general.architecture", Value::string(arch.arch)},
                       {"general.type", Value::string("adapter")},
                       {"general.name", Value::string(name)},
                       {"adapter.type", Value::string("lora")},
                       {"adapter.lora.alpha", Value::f32(static_cast<float>(adapter.alpha))}};
  Writer out(out_path, std::move(metadata), specs);
  size_t i = 0;
  const bool interleaved = c.family->architecture().experts && c.family->architecture().experts->transposed_interleaved;
  for (const Pair& p : pairs) {
    if (p.expert) {
      const at::Tensor a = f.tensor(p.a_key);  // [r * E, in], expert-major
      const int64_t r = a.size(0) / E;
      const at::Tensor a3 = a.reshape({E, r, a.size(1)});
      const at::Tensor b = f.tensor(p.b_key);  // [out, r * E], expert-minor
      const at::Tensor b3 = b.reshape({b.size(0), r, E}).permute({2, 0, 1});  // [E, out, r]
      if (p.expert->gate_up && !fused_gate_up) {
        for (int64_t half = 0; half < 2; ++half) {
          write_tensor(out, a3, specs[i++].type);
          // gpt-oss's gate_up interleaves gate's and up's rows (ExpertsRow::transposed_interleaved).
          const at::Tensor rows = interleaved ? b3.slice(1, half, 2 * I, 2) : b3.narrow(1, half * I, I);
          write_tensor(out, rows.contiguous(), specs[i++].type);
        }
      } else {
        write_tensor(out, a3, specs[i++].type);
        const at::Tensor scale =  // [E], or undefined
            p.expert->gate_up ? at::Tensor() : down_exps_scale(base, layout, c, p.expert->layer);
        write_tensor(out, (scale.defined() ? b3.to(at::kFloat) * scale.view({E, 1, 1}) : b3).contiguous(),
                     specs[i++].type);
      }
      continue;
    }
    // A's columns are W's columns, B's rows W's rows: each takes W's reordering along its own dimension.
    const auto& regroup = p.target.regroup;
    at::Tensor a = f.tensor(p.a_key);
    if (regroup && regroup->dim == 1) a = regroup_heads(a, *regroup);
    write_tensor(out, a, specs[i++].type);
    at::Tensor b = f.tensor(p.b_key);
    if (p.target.permute_heads > 0) b = unrotate(b, p.target.permute_heads);
    if (regroup && regroup->dim == 0) b = regroup_heads(b, *regroup);
    write_tensor(out, b, specs[i++].type);
  }
  out.commit();
  return specs.size();
}

}  // namespace qlora::gguf
