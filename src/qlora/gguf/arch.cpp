#include "qlora/gguf/arch.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <regex>
#include <stdexcept>

namespace qlora::gguf {
namespace {

using models::Family;
using models::DecoderConfig;

const char* arch_name(Family f) {
  switch (f) {
    case Family::kLlama: return "llama";
    case Family::kQwen2: return "qwen2";
    case Family::kQwen3: return "qwen3";
    case Family::kGemma2: return "gemma2";
    case Family::kGemma3: return "gemma3";
    case Family::kPhi3: return "phi3";
    case Family::kSmolLM3: return "smollm3";
    case Family::kOlmo2: return "olmo2";
    case Family::kQwen35: return "qwen35";
    case Family::kGemma4: return "gemma4";
  }
  throw std::logic_error("arch_name: unknown family");
}


// A refusal: the config key, what it holds, and why llama.cpp would compute something else.
[[noreturn]] void refuse(const std::string& where, const DecoderConfig& c, const std::string& key,
                         const std::string& why) {
  throw std::invalid_argument(where + ": config key '" + key + "': " + why + "; llama.cpp's " +
                              arch_name(c.family) + " architecture would compute a different model, so no GGUF "
                              "is written");
}

// Which layers llama.cpp slides on, for the architectures that fix it (gemma2: even layers; gemma3:
// five of every six); "" when the config's layers are those.
std::string sliding_mismatch(const DecoderConfig& c, int64_t period) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.is_sliding(i) != (i % period < period - 1))
      return "layer " + std::to_string(i) + " is " + (c.is_sliding(i) ? "sliding" : "full") +
             " attention where llama.cpp makes every layer i with i % " + std::to_string(period) + " < " +
             std::to_string(period - 1) + " sliding and the others full";
  }
  return "";
}

void check_activation_and_biases(const DecoderConfig& c, const std::string& where) {
  const bool gelu = c.activation == models::MlpActivation::kGeluTanh;
  if (gelu != models::is_any_gemma(c.family))
    refuse(where, c, "hidden_act", std::string("the MLP activation is ") + (gelu ? "gelu_pytorch_tanh" : "silu") +
                                       ", the architecture's is the other one");
  if (c.attention_bias) refuse(where, c, "attention_bias", "llama.cpp loads no attention biases for this family");
}

// llama.cpp's olmo2 (OLMo 2 and 3): an untied head, head_dim = hidden / heads, and OLMo 3's window
// on three of every four layers.
void check_olmo(const DecoderConfig& c, const std::string& where) {
  if (c.tie_word_embeddings) refuse(where, c, "tie_word_embeddings", "true: llama.cpp's olmo2 loads its own output head");
  if (c.head_dim * c.num_attention_heads != c.hidden_size)
    refuse(where, c, "head_dim", "llama.cpp's olmo2 takes head_dim = hidden_size / num_attention_heads");
  if (!c.sliding_window) return;
  const modules::RopeParams local = c.local_rope.value_or(c.rope());
  if (local.theta != c.rope_theta || local.linear_factor != 1.0 || local.llama3 || local.yarn)
    refuse(where, c, "rope_parameters", "llama.cpp's olmo2 gives sliding layers the full layers' RoPE base, unscaled");
  const std::string pattern = sliding_mismatch(c, 4);
  if (!pattern.empty()) refuse(where, c, "layer_types", pattern);
}

// llama.cpp's smollm3 leaves RoPE out of every fourth layer ((i + 1) % 4 == 0), whatever the
// config says (the file has no key for it).
void check_nope(const DecoderConfig& c, const std::string& where) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const bool nope = (i + 1) % 4 == 0;
    if (c.uses_rope(i) == nope)
      refuse(where, c, "no_rope_layers", "layer " + std::to_string(i) + (nope ? " rotates" : " has no RoPE") +
                                             " where llama.cpp leaves RoPE out of every fourth layer only");
  }
}

