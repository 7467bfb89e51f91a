// A model family's description: everything qlora knows about one family, written in one file under
// models/families/ and registered in one table (families/registry.cpp). The rest of the code asks
// the description for facts and flags, never for the family's name:
//   - which config.json model_types it is, and its multimodal (Hub) wrapper if it has one;
//   - its transformers class's defaults and quirks, read by the config parser (decoder_config.cpp);
//   - its architecture table: projections, fused ones, norms, HF and PEFT names (architecture.h);
//   - how llama.cpp writes it: the GGUF architecture, its tensor names, its metadata and what it
//     cannot compute (gguf/arch.cpp writes the file from these).
//
// Adding a family that needs no new compute (a new name for Llama's block, other defaults, another
// norm layout): a file in families/ defining `const Family& <name>_family()`, its line in the
// registry, its test cases, a shipped config and a README row (README, "Adding a model family").
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "qlora/modules/options.h"

namespace qlora::io {
class CheckpointDir;
}

namespace qlora::models {

struct DecoderConfig;
struct Architecture;
namespace vision {
class Tower;
struct TowerLoadOptions;
}  // namespace vision

// ---- How a family's tensors and keys go into a GGUF file (gguf/arch.h writes them) ----

// Qwen3.5's Gated DeltaNet value heads, from HF's order (grouped by the key head they share:
// k0v0 k0v1 .. k1v0 k1v1 ..) to llama.cpp's tiled one (k0v0 k1v0 .. k0v1 k1v1 ..), which lets
// ggml repeat the key heads by broadcasting: along rows (dim 0) or columns (dim 1), from element
// `offset` on (in_proj_qkv and conv1d: past q and k).
struct HeadRegroup {
  int dim = 0;
  int64_t offset = 0;
  int64_t groups = 0;     // key heads
  int64_t per_group = 0;  // value heads a key head
  int64_t head_dim = 0;   // elements a value head (1: one per head, as in_proj_b/a, A_log, dt_bias)
};

// Where an HF tensor goes and what the converter does to its values on the way.
struct TensorPlan {
  std::string name;           // "blk.3.attn_q.weight"
  int64_t permute_heads = 0;  // llama's Q/K rows: HF's rotate-half halves interleaved over this many heads
  float add = 0.0f;           // Gemma's and Qwen3.5's norms: stored as w + 1
  std::optional<HeadRegroup> regroup{};
  bool neg_exp = false;  // Qwen3.5's A_log: stored as -exp(A_log)
  bool squeeze = false;  // Qwen3.5's conv1d [channels, 1, kernel]: stored as [channels, kernel]
  bool no_lora = false;  // llama.cpp multiplies it without applying a LoRA (Gemma 4's per_layer_model_proj)
};

// A tensor the GGUF holds that the checkpoint does not (Llama-3's RoPE frequency divisors).
struct ExtraTensor {
  std::string name;
  std::vector<float> values;  // 1-D, stored in f32
};

// A metadata value a family adds: u32, f32, string, i32 array, bool array.
using GgufValue = std::variant<uint32_t, float, std::string, std::vector<int32_t>, std::vector<bool>>;

// What a family's GGUF holds beyond the keys every family writes: {arch}.<key> values (a key the
// common ones already have is replaced) and tensors the checkpoint does not have.
struct GgufAdditions {
  std::vector<std::pair<std::string, GgufValue>> keys;
  std::vector<ExtraTensor> extra;
};

// Refuses a GGUF of config `c`: the config key, what it holds, and why llama.cpp would compute
// something else (std::invalid_argument prefixed with `where`).
[[noreturn]] void refuse_gguf(const std::string& where, const DecoderConfig& c, const std::string& key,
                              const std::string& why);

// ---- The description ----

// How a config's attention_bias key is read.
enum class AttentionBiasKey {
  kRead,     // attention_bias: q/k/v/o biases when true
  kIgnored,  // not read: the row table fixes the biases (Qwen2's q/k/v always)
  kRefused,  // true is refused (Phi-3 has none)
};

// Which RoPE the sliding-window layers take (DecoderConfig::local_rope).
enum class LocalRope {
  kNone,      // every layer takes the config's RoPE
  kOwnBase,   // rope_local_base_freq (10000 when absent), unscaled, or the dict's sliding_attention entry
  kFullBase,  // the full layers' base, unscaled, or the dict's sliding_attention entry (OLMo 3)
};

struct Family {
  const char* name = "";                // "gemma3": what messages and tests call it
  std::vector<const char*> model_types;  // config.json model_type values: {"gemma3_text"}
  const Architecture& (*architecture)() = nullptr;

