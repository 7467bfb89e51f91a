// The output projection (lm_head) and the training loss over it. Logits for generation come whole;
// the loss comes by chunks of tokens, so no [tokens, vocab] logits tensor is ever materialised: for
// Llama-3's vocabulary (128256) at seq 2048 the whole fp32 logits are 1.05 GB per sequence, and
// autograd would keep them (and their log-softmax) until backward.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "qlora/modules/lora_linear.h"

namespace qlora::models {

// What the output projection computes beyond its LoraLinear: the widening of a dense base stored
// narrower than the compute dtype (bf16 under fp32 compute, widened `widen_rows` vocab rows at a
// time, so no widened [vocab, hidden] copy exists) and Gemma's final logit soft-cap.
struct OutputHead {
  const modules::LoraLinear* proj = nullptr;
  int64_t widen_rows = 4096;
  double softcap = 0.0;  // 0: none; else cap * tanh(logits / cap), in the compute dtype
  // The fp32 logits (after the soft-cap) divided by this: GRPO's log-probabilities at its sampling
  // temperature, as TRL computes them. 1: none (no division, so no rounding).
  double temperature = 1.0;
  // Where set, the losses below also write each token's entropy of its softmax (of the logits
  // above, temperature included): -sum_v p_v log p_v, [N] fp32, 0 for unscored tokens. No gradient.
  at::Tensor* entropy = nullptr;
};

// h: [..., hidden] in the compute dtype; lora_x: the LoRA path's input (modules::lora_input of h),
// undefined when the head has no adapter. Returns the logits [..., vocab] fp32:
// softcap((base(h) + lora_update(lora_x)) in h's dtype), then widened to fp32 (and / temperature).
at::Tensor output_logits(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x);

// The byte budget of one [tokens, vocab block] fp32 logits block of the chunked loss; its other
// per-block temporaries (the exponentials, a widened block of the head) are each of that size or smaller.
constexpr int64_t kLossChunkBytes = int64_t{32} << 20;
// Tokens per chunk for vocab blocks of `block_rows` rows (OutputHead::widen_rows, or the vocabulary
// when smaller): as many as keep one block's fp32 logits within kLossChunkBytes, at least 1
// (4096-row blocks: 2048 tokens).
int64_t default_loss_chunk_tokens(int64_t block_rows);

// The summed token cross-entropy sum_t CE(output_logits(h_t), labels_t) over labels_t !=
// ignore_index (-100), as output_logits + at::cross_entropy_loss compute it, without ever forming
// the [tokens, vocab] logits. h: [N, hidden]; lora_x: [N, hidden] fp32 or undefined; labels: [N]
// int64 (a scored label outside [0, vocab) is refused). Returns a 0-dim fp32 tensor.
// Unscored tokens are dropped first (no logits are computed for a masked prompt); the scored ones go
// `chunk_tokens` at a time (>= 1) through the vocabulary in blocks of head.widen_rows rows, with an
// online log-sum-exp: one pass computes each token's loss and, under grad mode when h, lora_x or
// the head's adapters require grad, the gradients wrt h, lora_x and A in the same pass (running
// sums of exp(z - max) @ W, rescaled as the max grows), so the head's weight is read, and a bf16
// head widened, once per chunk. B's gradient needs the final log-sum-exp: a second pass, only when
// the head has an adapter. The loss is a scalar, so backward only scales the gradients computed in
// forward and keeps no logits. Against the whole-logits loss only the order of fp32 sums differs.
at::Tensor chunked_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                              const at::Tensor& labels, int64_t chunk_tokens);

// The same loss summed per segment: segments [N] int64 names each token's segment in [0,
// num_segments) (e.g. its batch row, for per-sequence log-probabilities); returns [num_segments]
// fp32, whose backward weighs each token's gradient by its segment's incoming gradient. Undefined
// segments: one segment of every token. chunked_token_loss is this with one segment, as a 0-dim tensor.
at::Tensor chunked_segment_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                                const at::Tensor& labels, const at::Tensor& segments, int64_t num_segments,
                                int64_t chunk_tokens);

// The same loss from the whole [N, vocab] logits: today's computation, the reference the tests and
// bench_train_step compare chunked_token_loss with.
at::Tensor full_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                           const at::Tensor& labels);
// chunked_segment_loss from the whole logits ([num_segments] fp32).
at::Tensor full_segment_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                             const at::Tensor& labels, const at::Tensor& segments, int64_t num_segments);

}  // namespace qlora::models