void check_rope(const DecoderConfig& c, const std::string& where) {
  // YaRN: llama.cpp's olmo2 applies it to the full layers only, as OLMo 3 does; ggml rounds the
  // ramp's ends outward to whole dimensions, as transformers' truncate does.
  if (c.rope_yarn && c.family != Family::kOlmo2)
    refuse(where, c, "rope_parameters", "YaRN RoPE scaling is written for OLMo 3 (llama.cpp's olmo2) only");
  if (c.rope_yarn && !c.rope_yarn->truncate)
    refuse(where, c, "rope_parameters.truncate", "false: ggml's YaRN rounds the ramp's ends to whole dimensions");
  // llama.cpp takes the betas from its context parameters (32 and 1 unless a user sets them), not the file.
  if (c.rope_yarn && (c.rope_yarn->beta_fast != 32.0 || c.rope_yarn->beta_slow != 1.0))
    refuse(where, c, c.rope_yarn->beta_fast != 32.0 ? "rope_parameters.beta_fast" : "rope_parameters.beta_slow",
           "llama.cpp's YaRN ramp runs between beta_fast 32 and beta_slow 1 whatever the file says");
  if (c.rope_scaling && c.family != Family::kLlama)
    refuse(where, c, "rope_scaling", "llama3 RoPE scaling is read by llama.cpp's llama architecture only");
  const bool linear_ok = c.family == Family::kLlama || c.family == Family::kQwen2 || c.family == Family::kQwen3 ||
                         c.family == Family::kGemma3;
  if (c.rope_linear_factor != 1.0 && !linear_ok)
    refuse(where, c, "rope_scaling", "linear RoPE scaling is not written for this family");
}

void check_gemma(const DecoderConfig& c, const std::string& where) {
  // llama.cpp's gemma3 (and gemma4) read an output.weight where the file has one, the embedding
  // otherwise; its gemma2 always multiplies by the embedding.
  if (c.family == Family::kGemma2 && !c.tie_word_embeddings)
    refuse(where, c, "tie_word_embeddings", "false: llama.cpp's gemma2 loads no output head of its own (it multiplies "
                                            "by the embedding)");
  // llama.cpp scales queries by head_dim^-0.5, or by (hidden / heads)^-0.5 when it takes the model
  // for the 27B (by its layer count), whatever query_pre_attn_scalar says.
  const int64_t layers_27b = c.family == Family::kGemma2 ? 46 : 62;
  const double scalar = c.num_hidden_layers == layers_27b ? static_cast<double>(c.hidden_size / c.num_attention_heads)
                                                          : static_cast<double>(c.head_dim);
  if (c.query_pre_attn_scalar && *c.query_pre_attn_scalar != scalar)
    refuse(where, c, "query_pre_attn_scalar",
           std::to_string(*c.query_pre_attn_scalar) + " where llama.cpp scales queries by " +
               std::to_string(scalar) + "^-0.5");
  const std::string pattern = sliding_mismatch(c, c.family == Family::kGemma2 ? 2 : 6);
  if (!pattern.empty()) refuse(where, c, "layer_types", pattern);
  if (!c.sliding_window) refuse(where, c, "sliding_window", "null: llama.cpp's Gemma always has sliding layers");
  if (c.family == Family::kGemma2) {
    if (!c.attn_logit_softcapping)
      refuse(where, c, "attn_logit_softcapping", "null: llama.cpp's gemma2 always soft-caps attention logits");
    if (!c.final_logit_softcapping)
      refuse(where, c, "final_logit_softcapping", "null: llama.cpp's gemma2 always soft-caps output logits");
    return;
  }
  if (c.attn_logit_softcapping) refuse(where, c, "attn_logit_softcapping", "gemma3 has no attention soft-cap");
  if (c.final_logit_softcapping) refuse(where, c, "final_logit_softcapping", "not written for gemma3");
  const modules::RopeParams local = c.local_rope.value_or(modules::RopeParams{});
  if (local.theta != 10000.0 || local.linear_factor != 1.0 || local.llama3)
    refuse(where, c, "rope_local_base_freq", "llama.cpp's gemma3 gives sliding layers RoPE base 10000, unscaled");
}

// Llama-3's RoPE scaling as llama.cpp applies it: one divisor per rotary frequency (converter:
// rope_freqs.weight). Long wavelengths are divided by `factor`, short ones kept, and the band
// between blended smoothly, as transformers' llama3 rule does.
std::vector<float> llama3_divisors(const DecoderConfig& c) {
  const modules::Llama3RopeScaling& s = *c.rope_scaling;
  const double context = static_cast<double>(s.original_max_position_embeddings);
  const double long_wavelen = context / s.low_freq_factor, short_wavelen = context / s.high_freq_factor;
  std::vector<float> out;
  for (int64_t i = 0; i < c.head_dim; i += 2) {
    const double wavelen = 2.0 * M_PI * std::pow(c.rope_theta, static_cast<double>(i) / static_cast<double>(c.head_dim));
    double d = 1.0;
    if (wavelen > long_wavelen) {
      d = s.factor;
    } else if (wavelen >= short_wavelen) {
      const double smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      d = 1.0 / ((1.0 - smooth) / s.factor + smooth);
    }
    out.push_back(static_cast<float>(d));
  }
  return out;
}

