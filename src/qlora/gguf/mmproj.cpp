#include "qlora/gguf/mmproj.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>

#include "qlora/gguf/tensor_data.h"
#include "qlora/gguf/writer.h"
#include "qlora/images/processor.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/read_file.h"
#include "qlora/models/config_json.h"

namespace qlora::gguf {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;
namespace cfg = models::cfg;

enum class Tower { qwen3_5, gemma3, gemma4 };

// What happens to a checkpoint tensor on its way into the file.
enum class Op {
  copy,
  frame0,      // Qwen's conv3d [H, C, 2, p, p]: the first frame's kernel [H, C, p, p]
  frame1,      // ... the second's
  plus_one,    // Gemma 3's RMSNorm weight, which HF applies as (1 + w)
  hwc_kernel,  // Gemma 4's patch projection [H, p * p * 3] (row, column, channel) as a [H, 3, p, p] kernel
  scalar,      // a 0-d clamp bound as a [1] tensor
};

struct MmTensor {
  std::string name, key;
  Op op = Op::copy;
  bool f32 = false;  // kept in f32 whatever the file's type
};

struct MmPlan {
  Metadata metadata;
  std::vector<MmTensor> tensors;
};

// The checkpoint's keys under one part of the model: the first of `candidates` (the layouts the Hub and
// transformers write: "model.visual." or "visual.", ...) under which `probe` exists.
class Keys {
 public:
  Keys(const io::CheckpointDir& ckpt, const std::vector<std::string>& candidates, const std::string& probe)
      : ckpt_(ckpt) {
    for (const std::string& c : candidates)
      if (ckpt.contains(c + probe)) {
        prefix_ = c;
        return;
      }
    std::string tried;
    for (const std::string& c : candidates) tried += (tried.empty() ? "'" : ", '") + c + probe + "'";
    throw std::invalid_argument(ckpt.path() + ": no vision tower tensor " + tried);
  }
  bool has(const std::string& rel) const { return ckpt_.contains(prefix_ + rel); }
  std::string operator()(const std::string& rel) const {
    if (!has(rel)) throw std::invalid_argument(ckpt_.path() + ": no tensor '" + prefix_ + rel + "': the vision tower is incomplete");
    return prefix_ + rel;
  }

 private:
  const io::CheckpointDir& ckpt_;
  std::string prefix_;
};

std::optional<Tower> tower_of(const json& c) {
  if (!c.is_object() || !c.contains("vision_config") || !c["vision_config"].is_object()) return std::nullopt;
  const std::string type = c.value("model_type", json()).is_string() ? c["model_type"].get<std::string>() : "";
  if (type == "qwen3_5" || type == "qwen3_5_moe") return Tower::qwen3_5;
  if (type == "gemma3") return Tower::gemma3;
  if (type == "gemma4") return Tower::gemma4;
  return std::nullopt;
}

json read_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  const auto text = io::read_file(path);
  if (!text) throw std::invalid_argument(path + ": cannot read the checkpoint's config.json");
  json c = json::parse(*text, nullptr, false);
  if (!c.is_object()) throw std::invalid_argument(path + ": not a JSON object");
  return c;
}

struct VisionShape {
  int64_t image_size, patch, hidden, ff, blocks, heads;
  double eps;
  int64_t projection;  // the language model's width
};

// clip.vision.* as llama.cpp's clip loader reads them (integers u32, the epsilon f32, mean/std f32 arrays).
Metadata vision_metadata(const VisionShape& s, const images::ProcessorRules& rules) {
  auto u32 = [](int64_t v) { return Value::u32(static_cast<uint32_t>(v)); };
  const auto& m = rules.image_mean;
  const auto& d = rules.image_std;
  return {{"clip.has_vision_encoder", Value::boolean(true)},
          {"clip.vision.image_size", u32(s.image_size)},
          {"clip.vision.patch_size", u32(s.patch)},
          {"clip.vision.embedding_length", u32(s.hidden)},
          {"clip.vision.feed_forward_length", u32(s.ff)},
          {"clip.vision.block_count", u32(s.blocks)},
          {"clip.vision.attention.head_count", u32(s.heads)},
          {"clip.vision.attention.layer_norm_epsilon", Value::f32(static_cast<float>(s.eps))},
          {"clip.vision.projection_dim", u32(s.projection)},
          {"clip.vision.image_mean", Value::f32_array({float(m[0]), float(m[1]), float(m[2])})},
          {"clip.vision.image_std", Value::f32_array({float(d[0]), float(d[1]), float(d[2])})}};
}

