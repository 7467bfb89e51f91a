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
};

// h: [..., hidden] in the compute dtype; lora_x: the LoRA path's input (modules::lora_input of h),
// undefined when the head has no adapter. Returns the logits [..., vocab] fp32:
// softcap((base(h) + lora_update(lora_x)) in h's dtype), then widened to fp32.
at::Tensor output_logits(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x);

// The byte budget of one chunk's fp32 logits; the chunk's other per-vocab temporaries (log-softmax,
// its gradient, a widened base block) are each of that size or smaller.
constexpr int64_t kLossChunkBytes = int64_t{64} << 20;
// Tokens per chunk for a vocabulary: as many as keep one chunk's fp32 logits within kLossChunkBytes,
// at least 1 (Llama-3, 128256: 130 tokens; Llama-2, 32000: 524).
int64_t default_loss_chunk_tokens(int64_t vocab);

// The summed token cross-entropy sum_t CE(output_logits(h_t), labels_t) over labels_t !=
// ignore_index (-100), `chunk_tokens` rows at a time (>= 1). h: [N, hidden]; lora_x: [N, hidden] fp32
// or undefined; labels: [N] int64. Returns a 0-dim fp32 tensor.
// Chunks without a label to score are skipped. Under grad mode, when h, lora_x or the head's
// adapters require grad, each chunk's gradients (wrt h, lora_x, A and B) are computed right after
// its loss, while its logits exist (Liger's fused linear cross-entropy): the loss is a scalar, so
// backward only scales them by the incoming gradient, needs no weight and keeps no logits. The
// adapters get their gradient once, from one autograd node, as from the unchunked head.
// Per row this is the computation of output_logits + at::cross_entropy_loss; chunking only changes
// the order of the fp32 sums over rows (the loss and the gradients of A and B).
at::Tensor chunked_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                              const at::Tensor& labels, int64_t chunk_tokens);

// The same loss from the whole [N, vocab] logits: today's computation, the reference the tests and
// bench_train_step compare chunked_token_loss with.
at::Tensor full_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                           const at::Tensor& labels);

}  // namespace qlora::models