// llama.cpp's qwen35 attends on layer i when (i + 1) % full_attention_interval == 0 and runs the
// Gated DeltaNet elsewhere: the interval the config's layers follow (its first full layer + 1).
int64_t full_attention_interval(const DecoderConfig& c, const std::string& where) {
  int64_t every = c.num_hidden_layers + 1;  // no full layer at all
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (!c.is_linear(i)) {
      every = i + 1;
      break;
    }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (c.is_linear(i) != ((i + 1) % every != 0))
      refuse(where, c, "layer_types", "layer " + std::to_string(i) + " is " + (c.is_linear(i) ? "linear" : "full") +
                                          " attention where llama.cpp attends on every " + std::to_string(every) +
                                          "th layer only (full_attention_interval)");
  return every;
}

void check_qwen35(const DecoderConfig& c, const std::string& where) {
  const modules::GatedDeltaDims& g = c.gated_delta;
  if (g.key_head_dim != g.value_head_dim)
    refuse(where, c, "linear_value_head_dim", std::to_string(g.value_head_dim) + " != linear_key_head_dim " +
                                                  std::to_string(g.key_head_dim) + ": llama.cpp's qwen35 takes one "
                                                  "head size (ssm.state_size) for the DeltaNet's keys and values");
  if (c.mrope_section.size() > 4)
    refuse(where, c, "rope_parameters.mrope_section", "llama.cpp reads at most 4 sections");
  full_attention_interval(c, where);
}

// The Gated DeltaNet's sizes as llama.cpp's qwen35 reads them (its converter's names: state size is
// the head size, group count the key heads, time step rank the value heads).
void add_qwen35_keys(const DecoderConfig& c, const std::string& where, ArchPlan& p) {
  const modules::GatedDeltaDims& g = c.gated_delta;
  const auto u32 = [](int64_t v) { return Value::u32(static_cast<uint32_t>(v)); };
  std::vector<int32_t> sections(c.mrope_section.begin(), c.mrope_section.end());
  if (sections.empty()) sections = {11, 11, 10};  // the converter's default when the config has none
  sections.resize(4, 0);
  const std::pair<const char*, Value> keys[] = {
      {"ssm.conv_kernel", u32(g.conv_kernel)},
      {"ssm.state_size", u32(g.key_head_dim)},
      {"ssm.group_count", u32(g.num_key_heads)},
      {"ssm.time_step_rank", u32(g.num_value_heads)},
      {"ssm.inner_size", u32(g.value_head_dim * g.num_value_heads)},
      {"full_attention_interval", u32(full_attention_interval(c, where))},
      {"rope.dimension_sections", Value::i32_array(sections)}};
  for (const auto& [key, v] : keys) p.metadata.emplace_back(p.arch + "." + key, v);
}

// A Gated DeltaNet tensor ("linear_attn.<part>") of layer `layer`, as llama.cpp's converter writes it.
std::optional<TensorPlan> qwen35_linear_tensor(const std::string& layer, const std::string& part, const DecoderConfig& c) {
  const modules::GatedDeltaDims& g = c.gated_delta;
  const int64_t per_group = g.num_value_heads / g.num_key_heads, qk = 2 * g.key_head_dim * g.num_key_heads;
  const auto regroup = [&](int dim, int64_t offset, int64_t head_dim) -> std::optional<HeadRegroup> {
    if (per_group == 1) return std::nullopt;  // one value head a key head: the orders agree
    return HeadRegroup{dim, offset, g.num_key_heads, per_group, head_dim};
  };
  const std::string blk = "blk." + layer + ".";
  const int64_t dv = g.value_head_dim;
  TensorPlan t;
  if (part == "in_proj_qkv.weight") t = {blk + "attn_qkv.weight", 0, 0.0f, regroup(0, qk, dv)};
  else if (part == "in_proj_z.weight") t = {blk + "attn_gate.weight", 0, 0.0f, regroup(0, 0, dv)};
  else if (part == "in_proj_b.weight") t = {blk + "ssm_beta.weight", 0, 0.0f, regroup(0, 0, 1)};
  else if (part == "in_proj_a.weight") t = {blk + "ssm_alpha.weight", 0, 0.0f, regroup(0, 0, 1)};
  else if (part == "out_proj.weight") t = {blk + "ssm_out.weight", 0, 0.0f, regroup(1, 0, dv)};
  else if (part == "norm.weight") t = {blk + "ssm_norm.weight"};  // the gated norm: plain w
  else if (part == "dt_bias") t = {blk + "ssm_dt.bias", 0, 0.0f, regroup(0, 0, 1)};
  else if (part == "A_log") t = {blk + "ssm_a", 0, 0.0f, regroup(0, 0, 1), true};
  else if (part == "conv1d.weight") t = {blk + "ssm_conv1d.weight", 0, 0.0f, regroup(0, qk, dv), false, true};
  else return std::nullopt;
  return t;
}

