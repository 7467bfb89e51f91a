// The llama.cpp architecture each family is written as, one table per family: general.architecture,
// the {arch}.* metadata keys llama.cpp's loader reads, the HF -> GGUF tensor names and the value
// transforms llama.cpp's converter (convert_hf_to_gguf.py) applies, as that converter writes them:
//
//   llama, mistral  "llama": Q/K rows permuted to llama.cpp's order; Llama-3's "llama3" RoPE scaling
//                   as a rope_freqs.weight tensor (one divisor a frequency), linear scaling as
//                   rope.scaling.* keys. llama.cpp's llama has no sliding window: a Mistral window
//                   shorter than max_position_embeddings becomes the file's context_length (within
//                   it, every key is inside the window, so the computation is exact).
//   qwen2           "qwen2": q/k/v biases, no permutation.
//   qwen3           "qwen3": q/k norms (attn_q_norm, attn_k_norm), head_dim as key_length.
//   gemma2          "gemma2": four norms a block, every norm weight stored as 1 + w, both soft-caps,
//                   the window; llama.cpp fixes which layers slide (even ones) and the attention
//                   scale (head_dim, or hidden / heads on the 46-layer 27B), so a config that
//                   differs is refused.
//   gemma3          "gemma3" (text-only, or the language model of a Gemma3ForConditionalGeneration):
//                   as gemma2 plus q/k norms, the global layers' RoPE base and linear scaling; the
//                   local layers' RoPE (base 10000, unscaled) and the 5 local : 1 global pattern are
//                   llama.cpp's fixed ones, so a config that differs is refused.
//   phi3            "phi3": fused attn_qkv and ffn_up (gate and up stacked, gate first) as they are;
//                   llama.cpp reads its window but applies none, so a window shorter than the context
//                   becomes the context_length, as for Mistral.
//   qwen3_5_text    "qwen35" (text-only, or the language model of a Qwen3_5ForConditionalGeneration):
//                   the ssm.* sizes and full_attention_interval; rope.dimension_count is the rotary
//                   part of head_dim and rope.dimension_sections the config's mrope_section (or
//                   [11, 11, 10, 0]), which text positions make plain NeoX RoPE. Every norm but the
//                   DeltaNet's gated one stored as 1 + w; q_proj (query and gate per head) as it is;
//                   in_proj_qkv/z/b/a -> attn_qkv, attn_gate, ssm_beta, ssm_alpha; conv1d squeezed to
//                   ssm_conv1d (f32 in every file type: ggml_ssm_conv reads f32 only); A_log stored as
//                   ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; out_proj as ssm_out. Value heads go
//                   from HF's order (grouped by key head) to llama.cpp's tiled one wherever they index
//                   rows or columns (HeadRegroup). llama.cpp takes one head size for keys and values
//                   and full attention on every full_attention_interval-th layer, so a config that
//                   differs is refused. The MTP block (mtp.*) is not written.
//   olmo2, olmo3    "olmo2": post-norms, q/k norms over all heads; OLMo 3's window on three of four
//                   layers and its full layers' YaRN as rope.scaling.* keys (llama.cpp's olmo2 leaves
//                   the sliding layers unscaled, as OLMo 3 does).
//   gemma4_text     "gemma4" (text-only, or the language model of a Gemma4ForConditionalGeneration):
//                   Gemma 3's block with plain w norms (no + 1), a weightless v norm and attention
//                   scale 1 (llama.cpp's own); the full layers' head size, kv heads and MLP widths
//                   (key_length, head_count_kv and feed_forward_length arrays, *_swa for the sliding
//                   layers), the sliding layers as a bool array, shared_kv_layers; the full layers'
//                   proportional RoPE as a rope_freqs tensor (1 a rotated frequency, 1e30 the rest);
//                   full layers without v_proj under attention_k_eq_v are written so (llama.cpp then
//                   takes the keys as values); the per-layer inputs (per_layer_token_embd,
//                   per_layer_model_proj, per_layer_proj_norm; blk.N.inp_gate, proj, post_norm) and
//                   layer_scalar as blk.N.layer_output_scale. llama.cpp fixes the layers KV-shared
//                   layers read, so a config that differs is refused.
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

struct ArchPlan {
  std::string arch;                // general.architecture
  Metadata metadata;               // the {arch}.* keys
  std::vector<ExtraTensor> extra;  // written before the checkpoint's tensors
  std::vector<std::string> notes;  // what the file does differently from the config, for the log
};

// The plan for config `c`; throws std::invalid_argument prefixed with `where` when `c` has
// something the architecture cannot compute exactly.
ArchPlan plan_architecture(const models::DecoderConfig& c, const std::string& where);

// The GGUF tensor of a text-only HF key ("model.layers.3.self_attn.q_proj.weight",
// "lm_head.weight", ".bias" keys, Qwen3.5's "model.layers.0.linear_attn.A_log"); nullopt when the
// architecture has no such tensor.
std::optional<TensorPlan> gguf_tensor(const std::string& hf, const models::DecoderConfig& c);

}  // namespace qlora::gguf
