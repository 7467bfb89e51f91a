// Qwen3.5's Gated DeltaNet mixer (its "linear_attention" layers), as transformers'
// Qwen3_5GatedDeltaNet computes it, over a layer's normed input:
//   in_proj_qkv -> causal depthwise conv (conv1d, kernel K, no bias) -> SiLU -> q | k | v;
//   beta = sigmoid(in_proj_b x); g = -exp(A_log) * softplus(in_proj_a x + dt_bias) (fp32);
//   o = gated delta rule (ops/gated_delta_ops.h: q, k L2-normalised, q scaled by 1/sqrt(dk));
//   out_proj(rms_norm(o) * w * silu(in_proj_z x)) per value head (the gated norm: plain w, not 1 + w).
// The state along a row (conv window, recurrent state) starts at zero for each sequence: per row,
// or per packed sample (Segments), or from a generation cache, which it then extends.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/kv_cache.h"

namespace qlora::modules {

// Where each packed sample sits, for the mixer that carries state along a row (the Gated DeltaNet):
// the samples of all rows are laid end to end in one row, each padded with zeros to a whole number
// of the gated delta rule's chunks and by at least conv_kernel - 1 tokens, so neither the conv
// window nor the recurrent state passes from one sample to the next (the last padding slot of each
// sample decays the state to zero). A sample starts where its position is 0, as transformers
// derives cu_seqlens from position_ids.
struct Segments {
  at::Tensor gather;   // [total] int64: the flat [batch * seq] token each slot takes, or batch * seq
                       // (a zero row appended) for padding
  at::Tensor reset;    // [total] bool: true at each sample's last padding slot
  at::Tensor scatter;  // [batch * seq] int64: the slot each token's output comes from
};
// positions: [batch, seq] int64.
Segments segments_from_positions(const at::Tensor& positions, int64_t conv_kernel);

// x: [batch, seq, hidden], the layer's normed input. cache (optional): the layer's conv window and
// recurrent state, read and updated (not with segments). Returns [batch, seq, hidden].
at::Tensor gated_delta_net_forward(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x,
                                   bool training, LayerCache* cache, const Segments* segments);

// The gated norm alone (transformers' Qwen3_5RMSNormGated): normalise o in fp32, cast to o's
// dtype, times weight, times silu(z) in fp32, cast back. o, z: [..., dv]; weight: [dv].
at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, double eps);

}  // namespace qlora::modules