// Gemma 4's full layers' head size (global_head_dim; head_dim when the config gives none).
int64_t gemma4_full_head_dim(const DecoderConfig& c) { return c.global_head_dim > 0 ? c.global_head_dim : c.head_dim; }

// What llama.cpp's gemma4 fixes: plain RoPE over all of head_dim on sliding layers, no scaling on full
// ones (their proportional share is the rope_freqs tensor), one per-layer table row a token, and the
// layers the KV-shared ones read: the last non-shared layer for full layers, the one before it for
// sliding layers (as Gemma 4's checkpoints lay them out).
void check_gemma4(const DecoderConfig& c, const std::string& where) {
  if (!c.sliding_window) refuse(where, c, "sliding_window", "null: llama.cpp's gemma4 always has sliding layers");
  const modules::RopeParams local = c.local_rope.value_or(modules::RopeParams{});
  const bool local_partial = local.proportional && local.proportional->partial_rotary_factor != 1.0;
  if (local.linear_factor != 1.0 || local.llama3 || local.yarn || local_partial)
    refuse(where, c, "rope_parameters.sliding_attention",
           "llama.cpp's gemma4 rotates sliding layers with plain RoPE over all of head_dim, unscaled");
  if (c.rope_linear_factor != 1.0 || c.rope_scaling || c.rope_yarn)
    refuse(where, c, "rope_parameters.full_attention",
           "llama.cpp's gemma4 reads no RoPE scaling for its full layers (only the proportional rotary share)");
  if (c.per_layer_input_dim > 0 && c.per_layer_input_vocab != c.vocab_size)
    refuse(where, c, "vocab_size_per_layer_input",
           std::to_string(c.per_layer_input_vocab) + " != vocab_size " + std::to_string(c.vocab_size) +
               ": llama.cpp's gemma4 takes one per-layer table row a token");
  const auto n = static_cast<int64_t>(c.kv_source.size());
  int64_t first = n;
  while (first > 0 && c.is_kv_shared(first - 1)) --first;
  for (int64_t i = first; i < n; ++i) {
    const int64_t theirs = first - (c.is_sliding(i) ? 2 : 1), ours = c.kv_source[static_cast<size_t>(i)];
    if (ours != theirs)
      refuse(where, c, "num_kv_shared_layers",
             "layer " + std::to_string(i) + " reuses layer " + std::to_string(ours) + "'s keys and values where " +
                 "llama.cpp's gemma4 reads layer " + std::to_string(theirs) + "'s (shared full layers read the last " +
                 "non-shared layer, shared sliding ones the layer before it: layer_types must make those a full " +
                 "and a sliding layer)");
  }
}

// The rope_freqs tensor of llama.cpp's gemma4, read by its full layers only: ggml's NeoX RoPE over
// all of global_head_dim, each frequency divided by its entry; 1e30 stops the angles past the
// proportional share (those dimensions pass through, as transformers' zeroed frequencies do).
std::vector<float> gemma4_rope_divisors(const DecoderConfig& c) {
  const int64_t half = gemma4_full_head_dim(c) / 2;
  int64_t angles = half;
  if (c.rope_proportional)  // transformers' int(factor * head_dim // 2)
    angles = static_cast<int64_t>(std::floor(c.rope_proportional->partial_rotary_factor * static_cast<double>(half)));
  std::vector<float> out(static_cast<size_t>(half), 1e30f);
  std::fill(out.begin(), out.begin() + angles, 1.0f);
  return out;
}