  // The Hub's multimodal checkpoint whose language model (its text_config, of model_types[0]) is this
  // family beside a vision tower (copied, never computed).
  struct Multimodal {
    const char* model_type;     // "gemma3"
    const char* text_defaults;  // JSON: the text config class's defaults our parser does not share
    bool tie_word_embeddings;   // the class's tie_word_embeddings
    bool images_bidirectional = false;  // an image's tokens attend to each other on every layer (Gemma 3)
    // The class defaults of its image token (config image_token_id, Gemma 3's image_token_index) and of
    // vision_config.spatial_merge_size (1: the tower merges no patches into a token's position).
    int64_t image_token_id = -1;
    int64_t spatial_merge = 1;
  };
  std::optional<Multimodal> multimodal;

  // The transformers class's defaults for keys a config.json leaves out, and its quirks.
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  double rope_theta = 10000.0;
  modules::MlpActivation activation = modules::MlpActivation::kSilu;
  AttentionBiasKey attention_bias = AttentionBiasKey::kRead;
  // partial_rotary_factor: 0 accepts only 1.0 (all of head_dim rotates); otherwise the class's
  // default, and any factor in (0, 1] is accepted (Qwen3.5: 0.25).
  double partial_rotary_factor = 0.0;
  // The full layers' default proportional RoPE share (Gemma 4: 0.25); 0: none.
  double proportional_rope = 0.0;
  LocalRope local_rope = LocalRope::kNone;
  // The window when config.json has no sliding_window key (null always means none).
  std::optional<int64_t> sliding_window;
  bool sliding_needs_flag = false;  // the window applies only under use_sliding_window (Qwen, SmolLM3)
  // Without layer_types: whether layer i slides (null: every layer does).
  bool (*slides)(const nlohmann::json& config, const std::string& where, int64_t layer) = nullptr;
  bool gated_delta_layers = false;    // layer_types may say "linear_attention" (Qwen3.5); never slides
  bool last_layer_full = false;       // the class makes the last layer full attention (Gemma 4)
  bool bidirectional_vision = false;  // use_bidirectional_attention may be "vision" (Gemma 4)
  bool nope_layers = false;           // no_rope_layers / no_rope_layer_interval (SmolLM3)
  // What the family computes beyond a Llama block: norms, scales, soft-caps, mixers (after the
  // keys every family has are read).
  void (*parse)(const nlohmann::json& config, const std::string& where, DecoderConfig& c) = nullptr;
  // The key of the dense MLP's width (DecoderConfig::intermediate_size): Qwen3.5-MoE has no dense
  // MLP and reads its shared expert's, shared_expert_intermediate_size. Its class default; 0: required.
  const char* intermediate_key = "intermediate_size";
  int64_t intermediate_default = 0;

  // llama.cpp's architecture for this family.
  struct Gguf {
    const char* arch = "";  // general.architecture
    // A layer's HF module (after "model.layers.N.") -> llama.cpp's tensor name ("self_attn.q_proj" -> "attn_q").
    std::vector<std::pair<const char*, const char*>> tensors;
    bool permute_qk = false;          // Q/K rows permuted to interleaved pairs (llama.cpp's llama, smollm3)
    bool qkv_bias = false;            // q/k/v biases are written (Qwen2)
    bool window_key = false;          // the window is written (attention.sliding_window)
    bool window_refused = false;      // llama.cpp applies no window for this family: a config with one is refused
    bool window_as_context = false;   // llama.cpp applies no window: a shorter one becomes context_length
    bool linear_rope = false;         // linear RoPE scaling is read (rope.scaling.*)
    bool llama3_rope = false;         // Llama-3's RoPE scaling is read (rope_freqs)
    bool yarn_rope = false;           // YaRN is read (OLMo 3's full layers)
    bool fused_gate_up_exps = false;  // the experts' gate and up as one ffn_gate_up_exps (llama.cpp's gemma4)
    bool attn_bias = false;           // q/k/v/o biases are written (gpt-oss; the config's attention_bias)
    // YaRN with truncate false is written with a note: ggml rounds the ramp's ends to whole dimensions,
    // and llama.cpp's own converter writes gpt-oss's YaRN so (the frequencies between them differ).
    bool yarn_untruncated_note = false;
    // What llama.cpp fixes that the config may say otherwise: refuse_gguf when it does.
    void (*check)(const DecoderConfig& c, const std::string& where) = nullptr;
    // Its keys and tensors beyond the common ones.
    void (*add)(const DecoderConfig& c, const std::string& where, GgufAdditions& out) = nullptr;
    // Its tensors that are no row of `tensors` (tried first; nullopt: not one of them).
    std::optional<TensorPlan> (*tensor)(const std::string& hf, const DecoderConfig& c) = nullptr;
  } gguf;

  // The vision tower of its multimodal checkpoint (models/vision/tower.h), from that checkpoint and its
  // config.json; null: none is computed.
  std::unique_ptr<vision::Tower> (*vision_tower)(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                                 const vision::TowerLoadOptions& opt) = nullptr;
};

// Every family, in the registry's order (families/registry.cpp).
const std::vector<const Family*>& all_families();
// What a DecoderConfig built by hand is: Llama.
const Family& default_family();

}  // namespace qlora::models
