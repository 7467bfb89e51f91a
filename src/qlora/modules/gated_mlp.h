// The gated MLP of a decoder layer: down(act(gate(x)) * up(x)), act SiLU (SwiGLU, one autograd node)
// or GELU-tanh (GeGLU), gate and up from their projections or Phi-3's fused gate_up_proj.
// Numerics follow transformers' implementation of each family op for op where the order matters.
#pragma once
#include <ATen/core/Tensor.h>

#include "qlora/modules/decoder_layer.h"

namespace qlora::modules {

// down(act(gate(x)) * up(x)), gate and up from gate_up_proj when the layer has it.
// x: [batch, seq, hidden].
at::Tensor gated_mlp(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x, bool training);
// The same MLP over three given projections (Qwen3.5-MoE's shared expert).
at::Tensor gated_mlp(const LoraLinear& gate_proj, const LoraLinear& up_proj, const LoraLinear& down_proj,
                     const LayerDims& dims, const at::Tensor& x, bool training);

}  // namespace qlora::modules