// Replaces key `key` of `m` (or appends it).
void set_key(Metadata& m, const std::string& key, Value v) {
  for (auto& kv : m)
    if (kv.first == key) return void(kv.second = std::move(v));
  m.emplace_back(key, std::move(v));
}

// Gemma 4's per-layer sizes and sharing as llama.cpp's gemma4 reads them: the full layers' head
// size as key_length (the sliding ones' as *_swa), per-layer kv heads and MLP widths as arrays where
// they differ, the sliding layers as a bool array.
void add_gemma4_keys(const DecoderConfig& c, ArchPlan& p) {
  const auto u32 = [](int64_t v) { return Value::u32(static_cast<uint32_t>(v)); };
  const int64_t n = c.num_hidden_layers, full = gemma4_full_head_dim(c);
  std::vector<bool> swa;
  std::vector<int32_t> kv, ff;
  for (int64_t i = 0; i < n; ++i) {
    swa.push_back(c.is_sliding(i));
    kv.push_back(static_cast<int32_t>(c.layer_kv_heads(i)));
    ff.push_back(static_cast<int32_t>(c.layer_intermediate(i)));
  }
  const bool kv_differ = std::adjacent_find(kv.begin(), kv.end(), std::not_equal_to<>()) != kv.end();
  int64_t shared = 0;
  for (int64_t i = 0; i < n; ++i) shared += c.is_kv_shared(i) ? 1 : 0;
  const std::pair<const char*, Value> keys[] = {
      {"attention.key_length", u32(full)},
      {"attention.value_length", u32(full)},
      {"attention.key_length_swa", u32(c.head_dim)},
      {"attention.value_length_swa", u32(c.head_dim)},
      {"rope.dimension_count", u32(full)},
      {"rope.dimension_count_swa", u32(c.rope_dim())},
      {"rope.freq_base_swa", Value::f32(static_cast<float>(c.local_rope.value_or(modules::RopeParams{}).theta))},
      {"attention.head_count_kv", kv_differ ? Value::i32_array(kv) : u32(c.num_key_value_heads)},
      {"feed_forward_length", c.double_wide_mlp ? Value::i32_array(ff) : u32(c.intermediate_size)},
      {"attention.sliding_window_pattern", Value::bool_array(swa)},
      {"attention.shared_kv_layers", u32(shared)},
      {"embedding_length_per_layer_input", u32(c.per_layer_input_dim)}};
  for (const auto& [key, v] : keys) set_key(p.metadata, p.arch + "." + key, v);
  if (c.final_logit_softcapping)
    set_key(p.metadata, p.arch + ".final_logit_softcapping",
            Value::f32(static_cast<float>(*c.final_logit_softcapping)));
  p.extra.push_back({"rope_freqs.weight", gemma4_rope_divisors(c)});
}

