// Causal self-attention for training on the CPU, by blocks of queries: each block of `block`
// query rows attends only to the keys up to its last row, so the upper-right blocks of the score
// matrix, which the causal mask would zero, are never computed (~1/2 the FLOPs of a full score
// matrix at 64-row blocks and seq 512), and every product is one batched GEMM over heads.
// The probabilities of the computed blocks (~seq^2 / 2 per head) are kept for backward when they
// are no larger than q, k, v and o (seq <= 8 head_dim: seq 512 at head_dim 64, 1024 at 128), which
// saves backward one GEMM and one exp pass of the seven GEMMs; otherwise backward recomputes each
// block's probabilities from the saved row log-sum-exp (as flash attention does) and memory is one
// block's scores. The softmaxes are two-pass row kernels (ops/softmax_ops.h). Measured at seq 512,
// 12 heads, head_dim 64 (2-core EPYC, `build/bench_attention`): forward + backward 10.9 ms, against
// 23.4 ms for at::scaled_dot_product_attention's CPU flash kernel, equal to it within fp32 rounding.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace qlora::modules {

// softmax(q k^T * scale + causal mask) v for q, k, v [b, heads, seq, d] (k and v with as many
// heads as q), queries and keys at the same positions. Returns [b, heads, seq, d]. keep_probs:
// keep the probabilities for backward (nullopt: when seq <= 8 head_dim). allowed: undefined, or a
// bool mask [1 or b, seq, seq] (true: query i may attend to key j) that hides more than the causal
// mask does (packed rows' block-causal mask, a sliding window). Only keys j <= i are ever computed,
// so an allowed key after its query is ignored; every query must keep at least one key. sinks:
// undefined, or [heads] (gpt-oss): one more logit per head in every row's softmax, attending to no
// value (frozen: no gradient).
at::Tensor blocked_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                    int64_t block = 64, std::optional<bool> keep_probs = std::nullopt,
                                    const at::Tensor& allowed = {}, const at::Tensor& sinks = {});

}  // namespace qlora::modules
