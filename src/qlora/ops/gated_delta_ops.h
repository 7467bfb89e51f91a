// The gated delta rule (Qwen3.5's Gated DeltaNet mixer), chunked, as one autograd node.
//
// Same arguments and results as transformers' torch_chunk_gated_delta_rule (up to rounding: it works in
// chunks of 64 tokens, this in chunks of kGatedDeltaChunk, which measured faster on the CPU):
//   q, k [batch, seq, k_heads, dk], v [batch, seq, v_heads, dv], g and beta [batch, seq, v_heads]
//   (g the log decay, <= 0; beta in (0, 1)); v_heads a multiple of k_heads, each key head serving
//   v_heads / k_heads consecutive value heads. initial_state [batch, v_heads, dk, dv] or undefined
//   (zeros). With use_qk_l2norm, q and k are L2-normalised (eps 1e-6 inside the rsqrt); q is always
//   scaled by 1/sqrt(dk). Everything is computed in fp32 whatever the input dtypes.
// Returns out [batch, seq, v_heads, dv] in q's dtype and, when output_final_state, the final state
// [batch, v_heads, dk, dv] in fp32 (undefined otherwise).
//
// Backward gives the gradients of q, k, v, g, beta and the initial state (each in its own dtype),
// recomputing each chunk's terms from what the forward saved per chunk (the entering state, T and
// Delta; ops/gated_delta_chunks.h): memory stays linear in the sequence.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace qlora::ops {

inline constexpr int64_t kGatedDeltaChunk = 32;

std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& g, const at::Tensor& beta,
                                                         const at::Tensor& initial_state, bool output_final_state,
                                                         bool use_qk_l2norm);

}  // namespace qlora::ops