// Gemma 4's tensors beyond Gemma 3's block (llama.cpp's names): the per-layer inputs' table,
// projection and norm, and in each layer their gate, projection and norm and the layer_scalar.
std::optional<TensorPlan> gemma4_tensor(const std::string& hf) {
  static const std::map<std::string, std::string> model = {
      {"model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight"},
      {"model.per_layer_model_projection.weight", "per_layer_model_proj.weight"},
      {"model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight"}};
  static const std::map<std::string, std::string> layer = {
      {"per_layer_input_gate.weight", "inp_gate.weight"},
      {"per_layer_projection.weight", "proj.weight"},
      {"post_per_layer_input_norm.weight", "post_norm.weight"},
      {"layer_scalar", "layer_output_scale.weight"}};
  if (const auto it = model.find(hf); it != model.end()) {
    TensorPlan t{it->second};
    t.no_lora = it->first == "model.per_layer_model_projection.weight";
    return t;
  }
  static const std::regex in_layer(R"(model\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(hf, m, in_layer)) return std::nullopt;
  if (const auto it = layer.find(m[2].str()); it != layer.end())
    return TensorPlan{"blk." + m[1].str() + "." + it->second};
  return std::nullopt;
}

// The keys every family writes, and the context length the file declares.
Metadata common_keys(const DecoderConfig& c, const std::string& a, int64_t context) {
  const auto u32 = [](int64_t v) { return Value::u32(static_cast<uint32_t>(v)); };
  return {{a + ".vocab_size", u32(c.vocab_size)},
          {a + ".context_length", u32(context)},
          {a + ".embedding_length", u32(c.hidden_size)},
          {a + ".block_count", u32(c.num_hidden_layers)},
          {a + ".feed_forward_length", u32(c.intermediate_size)},
          {a + ".rope.dimension_count", u32(c.rope_dim())},
          {a + ".attention.head_count", u32(c.num_attention_heads)},
          {a + ".attention.head_count_kv", u32(c.num_key_value_heads)},
          {a + ".attention.key_length", u32(c.head_dim)},
          {a + ".attention.value_length", u32(c.head_dim)},
          {a + ".attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(c.rms_norm_eps))},
          {a + ".rope.freq_base", Value::f32(static_cast<float>(c.rope_theta))}};
}

// YaRN as the converter writes it (yarn_* keys: the attention factor as transformers resolved it,
// the betas). llama.cpp itself scales cos and sin by 1 + 0.1 ln(factor) (1 for factor <= 1) times
// rope.scaling.attn_factor, and reads neither yarn_attn_factor nor the betas: an attention factor
// other than its own is written as that key's quotient.
template <typename Add>
void add_yarn_keys(const modules::YarnRope& y, const Add& add) {
  add("rope.scaling.type", Value::string("yarn"));
  add("rope.scaling.factor", Value::f32(static_cast<float>(y.factor)));
  add("rope.scaling.original_context_length", Value::u32(static_cast<uint32_t>(y.original_max_position_embeddings)));
  add("rope.scaling.yarn_attn_factor", Value::f32(static_cast<float>(y.attention_factor)));
  add("rope.scaling.yarn_beta_fast", Value::f32(static_cast<float>(y.beta_fast)));
  add("rope.scaling.yarn_beta_slow", Value::f32(static_cast<float>(y.beta_slow)));
  const double own = y.factor <= 1.0 ? 1.0 : 1.0 + 0.1 * std::log(y.factor);
  if (std::abs(y.attention_factor / own - 1.0) > 1e-7)
    add("rope.scaling.attn_factor", Value::f32(static_cast<float>(y.attention_factor / own)));
}

}  // namespace

ArchPlan plan_architecture(const DecoderConfig& c, const std::string& where) {
  check_activation_and_biases(c, where);
  if (c.family == Family::kGemma4) check_gemma4(c, where);
  check_rope(c, where);
  if (models::is_gemma2_or_3(c.family)) check_gemma(c, where);
  if (c.family == Family::kSmolLM3) check_nope(c, where);
  if (c.family == Family::kOlmo2) check_olmo(c, where);
  if (c.family == Family::kQwen35) check_qwen35(c, where);
  const bool qwen = c.family == Family::kQwen2 || c.family == Family::kQwen3 || c.family == Family::kSmolLM3;
  if (qwen && c.sliding_window)
    refuse(where, c, "use_sliding_window", "true: llama.cpp's " + std::string(arch_name(c.family)) + " has no sliding-window attention");

  ArchPlan p;
  p.arch = arch_name(c.family);
  int64_t context = c.max_position_embeddings;
  // llama.cpp's llama has no window and its phi3 ignores the one it reads ("Phi SWA is currently
  // disabled"): within a context no longer than the window, every key is inside it anyway.
  const bool window_ignored = c.family == Family::kLlama || c.family == Family::kPhi3;
  if (window_ignored && c.sliding_window && *c.sliding_window < context) {
    p.notes.push_back("sliding_window " + std::to_string(*c.sliding_window) + " < max_position_embeddings " +
                      std::to_string(context) + ": llama.cpp's " + p.arch + " architecture applies no sliding "
                      "window, so the file declares a context_length of " + std::to_string(*c.sliding_window) +
                      " (exact within it; llama.cpp warns when run past it)");
    context = *c.sliding_window;
  }
  p.metadata = common_keys(c, p.arch, context);
  const auto add = [&](const std::string& key, Value v) { p.metadata.emplace_back(p.arch + "." + key, std::move(v)); };
  if (c.rope_linear_factor != 1.0) {
    add("rope.scaling.type", Value::string("linear"));
    add("rope.scaling.factor", Value::f32(static_cast<float>(c.rope_linear_factor)));
  }
  if (c.rope_scaling) p.extra.push_back({"rope_freqs.weight", llama3_divisors(c)});
  if (c.rope_yarn) add_yarn_keys(*c.rope_yarn, add);
  const bool olmo = c.family == Family::kOlmo2;
  if ((models::is_any_gemma(c.family) || c.family == Family::kPhi3 || olmo) && c.sliding_window)
    add("attention.sliding_window", Value::u32(static_cast<uint32_t>(*c.sliding_window)));
  if (olmo && c.sliding_window) add("attention.sliding_window_pattern", Value::u32(4));
  if (c.family == Family::kGemma2) {
    add("attn_logit_softcapping", Value::f32(static_cast<float>(*c.attn_logit_softcapping)));
    add("final_logit_softcapping", Value::f32(static_cast<float>(*c.final_logit_softcapping)));
  }
  if (c.family == Family::kQwen35) add_qwen35_keys(c, where, p);
  if (c.family == Family::kGemma4) add_gemma4_keys(c, p);
  return p;
}

std::optional<TensorPlan> gguf_tensor(const std::string& hf, const DecoderConfig& c) {
  if (hf == "model.embed_tokens.weight") return TensorPlan{"token_embd.weight"};
  const float norm_add = c.norm == modules::RmsScale::kOnePlusWeight ? 1.0f : 0.0f;  // Gemma 2/3, Qwen3.5: 1 + w
  if (hf == "model.norm.weight") return TensorPlan{"output_norm.weight", 0, norm_add};
  if (hf == "lm_head.weight") return TensorPlan{"output.weight"};
  static const std::regex linear(R"(model\.layers\.(\d+)\.linear_attn\.(.+))");
  std::smatch lm;
  if (c.family == Family::kQwen35 && std::regex_match(hf, lm, linear)) return qwen35_linear_tensor(lm[1], lm[2], c);
  if (c.family == Family::kGemma4)
    if (auto t = gemma4_tensor(hf)) return t;
  static const std::regex layer(R"(model\.layers\.(\d+)\.(.+)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(hf, m, layer)) return std::nullopt;
  const std::string part = m[2], kind = m[3];
  const Family f = c.family;
  const bool gemma = models::is_any_gemma(f), phi3 = f == Family::kPhi3;
  const bool olmo = f == Family::kOlmo2, qwen35 = f == Family::kQwen35;
  const bool qk_norms = f == Family::kQwen3 || f == Family::kGemma3 || f == Family::kGemma4 || olmo || qwen35;
  struct Row {
    const char* hf;
    const char* gguf;
    bool present;
  };
  const Row rows[] = {
      {"self_attn.q_proj", "attn_q", !phi3},
      {"self_attn.k_proj", "attn_k", !phi3},
      {"self_attn.v_proj", "attn_v", !phi3},
      {"self_attn.qkv_proj", "attn_qkv", phi3},
      {"self_attn.o_proj", "attn_output", true},
      {"mlp.gate_proj", "ffn_gate", !phi3},
      {"mlp.up_proj", "ffn_up", !phi3},
      {"mlp.gate_up_proj", "ffn_up", phi3},  // gate and up stacked, as llama.cpp's phi3 splits it
      {"mlp.down_proj", "ffn_down", true},
      {"input_layernorm", "attn_norm", true},
      {"post_attention_layernorm", gemma || olmo || qwen35 ? "post_attention_norm" : "ffn_norm", true},
      {"pre_feedforward_layernorm", "ffn_norm", gemma},
      {"post_feedforward_layernorm", "post_ffw_norm", gemma || olmo},
      {"self_attn.q_norm", "attn_q_norm", qk_norms},
      {"self_attn.k_norm", "attn_k_norm", qk_norms},
  };
  for (const Row& r : rows) {
    if (part != r.hf || !r.present) continue;
    const std::string g = r.gguf;
    const bool norm = g.find("norm") != std::string::npos;
    // Biases: Qwen2's q/k/v only (the others' are refused with attention_bias).
    if (kind == "bias" && !(f == Family::kQwen2 && (g == "attn_q" || g == "attn_k" || g == "attn_v")))
      return std::nullopt;
    TensorPlan t{"blk." + m[1].str() + "." + g + "." + kind};
    if (norm) t.add = norm_add;
    // llama.cpp's llama and smollm3 (its converter's LlamaModel) rotate interleaved pairs: the
    // converter permutes q and k rows.
    const bool permuted = f == Family::kLlama || f == Family::kSmolLM3;
    if (permuted && kind == "weight" && g == "attn_q") t.permute_heads = c.num_attention_heads;
    if (permuted && kind == "weight" && g == "attn_k") t.permute_heads = c.num_key_value_heads;
    return t;
  }
  return std::nullopt;
}

}  // namespace qlora::gguf