// <gguf>.weight and .bias from the model's <rel>.weight and .bias.
void add_weight_bias(std::vector<MmTensor>& out, const Keys& k, const std::string& gguf, const std::string& rel) {
  out.push_back({gguf + ".weight", k(rel + ".weight")});
  out.push_back({gguf + ".bias", k(rel + ".bias")});
}

MmPlan qwen3_5_plan(const json& c, const std::string& where, const io::CheckpointDir& ckpt,
                    const images::ProcessorRules& rules) {
  const Keys k(ckpt, {"model.visual.", "visual."}, "patch_embed.proj.weight");
  const json& v = c["vision_config"];
  const int64_t patch = cfg::get_int(v, "patch_size", where), positions = cfg::get_int(v, "num_position_embeddings", where);
  const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(positions))));
  if (side * side != positions)
    throw std::invalid_argument(where + ": vision_config.num_position_embeddings " + std::to_string(positions) +
                                " is not a square grid");
  if (cfg::get_int(v, "temporal_patch_size", where) != 2)
    throw std::invalid_argument(where + ": vision_config.temporal_patch_size must be 2 for llama.cpp's mmproj");
  const int64_t blocks = cfg::get_int(v, "depth", where);
  // HF's tower LayerNorms are built with eps 1e-6 whatever the config says.
  MmPlan p{vision_metadata({side * patch, patch, cfg::get_int(v, "hidden_size", where),
                            cfg::get_int(v, "intermediate_size", where), blocks, cfg::get_int(v, "num_heads", where),
                            1e-6, cfg::get_int(v, "out_hidden_size", where)}, rules), {}};
  p.metadata.push_back({"clip.projector_type", Value::string("qwen3vl_merger")});
  p.metadata.push_back({"clip.use_gelu", Value::boolean(true)});
  p.metadata.push_back({"clip.vision.spatial_merge_size", Value::u32(cfg::get_int(v, "spatial_merge_size", where))});
  auto& t = p.tensors;
  t.push_back({"v.patch_embd.weight", k("patch_embed.proj.weight"), Op::frame0, true});
  t.push_back({"v.patch_embd.weight.1", k("patch_embed.proj.weight"), Op::frame1, true});
  t.push_back({"v.patch_embd.bias", k("patch_embed.proj.bias"), Op::copy, true});
  t.push_back({"v.position_embd.weight", k("pos_embed.weight"), Op::copy, true});
  for (int64_t i = 0; i < blocks; ++i) {
    const std::string g = "v.blk." + std::to_string(i) + ".", h = "blocks." + std::to_string(i) + ".";
    for (const auto& [to, from] : {std::pair{"attn_qkv", "attn.qkv"}, {"attn_out", "attn.proj"}, {"ln1", "norm1"},
                                   {"ln2", "norm2"}, {"ffn_up", "mlp.linear_fc1"}, {"ffn_down", "mlp.linear_fc2"}})
      add_weight_bias(t, k, g + to, h + from);
  }
  add_weight_bias(t, k, "v.post_ln", "merger.norm");
  add_weight_bias(t, k, "mm.0", "merger.linear_fc1");
  add_weight_bias(t, k, "mm.2", "merger.linear_fc2");
  return p;
}

