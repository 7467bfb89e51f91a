// OLMo 2 and OLMo 3: no input norms, post-norms closing each branch (post_attention_layernorm,
// post_feedforward_layernorm), q/k RMSNorm over all heads, rms_norm_eps 1e-5. OLMo 3 slides on three
// of every four layers (window 4096 by default) with the full layers' RoPE base, unscaled, and
// YaRN on its full layers. llama.cpp's "olmo2" for both: an untied head, head_dim = hidden / heads,
// OLMo 3's window on three of every four layers (attention.sliding_window_pattern 4) and its full
// layers' YaRN as rope.scaling.* keys (llama.cpp leaves the sliding layers unscaled, as OLMo 3 does).
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

using modules::DecoderLayer;

// OLMo's q/k norms span all heads.
constexpr NormRow kQNormAll{"q_norm", "model.layers.{i}.self_attn.q_norm", &DecoderLayer::q_norm, Dim::kQHeads};
constexpr NormRow kKNormAll{"k_norm", "model.layers.{i}.self_attn.k_norm", &DecoderLayer::k_norm, Dim::kKvHeads};

const Architecture& olmo_architecture() {
  static const Architecture a = families::make_architecture(
      "olmo2", families::llama_rows(), {families::kPostAttnNorm, families::kPostFfnNorm, kQNormAll, kKNormAll});
  return a;
}

bool olmo3_slides(const nlohmann::json&, const std::string&, int64_t layer) { return (layer + 1) % 4 != 0; }

void check_olmo(const DecoderConfig& c, const std::string& where) {
  if (c.tie_word_embeddings)
    refuse_gguf(where, c, "tie_word_embeddings", "true: llama.cpp's olmo2 loads its own output head");
  if (c.head_dim * c.num_attention_heads != c.hidden_size)
    refuse_gguf(where, c, "head_dim", "llama.cpp's olmo2 takes head_dim = hidden_size / num_attention_heads");
  if (!c.sliding_window) return;
  const modules::RopeParams local = c.local_rope.value_or(c.rope());
  if (local.theta != c.rope_theta || local.linear_factor != 1.0 || local.llama3 || local.yarn)
    refuse_gguf(where, c, "rope_parameters", "llama.cpp's olmo2 gives sliding layers the full layers' RoPE base, unscaled");
  const std::string pattern = families::sliding_mismatch(c, 4);
  if (!pattern.empty()) refuse_gguf(where, c, "layer_types", pattern);
}

void add_olmo_keys(const DecoderConfig& c, const std::string&, GgufAdditions& out) {
  if (c.sliding_window) out.keys.emplace_back("attention.sliding_window_pattern", uint32_t{4});
}

Family olmo(const char* name) {
  Family f;
  f.name = name;
  f.model_types = {name};
  f.architecture = olmo_architecture;
  f.rms_norm_eps = 1e-5;
  f.local_rope = LocalRope::kFullBase;
  f.gguf.arch = "olmo2";
  f.gguf.tensors = families::post_norm_tensor_names(true);
  f.gguf.tensors.emplace_back("post_feedforward_layernorm", "post_ffw_norm");
  f.gguf.window_key = true;
  f.gguf.yarn_rope = true;
  f.gguf.check = check_olmo;
  f.gguf.add = add_olmo_keys;
  return f;
}

}  // namespace

const Family& olmo2_family() {
  static const Family f = olmo("olmo2");
  return f;
}

const Family& olmo3_family() {
  static const Family f = [] {
    Family f = olmo("olmo3");
    f.sliding_window = 4096;
    f.slides = olmo3_slides;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
