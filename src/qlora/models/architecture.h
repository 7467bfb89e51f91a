// The architecture table of a model family: what every other folder needs to know about the
// family's weights, written once. Config validation, loading, LoRA targets, sharding, the PEFT
// adapter and the merged export all read these rows instead of spelling projection names and
// Hugging Face keys themselves (llama.cpp's tensor-name table is the model). Each family's table is
// in its file (models/families/); what its compute does differently (soft-capping, sliding windows,
// (1 + w) norms) is read from its config (decoder_config.h), and which optional tensors a layer
// holds (biases, q/k norms, sandwich norms, fused projections) from these rows.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qlora/models/decoder_config.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/per_layer_inputs.h"

namespace qlora::models {

// A projection's sizes, named by the config value they come from, so one table serves every
// checkpoint of the family. Sizes are a layer's (DecoderConfig::layer_head_dim ...): Gemma 4's full
// attention layers and KV-shared layers have their own.
enum class Dim {
  kHidden,        // hidden_size
  kQHeads,        // num_attention_heads * head_dim
  kKvHeads,       // num_key_value_heads * head_dim
  kIntermediate,  // intermediate_size
  kVocab,         // vocab_size
  kHeadDim,       // head_dim (Qwen3 / Gemma 3 q_norm, k_norm)
  kQkv,           // (num_attention_heads + 2 * num_key_value_heads) * head_dim (Phi-3 qkv_proj)
  kGateUp,        // 2 * intermediate_size (Phi-3 gate_up_proj)
  kQHeadsGated,   // 2 * num_attention_heads * head_dim (Qwen3.5's q_proj: each head's query, then its gate)
  kLinearQkv,     // the Gated DeltaNet's q, k, v channels: 2 * key heads * key dim + value heads * value dim
  kLinearValue,   // linear_num_value_heads * linear_value_head_dim
  kLinearHeads,   // linear_num_value_heads (in_proj_b, in_proj_a, A_log, dt_bias)
  kLinearHeadDim, // linear_value_head_dim (the gated norm)
  kOne,           // 1 (the depthwise conv weight's input-channel dim)
  kConvKernel,    // linear_conv_kernel_dim
  kPerLayer,       // hidden_size_per_layer_input (Gemma 4)
  kPerLayerAll,    // num_hidden_layers * hidden_size_per_layer_input
  kPerLayerVocab,  // vocab_size_per_layer_input
  kExperts,        // the MoE's expert count (Gemma 4's router.per_expert_scale)
  kHeads,          // num_attention_heads (gpt-oss's attention sinks)
};

// Which layers hold a row: every layer, or only those whose mixer is attention or (Qwen3.5) the
// Gated DeltaNet (DecoderConfig::is_linear); Gemma 4's attention layers with K/V of their own (not
// KV-shared), those with a V of their own too (not full layers under attention_k_eq_v), and every
// layer when the model has per-layer inputs.
// kDenseMlp: layers whose feed-forward is the gated MLP, not a Mixture of Experts (DecoderConfig::is_moe);
// kMoe: the MoE layers (Gemma 4's router scales and MoE norms).
enum class Mixer { kAny, kAttention, kLinear, kOwnKv, kOwnV, kPerLayerInput, kDenseMlp, kMoe };

// Whether a projection has a (frozen) bias, <module>.bias.
enum class Bias {
  kNone,
  kAlways,           // Qwen2's q/k/v
  kIfAttentionBias,  // the attention projections of families with an attention_bias key
};

struct ProjectionRow {
  const char* short_name;  // what configs write in lora.targets: "q" ... "down", "output"
  const char* peft_name;   // module and PEFT target name: "q_proj" ... "down_proj", "lm_head"
  // The HF module path, "{i}" standing for the layer index. The path, not the weight key, is
  // what the rows share: the weight is <module>.weight, a bias (Qwen2) would be <module>.bias,
  // and PEFT's adapter keys are base_model.model.<module>.lora_{A,B}.weight.
  const char* hf_module;
  // The DecoderLayer member holding it; null for the output projection, which the model holds.
  modules::LoraLinear modules::DecoderLayer::*member;
  Dim out, in;  // the weight is [out, in]
  // For a fused projection (Phi-3's qkv_proj stacks q, k, v; gate_up_proj stacks gate, up): the
  // short names of the parts it stacks along its output dimension, in order, so the forward can
  // split its output and a config may target the fused module. Empty for a plain projection, as
  // every Llama row is.
  std::vector<const char*> fused_parts;
  Bias bias = Bias::kNone;
  Mixer mixer = Mixer::kAny;
  // A LoRA target that names every row of its group at once ("shared_expert": Qwen3.5-MoE's shared
  // expert's gate, up and down); null: none.
  const char* group = nullptr;
};

// A layer's frozen dense tensor: a norm weight, or (Qwen3.5's DeltaNet) its conv weight, A_log, dt_bias.
struct NormRow {
  const char* name;       // "input_layernorm": its name inside a layer (shard-group member names)
  const char* hf_module;  // "model.layers.{i}.input_layernorm"; the weight is <module>.weight
  at::Tensor modules::DecoderLayer::*member;
  Dim size = Dim::kHidden;  // the weight is [size] or, with rank 3, [size, tail[0], tail[1]]
  Mixer mixer = Mixer::kAny;
  bool bare = false;  // the key is hf_module itself, a parameter rather than a module (A_log)
  int rank = 1;       // 3: a conv weight
  // A fixed array, not a vector: the rows are constexpr namespace-scope constants, which other
  // files' static initialisers read (a dynamically initialised row could still be zeros then).
  Dim tail[2] = {Dim::kOne, Dim::kOne};
};

// A frozen model tensor of the embedding unit besides embed_tokens (Gemma 4's per-layer inputs).
struct EmbedRow {
  const char* name;    // "per_layer_model_projection": its name in the embedding unit's shard group
  const char* hf_key;  // "model.per_layer_model_projection.weight"
  at::Tensor modules::PerLayerInputs::*member;
  std::vector<Dim> shape;
  // Kept in host memory as the checkpoint stores it, never sharded or gathered: a table of which a
  // step reads only its batch's rows.
  bool host = false;
};

// A MoE layer's router and routed experts as a checkpoint holds them, "{i}" the layer index, in
// either of two layouts (both are read; a merged export keeps the checkpoint's):
// - one tensor per expert and projection, <split>.<e>.<gate|up|down>.weight ([inter, hidden] x2,
//   [hidden, inter]) beside the router <split_router>.weight [experts, hidden]: the Hub's Qwen3-MoE
//   and Mixtral, and what transformers 5 writes for them;
// - fused 3-D tensors, <fused>.gate_up_proj [E, 2 * inter, hidden] (gate's rows, then up's) and
//   <fused>.down_proj [E, hidden, inter], beside <fused_router>.weight: transformers 5's own modules.
struct ExpertsRow {
  const char* split_router;  // "model.layers.{i}.mlp.gate" (Mixtral: block_sparse_moe.gate)
  const char* split;         // "model.layers.{i}.mlp.experts" (Mixtral: block_sparse_moe.experts)
  const char* gate;          // "gate_proj" (Mixtral: "w1")
  const char* up;            // "up_proj" (Mixtral: "w3")
  const char* down;          // "down_proj" (Mixtral: "w2")
  const char* fused_router;  // "model.layers.{i}.mlp.gate"
  const char* fused;         // "model.layers.{i}.mlp.experts"
  // gpt-oss: its fused tensors as its module holds them, transposed (gate_up_proj [E, hidden, 2 * inter],
  // down_proj [E, inter, hidden]) with gate's and up's columns interleaved (gate's the even ones), the
  // only layout it has; loaded into the layout above, written back in its own.
  bool transposed_interleaved = false;
  // gpt-oss: per-expert biases <fused>.gate_up_proj_bias [E, 2 * inter] (ordered as gate_up_proj's
  // columns) and <fused>.down_proj_bias [E, hidden], and the router's bias <fused_router>.bias [E].
  bool biases = false;
};

struct Architecture {
  const char* family;  // its family's name, for messages ("olmo2" for OLMo 2 and 3, which share it)
  // A decoder layer's projections in forward order (the order adapters are initialised, exported
  // and sharded in), then the output projection.
  std::vector<ProjectionRow> projections;
  std::vector<NormRow> layer_norms;  // in checkpoint order
  const char* embed_key;             // "model.embed_tokens.weight"
  const char* final_norm_key;        // "model.norm.weight"
  // Held when the config has per-layer inputs (DecoderConfig::per_layer_input_dim); empty for most.
  std::vector<EmbedRow> embed_rows = {};
  // A MoE family's router and experts, held by the layers DecoderConfig::is_moe names.
  std::optional<ExpertsRow> experts = std::nullopt;
};

// Llama-2, Llama-3/3.1 and Mistral (same weights; Mistral differs only in config values):
// families/llama_mistral.cpp.
const Architecture& llama_architecture();
// The table of a config's family.
const Architecture& architecture_of(const DecoderConfig& config);

// Whether the row's projection has a bias under this config.
bool has_bias(const ProjectionRow& row, const DecoderConfig& config);
// The PEFT names of LoRA targets given in either spelling. A fused projection (Phi-3's qkv_proj)
// is targeted by its own name or by naming all its parts (q, k, v); naming only some parts is an
// error saying which module fuses them. Unknown names: std::invalid_argument naming the allowed.
std::vector<std::string> peft_targets(const Architecture& arch, const std::vector<std::string>& names);
// The LoRA target of a MoE layer's routed experts (every expert's gate/up and down), in both spellings.
inline constexpr const char* kExpertsTarget = "experts";

// Whether `name` is a LoRA target (short spelling) of some family: what a config can check before
// it knows the checkpoint's family.
bool is_known_target(const std::string& name);
// Every family's short target names, for messages.
std::string known_target_names();

// hf_module with "{i}" replaced by the layer index (patterns without "{i}" come back as they are).
std::string hf_module(const char* pattern, int64_t layer);
// The weight keys: "model.layers.3.self_attn.q_proj.weight", "lm_head.weight", ...
std::string hf_key(const ProjectionRow& row, int64_t layer);
std::string hf_key(const NormRow& row, int64_t layer);
// "model.layers.3.self_attn.q_proj.bias" (for rows with has_bias).
std::string hf_bias_key(const ProjectionRow& row, int64_t layer);

// The output projection's row (the one no layer holds).
const ProjectionRow& output_projection(const Architecture& arch);
// The row a LoRA target names, in its short ("q") or PEFT ("q_proj") spelling; nullptr if none.
const ProjectionRow* find_projection(const Architecture& arch, const std::string& name);
// The PEFT name of a target in either spelling; std::invalid_argument naming the allowed values
// for anything else.
std::string peft_target(const Architecture& arch, const std::string& name);
// "q, k, v, o, gate, up, down, output" (short spelling) or "q_proj, ..., lm_head", for messages.
std::string projection_names(const Architecture& arch, bool peft_spelling);
// The PEFT names of a layer's projections in table order: every LoRA target but the output one.
std::vector<std::string> layer_peft_names(const Architecture& arch);

// A layer's projections in table order (the output projection is not a layer's).
std::vector<modules::LoraLinear*> layer_projections(const Architecture& arch, modules::DecoderLayer& layer);
std::vector<const modules::LoraLinear*> layer_projections(const Architecture& arch,
                                                          const modules::DecoderLayer& layer);

// Whether layer `layer` holds a row of this mixer under `config`.
bool in_layer(Mixer mixer, const DecoderConfig& config, int64_t layer);
// [size, tail...] of layer `layer`'s tensor under a config.
std::vector<int64_t> norm_shape(const NormRow& row, const DecoderConfig& config, int64_t layer);
// An embedding-unit tensor's shape; whether the config holds it.
std::vector<int64_t> embed_shape(const EmbedRow& row, const DecoderConfig& config);
bool has_embed_rows(const DecoderConfig& config);

// Size of a Dim in layer `layer` under a config (the output projection: any layer, e.g. 0).
int64_t dim_size(Dim d, const DecoderConfig& config, int64_t layer);
// [out, in] of layer `layer`'s projection under a config.
std::vector<int64_t> projection_shape(const ProjectionRow& row, const DecoderConfig& config, int64_t layer);

}  // namespace qlora::models