MmPlan gemma3_plan(const json& c, const std::string& where, const io::CheckpointDir& ckpt,
                   const images::ProcessorRules& rules) {
  const Keys k(ckpt, {"vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                      "model.vision_tower."}, "post_layernorm.weight");
  const Keys mm(ckpt, {"multi_modal_projector.", "model.multi_modal_projector."}, "mm_soft_emb_norm.weight");
  const json& v = c["vision_config"];
  const int64_t image = cfg::get_int(v, "image_size", where), patch = cfg::get_int(v, "patch_size", where);
  const int64_t tokens = cfg::get_int(c, "mm_tokens_per_image", where, 256);
  const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(tokens))));
  if (side * side != tokens || patch <= 0 || (image / patch) % side != 0)
    throw std::invalid_argument(where + ": mm_tokens_per_image " + std::to_string(tokens) +
                                " does not pool the tower's patch grid evenly");
  const int64_t blocks = cfg::get_int(v, "num_hidden_layers", where);
  MmPlan p{vision_metadata({image, patch, cfg::get_int(v, "hidden_size", where),
                            cfg::get_int(v, "intermediate_size", where), blocks,
                            cfg::get_int(v, "num_attention_heads", where), cfg::get_num(v, "layer_norm_eps", where, 1e-6),
                            cfg::get_int(c["text_config"], "hidden_size", where)}, rules), {}};
  p.metadata.push_back({"clip.projector_type", Value::string("gemma3")});
  p.metadata.push_back({"clip.use_gelu", Value::boolean(true)});
  if ((image / patch) / side != 4)  // llama.cpp assumes the checkpoints' 4 x 4 pooling otherwise
    p.metadata.push_back({"clip.vision.projector.scale_factor", Value::u32((image / patch) / side)});
  auto& t = p.tensors;
  t.push_back({"v.patch_embd.weight", k("embeddings.patch_embedding.weight"), Op::copy, true});
  t.push_back({"v.patch_embd.bias", k("embeddings.patch_embedding.bias"), Op::copy, true});
  t.push_back({"v.position_embd.weight", k("embeddings.position_embedding.weight"), Op::copy, true});
  for (int64_t i = 0; i < blocks; ++i) {
    const std::string g = "v.blk." + std::to_string(i) + ".", h = "encoder.layers." + std::to_string(i) + ".";
    for (const auto& [to, from] : {std::pair{"attn_q", "self_attn.q_proj"}, {"attn_k", "self_attn.k_proj"},
                                   {"attn_v", "self_attn.v_proj"}, {"attn_out", "self_attn.out_proj"},
                                   {"ln1", "layer_norm1"}, {"ln2", "layer_norm2"}, {"ffn_up", "mlp.fc1"},
                                   {"ffn_down", "mlp.fc2"}})
      add_weight_bias(t, k, g + to, h + from);
  }
  add_weight_bias(t, k, "v.post_ln", "post_layernorm");
  t.push_back({"mm.input_projection.weight", mm("mm_input_projection_weight")});
  t.push_back({"mm.soft_emb_norm.weight", mm("mm_soft_emb_norm.weight"), Op::plus_one, true});
  return p;
}

