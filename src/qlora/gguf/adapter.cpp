#include "qlora/gguf/adapter.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "qlora/gguf/arch.h"
#include "qlora/gguf/tensor_data.h"
#include "qlora/gguf/writer.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/read_file.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/key_layout.h"
#include "qlora/models/decoder_config.h"

namespace qlora::gguf {
namespace {
namespace fs = std::filesystem;

struct AdapterConfig {
  double alpha;           // llama.cpp's alpha (it multiplies by alpha / r)
  std::string base_name;  // base_model_name_or_path; empty when absent
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
  return {c.value("use_rslora", false) ? alpha * std::sqrt(r) : alpha,  // alpha / sqrt(r) == (alpha sqrt(r)) / r
          base.is_string() ? base.get<std::string>() : ""};
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

struct Pair {
  std::string a_key, b_key;  // in adapter_model.safetensors
  TensorPlan target;         // the adapted matrix's GGUF name and row order
};

// The adapter's A/B pairs in file order of their A, each with the matrix it adapts.
// A LoRA on a tied head is refused: llama.cpp finds no output.weight in the base's GGUF to apply it to
// (llama-cpp-python 0.3.36 crashed on the first decode with one), while the merged model holds it.
std::vector<Pair> pairs_of(const io::SafetensorsFile& f, const models::DecoderConfig& c, models::KeyLayout layout,
                           bool tied_head) {
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
  const models::KeyLayout layout = models::key_layout_of(io::CheckpointDir::open(base_dir), c);
  const auto f = io::SafetensorsFile::open((fs::path(adapter_dir) / "adapter_model.safetensors").string());
  const std::vector<Pair> pairs = pairs_of(f, c, layout, base_head_is_tied(c, adapter.base_name));
  std::vector<TensorSpec> specs;
  for (const Pair& p : pairs) {
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
  for (const Pair& p : pairs) {
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
