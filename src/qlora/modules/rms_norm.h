// RMSNorm as a free function over plain tensors: Llama's form, Gemma's (1 + w) and Gemma 4's w in
// fp32 (RmsScale), one autograd node for a frozen weight.
// Numerics follow transformers' implementation of each family op for op where the order matters.
#pragma once
#include <ATen/core/Tensor.h>

#include "qlora/modules/options.h"

namespace qlora::modules {

// HF's LlamaRMSNorm: normalise in fp32, cast back to x's dtype, then multiply by the weight
// (weight * normed, in that order and in the promoted dtype).
// x: [..., dim]; weight: [dim]. Returns [..., dim].
// Both norms are one autograd node for a frozen weight (bit-identical values to HF's op chain; it
// keeps x and the per-row rstd, and backward is the analytic gradient wrt x in fp32, cast to x's
// dtype). A weight that requires grad gets autograd's op chain instead.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// HF's GemmaRMSNorm: normalise and scale by (1 + weight) in fp32, then cast to x's dtype.
at::Tensor rms_norm_plus_one(const at::Tensor& x, const at::Tensor& weight, double eps);
// Any of the three forms (RmsScale: Llama's, Gemma 2/3's, Gemma 4's w in fp32), one autograd node alike.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, RmsScale scale);

}  // namespace qlora::modules