MmPlan gemma4_plan(const json& c, const std::string& where, const io::CheckpointDir& ckpt,
                   const images::ProcessorRules& rules) {
  const Keys k(ckpt, {"model.vision_tower.", "vision_tower."}, "patch_embedder.input_proj.weight");
  const Keys mm(ckpt, {"model.embed_vision.", "embed_vision."}, "embedding_projection.weight");
  const json& v = c["vision_config"];
  const int64_t blocks = cfg::get_int(v, "num_hidden_layers", where), hidden = cfg::get_int(v, "hidden_size", where);
  const int64_t heads = cfg::get_int(v, "num_attention_heads", where), head_dim = cfg::get_int(v, "head_dim", where);
  // image_size is unused by llama.cpp for this projector (its converter writes 224).
  MmPlan p{vision_metadata({224, cfg::get_int(v, "patch_size", where), hidden, cfg::get_int(v, "intermediate_size", where),
                            blocks, heads, cfg::get_num(v, "rms_norm_eps", where, 1e-6),
                            cfg::get_int(c["text_config"], "hidden_size", where)}, rules), {}};
  p.metadata.push_back({"clip.vision.projector_type", Value::string("gemma4v")});
  p.metadata.push_back({"clip.use_gelu", Value::boolean(true)});  // HF: gelu_pytorch_tanh
  if (const int64_t kv = cfg::get_int(v, "num_key_value_heads", where, heads); kv != heads)
    p.metadata.push_back({"clip.vision.attention.head_count_kv", Value::u32(static_cast<uint32_t>(kv))});
  if (heads * head_dim != hidden)
    p.metadata.push_back({"clip.vision.attention.head_dim", Value::u32(static_cast<uint32_t>(head_dim))});
  if (const int64_t pool = cfg::get_int(v, "pooling_kernel_size", where, 3); pool != 3)
    p.metadata.push_back({"clip.vision.projector.scale_factor", Value::u32(static_cast<uint32_t>(pool))});
  auto& t = p.tensors;
  t.push_back({"v.patch_embd.weight", k("patch_embedder.input_proj.weight"), Op::hwc_kernel, true});
  t.push_back({"v.position_embd.weight", k("patch_embedder.position_embedding_table"), Op::copy, true});
  for (int64_t i = 0; i < blocks; ++i) {
    const std::string g = "v.blk." + std::to_string(i) + ".";
    const std::string h = "encoder.layers." + std::to_string(i) + ".";
    for (const auto& [to, from] : {std::pair{"attn_q", "self_attn.q_proj"}, {"attn_k", "self_attn.k_proj"},
                                   {"attn_v", "self_attn.v_proj"}, {"attn_out", "self_attn.o_proj"},
                                   {"ffn_gate", "mlp.gate_proj"}, {"ffn_up", "mlp.up_proj"},
                                   {"ffn_down", "mlp.down_proj"}}) {
      t.push_back({g + to + ".weight", k(h + from + ".linear.weight")});
      for (const char* bound : {"input_min", "input_max", "output_min", "output_max"})
        if (k.has(h + from + "." + bound))
          t.push_back({g + to + "." + bound, k(h + from + "." + bound), Op::scalar, true});
    }
    for (const auto& [to, from] : {std::pair{"attn_q_norm", "self_attn.q_norm"}, {"attn_k_norm", "self_attn.k_norm"},
                                   {"ln1", "input_layernorm"}, {"attn_post_norm", "post_attention_layernorm"},
                                   {"ln2", "pre_feedforward_layernorm"}, {"ffn_post_norm", "post_feedforward_layernorm"}})
      t.push_back({g + to + ".weight", k(h + from + ".weight"), Op::copy, true});
  }
  for (const char* s : {"std_bias", "std_scale"})
    if (k.has(s)) t.push_back({std::string("v.") + s, k(s), Op::copy, true});
  t.push_back({"mm.input_projection.weight", mm("embedding_projection.weight")});
  return p;
}

at::Tensor planned(const at::Tensor& x, Op op) {
  switch (op) {
    case Op::copy: return x;
    case Op::frame0: return x.select(2, 0);
    case Op::frame1: return x.select(2, 1);
    case Op::plus_one: return x.to(at::kFloat) + 1.0;
    case Op::scalar: return x.reshape({1});
    case Op::hwc_kernel: {
      const int64_t h = x.size(0), p = static_cast<int64_t>(std::llround(std::sqrt(x.size(1) / 3.0)));
      return x.reshape({h, p, p, 3}).permute({0, 3, 1, 2}).contiguous();
    }
  }
  return x;
}

