// A tensor's values on their way into a GGUF: the value transforms arch.h's TensorPlan names
// (llama.cpp's Q/K row order, Qwen3.5's value-head order, ...), and the rows encoded in a ggml type
// and streamed into the writer, a few MB at a time (the model GGUF and the LoRA adapter GGUF both
// write through here).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include <vector>

#include "qlora/gguf/arch.h"
#include "qlora/gguf/ggml_types.h"
#include "qlora/gguf/writer.h"

namespace qlora::gguf {

// HF's per-head [2, head_dim / 2] row halves (rotate-half RoPE) interleaved back into the order
// llama.cpp's converter gives the llama architecture's Q and K rows; `w` is [heads * head_dim, cols].
at::Tensor unrotate(const at::Tensor& w, int64_t heads);

// Qwen3.5's value heads along g.dim from g.offset, from HF's grouped order to llama.cpp's tiled one.
at::Tensor regroup_heads(const at::Tensor& w, const HeadRegroup& g);

// The values `plan` says the GGUF holds for checkpoint tensor `x`, and their shape from `x`'s.
at::Tensor planned_values(at::Tensor x, const TensorPlan& plan);
std::vector<int64_t> planned_shape(const std::vector<int64_t>& shape, const TensorPlan& plan);

// Encodes `t` (any float dtype; its last dimension is the row) row by row in `type` and writes the
// bytes as the writer's next tensor. Rows are converted to fp32 a chunk at a time (never the whole
// tensor) and encoded on every intra-op thread.
void write_tensor(Writer& out, const at::Tensor& t, GgmlType type);

}  // namespace qlora::gguf
