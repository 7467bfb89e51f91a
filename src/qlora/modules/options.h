// Plain option types as HF configs name them: models/ parses them, modules/ applies them.
#pragma once
#include <cstdint>
#include <optional>

#include "kernels/rmsnorm_cpu.h"

namespace qlora::modules {

// rope_type "llama3" (Llama-3.1): low frequencies are divided by `factor`, high ones kept, the
// band between interpolated. Parameters as named in the HF config.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// rope_type "yarn" (OLMo 3's full-attention layers): frequencies blended between interpolated
// (divided by `factor`) and kept along a ramp between the dimensions that turn beta_fast and
// beta_slow times over original_max_position_embeddings; cos and sin scaled by attention_factor.
struct YarnRope {
  double factor = 1.0;
  double attention_factor = 1.0;  // already resolved from mscale / mscale_all_dim / factor
  double beta_fast = 32.0, beta_slow = 1.0;
  int64_t original_max_position_embeddings = 4096;
  bool truncate = true;  // round the ramp's ends outward to whole dimensions
};

// rope_type "proportional" (Gemma 4's full-attention layers): the frequencies of plain RoPE over the
// whole head_dim, of which only the first int(partial_rotary_factor * head_dim // 2) are kept and the
// rest are zero (those dimensions pass through unrotated), all divided by `factor` (RopeParams'
// linear_factor).
struct ProportionalRope {
  double partial_rotary_factor = 1.0;
};

// One set of rotary frequencies: base theta, then at most one scaling ("llama3", "yarn", or
// "linear": every frequency divided by linear_factor, as Gemma 3's global layers use, or "proportional").
struct RopeParams {
  double theta = 10000.0;
  std::optional<Llama3RopeScaling> llama3;
  double linear_factor = 1.0;
  std::optional<YarnRope> yarn;
  std::optional<ProportionalRope> proportional;
};

// Qwen3.5's Gated DeltaNet mixer (its linear-attention layers), as the HF config names it: q and k
// have num_key_heads heads of key_head_dim, v and the output num_value_heads of value_head_dim
// (a multiple of the key heads: each key head serves value/key consecutive value heads); a causal
// depthwise conv of conv_kernel taps runs over the concatenated q, k, v projections.
struct GatedDeltaDims {
  int64_t num_key_heads = 0, num_value_heads = 0;
  int64_t key_head_dim = 0, value_head_dim = 0;
  int64_t conv_kernel = 4;
  int64_t key_dim() const { return num_key_heads * key_head_dim; }
  int64_t value_dim() const { return num_value_heads * value_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }  // q, k, v channels
};

// How an RMSNorm's weight scales the normed row: Llama's w * round(normed), Gemma 2/3's (1 + w) in
// fp32, Gemma 4's w in fp32 (kernels/rmsnorm_cpu.h).
using kernels::RmsScale;

// The gated MLP's activation: HF "silu" (Llama, Qwen, Phi-3) or "gelu_pytorch_tanh" (Gemma).
enum class MlpActivation { kSilu, kGeluTanh };

}  // namespace qlora::modules