std::vector<int64_t> planned_shape(const std::vector<int64_t>& s, Op op, const std::string& key,
                                   const std::string& where) {
  switch (op) {
    case Op::frame0:
    case Op::frame1:
      if (s.size() != 5 || s[2] != 2)
        throw std::invalid_argument(where + ": '" + key + "' is not a conv3d kernel [H, C, 2, p, p]");
      return {s[0], s[1], s[3], s[4]};
    case Op::scalar: return {1};
    case Op::hwc_kernel: {
      const auto p = s.size() == 2 ? static_cast<int64_t>(std::llround(std::sqrt(s[1] / 3.0))) : 0;
      if (s.size() != 2 || p * p * 3 != s[1])
        throw std::invalid_argument(where + ": '" + key + "' is not a patch projection [H, p * p * 3]");
      return {s[0], 3, p, p};
    }
    default: return s;
  }
}

struct Prepared {
  MmPlan plan;
  std::vector<TensorSpec> specs;
};

Prepared prepare(const io::CheckpointDir& ckpt, const std::string& dir, const ConvertOptions& options) {
  if (options.type != GgmlType::F32 && options.type != GgmlType::F16 && options.type != GgmlType::BF16)
    throw std::invalid_argument(std::string("mmproj: type ") + type_info(options.type).option +
                                " is not one llama.cpp reads a vision tower in here (f32, f16, bf16)");
  const std::string where = (fs::path(dir) / "config.json").string();
  const json c = read_config(dir);
  const auto tower = tower_of(c);
  if (!tower)
    throw std::invalid_argument(where + ": not a vision-language checkpoint with a tower llama.cpp reads (Qwen3.5, "
                                "Qwen3.5-MoE, Gemma 3, Gemma 4 with a vision_config)");
  const images::ProcessorRules rules = images::read_processor_rules(dir);
  Prepared out;
  out.plan = *tower == Tower::qwen3_5 ? qwen3_5_plan(c, where, ckpt, rules)
           : *tower == Tower::gemma3  ? gemma3_plan(c, where, ckpt, rules)
                                      : gemma4_plan(c, where, ckpt, rules);
  for (const MmTensor& t : out.plan.tensors) {
    const std::vector<int64_t> shape = planned_shape(ckpt.file_of(t.key).info(t.key).shape, t.op, t.key, ckpt.path());
    const bool f32 = t.f32 || shape.size() <= 1;
    out.specs.push_back({t.name, shape, f32 ? GgmlType::F32 : options.type});
  }
  Metadata m = general_metadata("clip", "mmproj", options, dir);
  for (auto& kv : out.plan.metadata) m.push_back(std::move(kv));
  out.plan.metadata = std::move(m);
  return out;
}

}  // namespace

bool has_mmproj(const std::string& dir, std::string* why_not) {
  const auto text = io::read_file((fs::path(dir) / "config.json").string());
  if (!text || !tower_of(json::parse(*text, nullptr, false))) return false;
  if (images::has_processor_rules(dir)) return true;
  if (why_not)
    *why_not = dir + " has a vision tower but no preprocessor_config.json (nor a processor_config.json with an "
               "\"image_processor\" section): no mmproj GGUF is written for it, since llama.cpp needs the image "
               "mean and std; copy the model's processor files beside its config.json to get one";
  return false;
}

void check_mmproj(const std::string& dir) {
  ConvertOptions o;
  prepare(io::CheckpointDir::open(dir), dir, o);
}

size_t write_mmproj(const std::string& dir, const std::string& out_path, const ConvertOptions& options) {
  const io::CheckpointDir ckpt = io::CheckpointDir::open(dir);
  Prepared p = prepare(ckpt, dir, options);
  Writer out(out_path, std::move(p.plan.metadata), p.specs);
  for (size_t i = 0; i < p.specs.size(); ++i) {
    const MmTensor& t = p.plan.tensors[i];
    write_tensor(out, planned(ckpt.tensor(t.key), t.op), p.specs[i].type);
    ckpt.file_of(t.key).release(t.key);
  }
  out.commit();
  return p.specs.size();
}

}  // namespace qlora::gguf
