// Activation checkpointing of a decoder layer, or of any function of one tensor: the forward keeps
// only its input, and backward recomputes it.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace qlora::modules {

// Activation checkpointing: runs `fn(h)` without recording a graph, keeping only h; backward
// replays fn with grad enabled (and the RNG state of the forward, so dropout masks agree) and
// back-propagates into h and `params` (the tensors fn uses that need gradients).
at::Tensor checkpointed(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& h,
                        const std::vector<at::Tensor>& params);

}  // namespace qlora::modules
