#include "qlora/gguf/arch.h"

#include <cmath>
#include <regex>
#include <stdexcept>
#include <type_traits>

#include "qlora/models/architecture.h"

namespace qlora::gguf {
namespace {

using models::DecoderConfig;
using models::Family;
using models::refuse_gguf;

void check_activation_and_biases(const DecoderConfig& c, const std::string& where) {
  if (c.activation != c.family->activation) {
    const bool gelu = c.activation == models::MlpActivation::kGeluTanh;
    refuse_gguf(where, c, "hidden_act", std::string("the MLP activation is ") + (gelu ? "gelu_pytorch_tanh" : "silu") +
                                            ", the architecture's is the other one");
  }
  if (c.attention_bias && !c.family->gguf.attn_bias)
    refuse_gguf(where, c, "attention_bias", "llama.cpp loads no attention biases for this family");
}

void check_rope(const DecoderConfig& c, const std::string& where) {
  const Family::Gguf& g = c.family->gguf;
  // YaRN: llama.cpp's olmo2 applies it to the full layers only, as OLMo 3 does; ggml rounds the
  // ramp's ends outward to whole dimensions, as transformers' truncate does.
  if (c.rope_yarn && !g.yarn_rope)
    refuse_gguf(where, c, "rope_parameters", "YaRN RoPE scaling is written for OLMo 3 (llama.cpp's olmo2) only");
  if (c.rope_yarn && !c.rope_yarn->truncate && !g.yarn_untruncated_note)
    refuse_gguf(where, c, "rope_parameters.truncate", "false: ggml's YaRN rounds the ramp's ends to whole dimensions");
  // llama.cpp takes the betas from its context parameters (32 and 1 unless a user sets them), not the file.
  if (c.rope_yarn && (c.rope_yarn->beta_fast != 32.0 || c.rope_yarn->beta_slow != 1.0))
    refuse_gguf(where, c, c.rope_yarn->beta_fast != 32.0 ? "rope_parameters.beta_fast" : "rope_parameters.beta_slow",
                "llama.cpp's YaRN ramp runs between beta_fast 32 and beta_slow 1 whatever the file says");
  if (c.rope_scaling && !g.llama3_rope)
    refuse_gguf(where, c, "rope_scaling", "llama3 RoPE scaling is read by llama.cpp's llama architecture only");
  if (c.rope_linear_factor != 1.0 && !g.linear_rope)
    refuse_gguf(where, c, "rope_scaling", "linear RoPE scaling is not written for this family");
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

// A family's metadata value as GGUF stores it.
Value to_value(const models::GgufValue& v) {
  return std::visit(
      [](const auto& x) -> Value {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, uint32_t>) return Value::u32(x);
        else if constexpr (std::is_same_v<T, float>) return Value::f32(x);
        else if constexpr (std::is_same_v<T, std::string>) return Value::string(x);
        else if constexpr (std::is_same_v<T, std::vector<int32_t>>) return Value::i32_array(x);
        else return Value::bool_array(x);
      },
      v);
}

// Replaces key `key` of `m` (or appends it).
void set_key(Metadata& m, const std::string& key, Value v) {
  for (auto& kv : m)
    if (kv.first == key) return void(kv.second = std::move(v));
  m.emplace_back(key, std::move(v));
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
  const Family::Gguf& g = c.family->gguf;
  check_activation_and_biases(c, where);
  if (g.check) g.check(c, where);
  check_rope(c, where);
  if (g.window_refused && c.sliding_window)
    refuse_gguf(where, c, "use_sliding_window", "true: llama.cpp's " + std::string(g.arch) + " has no sliding-window attention");

  ArchPlan p;
  p.arch = g.arch;
  int64_t context = c.max_position_embeddings;
  // llama.cpp's llama has no window and its phi3 ignores the one it reads ("Phi SWA is currently
  // disabled"): within a context no longer than the window, every key is inside it anyway.
  if (g.window_as_context && c.sliding_window && *c.sliding_window < context) {
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
  if (c.rope_yarn && !c.rope_yarn->truncate)
    p.notes.push_back("rope_parameters.truncate is false, but ggml rounds the YaRN ramp's ends to whole dimensions (as "
                      "llama.cpp's own converter leaves it): the rotary frequencies between those ends differ slightly "
                      "from transformers'");
  if (g.window_key && c.sliding_window) add("attention.sliding_window", Value::u32(static_cast<uint32_t>(*c.sliding_window)));
  // Experts: llama.cpp's loader reads their count and the top-k (expert_count > 0 is what makes
  // llama's layers MoE); both architectures softmax the router's logits and renormalise the top k.
  if (c.family->architecture().experts && !c.moe_layers.empty()) {  // not a dense Gemma 4
    add("expert_count", Value::u32(static_cast<uint32_t>(c.moe.num_experts)));
    add("expert_used_count", Value::u32(static_cast<uint32_t>(c.moe.top_k)));
  }
  if (g.add) {
    models::GgufAdditions more;
    g.add(c, where, more);
    for (const auto& [key, v] : more.keys) set_key(p.metadata, p.arch + "." + key, to_value(v));
    for (ExtraTensor& t : more.extra) p.extra.push_back(std::move(t));
  }
  return p;
}

std::optional<TensorPlan> gguf_tensor(const std::string& hf, const DecoderConfig& c) {
  const Family::Gguf& g = c.family->gguf;
  if (hf == "model.embed_tokens.weight") return TensorPlan{"token_embd.weight"};
  const float norm_add = c.norm == modules::RmsScale::kOnePlusWeight ? 1.0f : 0.0f;  // Gemma 2/3, Qwen3.5: 1 + w
  if (hf == "model.norm.weight") return TensorPlan{"output_norm.weight", 0, norm_add};
  if (hf == "lm_head.weight") return TensorPlan{"output.weight"};
  if (g.tensor)
    if (auto t = g.tensor(hf, c)) return t;
  static const std::regex layer(R"(model\.layers\.(\d+)\.(.+)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(hf, m, layer)) return std::nullopt;
  const std::string part = m[2], kind = m[3];
  // A MoE layer's router, in either layout's spelling: ffn_gate_inp (its experts: expert_tensors).
  if (const auto& ex = c.family->architecture().experts; ex && kind == "weight") {
    const int64_t i = std::stoll(m[1].str());
    if (i < c.num_hidden_layers && c.is_moe(i) &&
        (hf == models::hf_module(ex->split_router, i) + ".weight" || hf == models::hf_module(ex->fused_router, i) + ".weight"))
      return TensorPlan{"blk." + m[1].str() + ".ffn_gate_inp.weight"};
  }
  for (const auto& [module, name] : g.tensors) {
    if (part != module) continue;
    const std::string stem = name;
    // Biases: q/k/v only, where the family has them (the others' are refused with attention_bias).
    const bool qkv = stem == "attn_q" || stem == "attn_k" || stem == "attn_v";
    if (kind == "bias" && !(g.qkv_bias && qkv) && !g.attn_bias) return std::nullopt;
    TensorPlan t{"blk." + m[1].str() + "." + stem + "." + kind};
    if (stem.find("norm") != std::string::npos) t.add = norm_add;
    // llama.cpp's llama and smollm3 (its converter's LlamaModel) rotate interleaved pairs: the
    // converter permutes q and k rows.
    if (g.permute_qk && kind == "weight" && stem == "attn_q") t.permute_heads = c.num_attention_heads;
    if (g.permute_qk && kind == "weight" && stem == "attn_k") t.permute_heads = c.num_key_value_heads;
    return t;
  }
  return std::nullopt;
}

std::string fused_experts_key(const DecoderConfig& c, int64_t layer) {
  const auto& ex = c.family->architecture().experts;
  return ex ? models::hf_module(ex->fused, layer) + ".gate_up_proj" : std::string();
}

namespace {

// llama.cpp's gemma4: ffn_gate_up_exps [E, 2I, H] (each expert's gate rows, then its up rows, as the
// fused gate_up_proj holds them) and ffn_down_exps [E, H, I].
std::vector<StackedTensor> fused_gate_up_tensors(const models::ExpertsRow& ex, int64_t layer, bool fused, int64_t E,
                                                 int64_t H, int64_t I) {
  const std::string blk = "blk." + std::to_string(layer) + ".";
  std::vector<StackedTensor> out{{blk + "ffn_gate_up_exps.weight", {E, 2 * I, H}, {}},
                                 {blk + "ffn_down_exps.weight", {E, H, I}, {}}};
  if (fused) {
    const std::string stem = models::hf_module(ex.fused, layer) + ".";
    out[0].parts.push_back({stem + "gate_up_proj", {E, 2 * I, H}, true, 0, 2 * I});
    out[1].parts.push_back({stem + "down_proj", {E, H, I}, true, 0, H});
    return out;
  }
  for (int64_t e = 0; e < E; ++e) {
    const std::string stem = models::hf_module(ex.split, layer) + "." + std::to_string(e) + ".";
    out[0].parts.push_back({stem + ex.gate + ".weight", {I, H}, false, 0, I});
    out[0].parts.push_back({stem + ex.up + ".weight", {I, H}, false, 0, I});
    out[1].parts.push_back({stem + ex.down + ".weight", {H, I}, false, 0, H});
  }
  return out;
}

// gpt-oss's experts (models::ExpertsRow::transposed_interleaved): each expert's gate_up [hidden, 2I]
// transposed, gate's the even columns, up's the odd ones; down [I, hidden] transposed; and the biases,
// ffn_{gate,up}_exps.bias [E, I] from gate_up_proj_bias's even and odd entries, ffn_down_exps.bias [E, H].
std::vector<StackedTensor> gpt_oss_expert_tensors(const models::ExpertsRow& ex, const DecoderConfig& c, int64_t layer) {
  const int64_t E = c.moe.num_experts, H = c.hidden_size, I = c.moe.inter;
  const std::string blk = "blk." + std::to_string(layer) + ".", stem = models::hf_module(ex.fused, layer) + ".";
  const auto part = [&](const char* key, std::vector<int64_t> shape, bool transposed, int64_t row0, int64_t rows,
                        int64_t stride) {
    return StackedTensor::Part{stem + key, std::move(shape), true, row0, rows, transposed, stride};
  };
  std::vector<StackedTensor> out{
      {blk + "ffn_gate_exps.weight", {E, I, H}, {part("gate_up_proj", {E, H, 2 * I}, true, 0, I, 2)}},
      {blk + "ffn_up_exps.weight", {E, I, H}, {part("gate_up_proj", {E, H, 2 * I}, true, 1, I, 2)}},
      {blk + "ffn_down_exps.weight", {E, H, I}, {part("down_proj", {E, I, H}, true, 0, H, 1)}}};
  if (!ex.biases) return out;
  out.push_back({blk + "ffn_gate_exps.bias", {E, I}, {part("gate_up_proj_bias", {E, 2 * I}, false, 0, I, 2)}});
  out.push_back({blk + "ffn_up_exps.bias", {E, I}, {part("gate_up_proj_bias", {E, 2 * I}, false, 1, I, 2)}});
  out.push_back({blk + "ffn_down_exps.bias", {E, H}, {part("down_proj_bias", {E, H}, false, 0, H, 1)}});
  return out;
}

}  // namespace

std::vector<StackedTensor> expert_tensors(const DecoderConfig& c, int64_t layer, bool fused) {
  const auto& ex = c.family->architecture().experts;
  if (!ex || !c.is_moe(layer)) return {};
  if (ex->transposed_interleaved) return gpt_oss_expert_tensors(*ex, c, layer);
  const int64_t E = c.moe.num_experts, H = c.hidden_size, I = c.moe.inter;
  const std::string blk = "blk." + std::to_string(layer) + ".";
  if (c.family->gguf.fused_gate_up_exps) return fused_gate_up_tensors(*ex, layer, fused, E, H, I);
  std::vector<StackedTensor> out{{blk + "ffn_gate_exps.weight", {E, I, H}, {}},
                                 {blk + "ffn_up_exps.weight", {E, I, H}, {}},
                                 {blk + "ffn_down_exps.weight", {E, H, I}, {}}};
  if (fused) {
    const std::string stem = models::hf_module(ex->fused, layer) + ".";
    out[0].parts.push_back({stem + "gate_up_proj", {E, 2 * I, H}, true, 0, I});
    out[1].parts.push_back({stem + "gate_up_proj", {E, 2 * I, H}, true, I, I});
    out[2].parts.push_back({stem + "down_proj", {E, H, I}, true, 0, H});
    return out;
  }
  for (int64_t e = 0; e < E; ++e) {
    const std::string stem = models::hf_module(ex->split, layer) + "." + std::to_string(e) + ".";
    out[0].parts.push_back({stem + ex->gate + ".weight", {I, H}, false, 0, I});
    out[1].parts.push_back({stem + ex->up + ".weight", {I, H}, false, 0, I});
    out[2].parts.push_back({stem + ex->down + ".weight", {H, I}, false, 0, H});
  }
  return out;
}

}  // namespace qlora::gguf
