#include "qlora/gguf/quant_mix.h"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <stdexcept>

namespace qlora::gguf {
namespace {

// llama.cpp's broad tensor roles, told apart by name as it does (first match wins).
enum class Role { Output, TokenEmbd, AttnVLike, AttnK, AttnQ, AttnOutput, FfnUp, FfnGate, FfnDown, Other };

bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

Role role_of(const std::string& name) {
  if (name == "output.weight") return Role::Output;
  if (name == "token_embd.weight" || name == "per_layer_token_embd.weight") return Role::TokenEmbd;
  if (has(name, "attn_qkv.weight") || has(name, "attn_kv_b.weight") || has(name, "attn_v.weight")) return Role::AttnVLike;
  if (has(name, "attn_k.weight")) return Role::AttnK;
  if (has(name, "attn_q.weight")) return Role::AttnQ;
  if (has(name, "attn_output.weight")) return Role::AttnOutput;
  if (has(name, "ffn_up")) return Role::FfnUp;
  if (has(name, "ffn_gate")) return Role::FfnGate;
  if (has(name, "ffn_down")) return Role::FfnDown;
  return Role::Other;
}

// Matrices llama-quantize leaves in the input's type (small, or precision-critical).
bool quantizable(const TensorSpec& t) {
  static const char* const kKept[] = {"_norm.weight",  "ffn_gate_tid2eid.weight",
                                      "altup",         "laurel",               "per_layer_model_proj",
                                      "ssm_conv1d",    "shortconv.conv.weight", "indexer.k_proj.weight",
                                      "indexer.q_proj.weight", "attn_rel_b.weight", "time_mix_"};
  const std::string& n = t.name;
  if (t.shape.size() < 2 || n.size() < 6 || n.compare(n.size() - 6, 6, "weight") != 0) return false;
  if (n == "position_embd.weight" || n == "token_types.weight") return false;
  return std::none_of(std::begin(kKept), std::end(kKept), [&](const char* k) { return has(n, k); });
}

// The layer of "blk.N...." (scanf's "blk.%d"), or -1.
int layer_of(const std::string& name) {
  if (name.compare(0, 4, "blk.") != 0) return -1;
  size_t i = 4;
  const bool minus = i < name.size() && name[i] == '-';
  if (i < name.size() && (name[i] == '-' || name[i] == '+')) ++i;
  if (i >= name.size() || !std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
  int v = 0;
  for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])); ++i) v = v * 10 + (name[i] - '0');
  return minus ? -v : v;
}

// The first and last eighth of the layers, and every third layer in between.
bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

// llama.cpp's LLM_TYPE_70B (the one model size its choice reads).
bool is_70b(const ModelFacts& f) {
  if (f.n_layer != 80) return false;
  if (f.arch == "llama") return f.n_head != f.n_head_kv;
  return f.arch == "qwen2" || f.arch == "olmo" || f.arch == "deci";
}

// The walk over the file: llama.cpp's counters and what it knows of the whole file.
struct MixState {
  const ModelFacts& facts;
  GgmlType main;
  bool medium;  // q4_k_m / q5_k_m
  bool tied;    // no output.weight: token_embd is the head
  int n_attn_v = 0, i_attn_v = 0, i_ffn[3] = {0, 0, 0};

  // The (layer, layers) a feed-forward tensor counts as: its position among its kind, or, with
  // experts, the layer in its name.
  int ffn_layer(int& counter, const std::string& name) {
    int layer = counter++;
    if (facts.n_expert > 1) {
      layer = layer_of(name);
      if (layer < 0 || layer >= facts.n_layer)
        throw std::invalid_argument("GGUF quantization: tensor " + name + " is not in a layer [0, " +
                                    std::to_string(facts.n_layer) + ")");
    }
    return layer;
  }

  GgmlType head(const TensorSpec& t) const {
    if (facts.arch == "falcon" || t.shape.back() % type_info(main).block != 0) return GgmlType::Q8_0;
    return main == GgmlType::Q8_0 ? main : GgmlType::Q6_K;
  }

