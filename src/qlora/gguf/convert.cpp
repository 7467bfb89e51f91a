#include "qlora/gguf/convert.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <optional>
#include <regex>
#include <stdexcept>

#include "qlora/gguf/quant_mix.h"
#include "qlora/gguf/tokenizer_meta.h"
#include "qlora/gguf/writer.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/models/llama_config.h"

namespace qlora::gguf {
namespace {

using Metadata = std::vector<std::pair<std::string, Value>>;

// An HF tensor's GGUF name and whether its rows need llama.cpp's Q/K order (the head count to undo
// the rotate-half layout over; 0: none).
struct Mapped {
  std::string name;
  int64_t permute_heads = 0;
};

std::optional<Mapped> gguf_name(const std::string& hf, const models::LlamaConfig& c) {
  if (hf == "model.embed_tokens.weight") return Mapped{"token_embd.weight"};
  if (hf == "model.norm.weight") return Mapped{"output_norm.weight"};
  if (hf == "lm_head.weight") return Mapped{"output.weight"};
  static const std::regex layer(R"(model\.layers\.(\d+)\.(.+)\.weight)");
  std::smatch m;
  if (!std::regex_match(hf, m, layer)) return std::nullopt;
  static const std::pair<const char*, const char*> kParts[] = {
      {"self_attn.q_proj", "attn_q"},      {"self_attn.k_proj", "attn_k"}, {"self_attn.v_proj", "attn_v"},
      {"self_attn.o_proj", "attn_output"}, {"mlp.gate_proj", "ffn_gate"},  {"mlp.up_proj", "ffn_up"},
      {"mlp.down_proj", "ffn_down"},       {"input_layernorm", "attn_norm"}, {"post_attention_layernorm", "ffn_norm"}};
  for (const auto& [part, name] : kParts) {
    if (m[2] != part) continue;
    Mapped out{"blk." + m[1].str() + "." + name + ".weight"};
    if (std::string(name) == "attn_q") out.permute_heads = c.num_attention_heads;
    if (std::string(name) == "attn_k") out.permute_heads = c.num_key_value_heads;
    return out;
  }
  return std::nullopt;
}

void check_supported(const models::LlamaConfig& c, const std::string& where) {
  const auto refuse = [&](const std::string& what) {
    throw std::invalid_argument(where + ": " + what + "; GGUF export writes the llama architecture with default "
                                "RoPE and no biases so far");
  };
  if (c.model_type != "llama" && c.model_type != "mistral") refuse("model_type '" + c.model_type + "'");
  if (c.rope_scaling || c.rope_linear_factor != 1.0) refuse("rope_scaling is set");
  if (c.attention_bias) refuse("attention_bias is true");
  if (c.sliding_window) refuse("sliding_window is set");
  if (c.head_dim * c.num_attention_heads != c.hidden_size) refuse("head_dim x heads differs from hidden_size");
}

Metadata model_metadata(const models::LlamaConfig& c, const ConvertOptions& o, const std::string& dir) {
  const auto u32 = [](int64_t v) { return Value::u32(static_cast<uint32_t>(v)); };
  std::string name = o.name;
  if (name.empty()) name = std::filesystem::path(dir).lexically_normal().filename().string();
  if (name.empty()) name = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
  return {{"general.architecture", Value::string("llama")},
          {"general.type", Value::string("model")},
          {"general.name", Value::string(name)},
          {"general.file_type", Value::u32(type_info(o.type).file_type)},
          {"general.quantization_version", Value::u32(2)},
          {"llama.vocab_size", u32(c.vocab_size)},
          {"llama.context_length", u32(c.max_position_embeddings)},
          {"llama.embedding_length", u32(c.hidden_size)},
          {"llama.block_count", u32(c.num_hidden_layers)},
          {"llama.feed_forward_length", u32(c.intermediate_size)},
          {"llama.rope.dimension_count", u32(c.head_dim)},
          {"llama.attention.head_count", u32(c.num_attention_heads)},
          {"llama.attention.head_count_kv", u32(c.num_key_value_heads)},
          {"llama.attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(c.rms_norm_eps))},
          {"llama.rope.freq_base", Value::f32(static_cast<float>(c.rope_theta))}};
}

// HF's per-head [2, head_dim / 2] row halves interleaved back into llama.cpp's order.
at::Tensor unrotate(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0);
  return w.reshape({heads, 2, rows / heads / 2, w.size(1)}).transpose(1, 2).reshape(w.sizes()).contiguous();
}

void write_tensor(Writer& out, const at::Tensor& t, GgmlType type) {
  const at::Tensor x = t.to(at::kFloat).contiguous();
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1), rows = x.numel() / cols;
  const uint64_t rb = row_bytes(type, cols);
  const int64_t chunk = std::max<int64_t>(1, (1 << 22) / static_cast<int64_t>(rb));  // ~4 MB of output a write
  std::vector<uint8_t> buf;
  for (int64_t r = 0; r < rows; r += chunk) {
    const int64_t n = std::min(chunk, rows - r);
    buf.resize(static_cast<size_t>(n * rb));
    for (int64_t i = 0; i < n; ++i) encode_row(type, x.data_ptr<float>() + (r + i) * cols, cols, buf.data() + i * rb);
    out.write(buf.data(), buf.size());
  }
}

}  // namespace

size_t write_gguf(const std::string& dir, const std::string& out_path, const ConvertOptions& options) {
  const models::LlamaConfig c = models::load_llama_config(dir);
  check_supported(c, dir + "/config.json");
  const io::CheckpointDir ckpt = io::CheckpointDir::open(dir);
  std::vector<TensorSpec> specs;
  std::vector<std::pair<std::string, Mapped>> plan;
  for (const std::string& hf : ckpt.tensor_names()) {
    if (hf == "lm_head.weight" && c.tie_word_embeddings) continue;
    const auto mapped = gguf_name(hf, c);
    if (!mapped) throw std::invalid_argument(dir + ": tensor '" + hf + "' has no GGUF name in the llama architecture");
    const auto& info = ckpt.file_of(hf).info(hf);
    specs.push_back({mapped->name, info.shape});
    plan.emplace_back(hf, *mapped);
  }
  set_types(specs, {"llama", c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, 0}, options.type);
  Metadata metadata = model_metadata(c, options, dir);
  add_tokenizer_metadata(dir, c.vocab_size, metadata);
  Writer out(out_path, std::move(metadata), specs);
  for (size_t i = 0; i < plan.size(); ++i) {
    at::Tensor t = ckpt.tensor(plan[i].first);
    if (plan[i].second.permute_heads > 0) t = unrotate(t, plan[i].second.permute_heads);
    write_tensor(out, t, specs[i].type);
    t = at::Tensor();
    ckpt.file_of(plan[i].first).release(plan[i].first);  // its mapped pages leave the resident set
  }
  out.commit();
  return specs.size();
}

}  // namespace qlora::gguf
