// The llama.cpp architecture a model is written as: general.architecture, the {arch}.* metadata keys
// llama.cpp's loader reads, the HF -> GGUF tensor names and the value transforms llama.cpp's
// converter (convert_hf_to_gguf.py) applies, as that converter writes them. What differs between
// families is each family's (models/families/<family>.cpp, Family::gguf): its architecture name,
// tensor names, extra keys and tensors, and what llama.cpp fixes that a config may say otherwise.
// Here: the keys every family writes, the RoPE scalings llama.cpp reads (linear as rope.scaling.*
// keys, Llama-3's as a rope_freqs tensor, YaRN as rope.scaling.yarn_*), the window, and the layer
// tensors of the family's table (Q/K rows permuted where llama.cpp's architecture rotates
// interleaved pairs; (1 + w) norms stored as w + 1).
//
// What cannot be described exactly (another activation, biases where llama.cpp loads none, a
// RoPE scaling the architecture does not read, a window llama.cpp would not apply) is refused with
// std::invalid_argument naming the config key, before any file is opened.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qlora/gguf/writer.h"
#include "qlora/models/decoder_config.h"

namespace qlora::gguf {

using Metadata = std::vector<std::pair<std::string, Value>>;

using models::ExtraTensor;
using models::HeadRegroup;
using models::TensorPlan;

struct ArchPlan {
  std::string arch;                // general.architecture
  Metadata metadata;               // the {arch}.* keys
  std::vector<ExtraTensor> extra;  // written before the checkpoint's tensors
  std::vector<std::string> notes;  // what the file does differently from the config, for the log
};

// The plan for config `c`; throws std::invalid_argument prefixed with `where` when `c` has
// something the architecture cannot compute exactly.
ArchPlan plan_architecture(const models::DecoderConfig& c, const std::string& where);

// A MoE layer's experts as llama.cpp holds them: ffn_gate_exps, ffn_up_exps and ffn_down_exps, each
// one 3-D tensor [experts, rows, cols] (ggml's ne = [cols, rows, experts]) stacked from the
// checkpoint's parts: one key per expert (transformers' save: experts.<e>.gate_proj / Mixtral's w1,
// up_proj / w3, down_proj / w2), or the fused experts.gate_up_proj [E, 2I, H] (gate rows, then up
// rows) and experts.down_proj [E, H, I]. The router (mlp.gate / block_sparse_moe.gate) is
// ffn_gate_inp [E, H], which gguf_tensor names.
struct StackedTensor {
  std::string name;            // "blk.3.ffn_gate_exps.weight"
  std::vector<int64_t> shape;  // [experts, rows, cols]
  struct Part {
    std::string key;             // text-only HF key
    std::vector<int64_t> shape;  // what the checkpoint must hold under it
    bool all_experts;            // the key is [E, R, cols] (fused); else one expert's [R, cols], in expert order
    int64_t row0, rows;          // the rows of each expert's matrix this tensor takes
    bool transposed = false;     // gpt-oss: each expert's matrix is stored [cols, R] (transposed first)
    int64_t stride = 1;          // gpt-oss: rows row0, row0 + stride, ... (gate's and up's interleaved rows)
    // gpt-oss's Hub form: the key names <key>_blocks [E, out, in / 32, 16] (MXFP4, out-major: never
    // transposed) beside <key>_scales; convert.cpp sets it where the checkpoint holds the pair.
    bool mxfp4 = false;
  };
  std::vector<Part> parts;
};

// Layer `layer`'s stacked expert tensors (none for a layer without experts); `fused`: the checkpoint
// holds the fused layout.
std::vector<StackedTensor> expert_tensors(const models::DecoderConfig& c, int64_t layer, bool fused);
// The key whose presence says a layer's experts are fused ("model.layers.3.mlp.experts.gate_up_proj").
std::string fused_experts_key(const models::DecoderConfig& c, int64_t layer);

// The GGUF tensor of a text-only HF key ("model.layers.3.self_attn.q_proj.weight",
// "lm_head.weight", ".bias" keys, Qwen3.5's "model.layers.0.linear_attn.A_log"); nullopt when the
// architecture has no such tensor.
std::optional<TensorPlan> gguf_tensor(const std::string& hf, const models::DecoderConfig& c);

}  // namespace qlora::gguf