  GgmlType attn_v() {
    GgmlType type = main;
    if (medium && use_more_bits(i_attn_v, n_attn_v)) type = GgmlType::Q6_K;
    if (is_70b(facts) && type == GgmlType::Q4_K) type = GgmlType::Q5_K;
    if (facts.n_expert == 8) type = GgmlType::Q8_0;
    ++i_attn_v;
    return type;
  }

  GgmlType ffn_down(const std::string& name) {
    const int i = ffn_layer(i_ffn[2], name), n = static_cast<int>(facts.n_layer);
    if (main == GgmlType::Q4_K && medium && facts.arch == "falcon")
      return i < n / 16 ? GgmlType::Q6_K : use_more_bits(i, n) ? GgmlType::Q5_K : GgmlType::Q4_K;
    return medium && use_more_bits(i, n) ? GgmlType::Q6_K : main;
  }

  GgmlType mixed(const TensorSpec& t) {
    const Role role = role_of(t.name);
    if (role == Role::Output || (tied && role == Role::TokenEmbd)) return head(t);
    switch (role) {
      case Role::AttnVLike: return attn_v();
      case Role::AttnK: return facts.n_expert == 8 ? GgmlType::Q8_0 : main;
      case Role::AttnOutput:
        return facts.n_expert == 8 && main == GgmlType::Q4_K && facts.arch != "falcon" ? GgmlType::Q5_K : main;
      case Role::FfnUp: ffn_layer(i_ffn[0], t.name); return main;
      case Role::FfnGate: ffn_layer(i_ffn[1], t.name); return main;
      case Role::FfnDown: return ffn_down(t.name);
      default: return main;
    }
  }
};

// A row that is not whole blocks of the type: the nearest type that fits, else f16.
GgmlType fallback(GgmlType type, int64_t cols) {
  if (cols % type_info(type).block == 0) return type;
  GgmlType next = GgmlType::F16;
  if (type == GgmlType::Q4_K) next = GgmlType::Q5_0;
  if (type == GgmlType::Q5_K) next = GgmlType::Q5_1;
  if (type == GgmlType::Q6_K) next = GgmlType::Q8_0;
  return cols % type_info(next).block == 0 ? next : GgmlType::F16;
}

}  // namespace

std::vector<GgmlType> choose_types(const std::vector<TensorSpec>& tensors, const ModelFacts& facts, GgmlType main) {
  std::vector<GgmlType> types(tensors.size(), GgmlType::F32);
  const bool quantized = is_quantized(main);
  MixState s{facts, main, main == GgmlType::Q4_K || main == GgmlType::Q5_K, true};
  for (const auto& t : tensors) {
    if (t.name == "output.weight") s.tied = false;
    if (role_of(t.name) == Role::AttnVLike) ++s.n_attn_v;
  }
  // llama.cpp walks its tensors by layer, then name: the counters run in that order.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int la = layer_of(tensors[a].name), lb = layer_of(tensors[b].name);
    return la != lb ? la < lb : tensors[a].name < tensors[b].name;
  });
  for (size_t i : order) {
    const TensorSpec& t = tensors[i];
    // Biases stay f32, 2-D ones too (gpt-oss's per-expert ffn_*_exps.bias): ggml adds them in f32 only.
    const bool bias = t.name.size() > 5 && t.name.compare(t.name.size() - 5, 5, ".bias") == 0;
    if (t.shape.size() < 2 || bias || has(t.name, "ssm_conv1d") || has(t.name, "ffn_gate_inp.weight")) types[i] = GgmlType::F32;
    else if (!quantized) types[i] = main;
    else if (!quantizable(t)) types[i] = GgmlType::F16;
    else types[i] = fallback(s.mixed(t), t.shape.back());
  }
  return types;
}

void set_types(std::vector<TensorSpec>& tensors, const ModelFacts& facts, GgmlType main) {
  const std::vector<GgmlType> types = choose_types(tensors, facts, main);
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].type = types[i];
}

}  // namespace qlora::gguf
