// Rotate-half RoPE as free functions over plain tensors: the inverse frequencies (llama3, YaRN,
// linear or proportional scaling), the cos / sin tables of a range of positions, and the rotation
// of q or k (one autograd node).
// Numerics follow transformers' implementation of each family op for op where the order matters.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "qlora/modules/options.h"

namespace qlora::modules {

// Inverse frequencies [head_dim / 2] fp32: 1 / theta^(2i / head_dim), then llama3 scaling if given.
at::Tensor rope_inv_freq(int64_t head_dim, double theta,
                         const std::optional<Llama3RopeScaling>& scaling);
// The same for a RopeParams (theta, llama3, yarn or linear scaling).
at::Tensor rope_inv_freq(int64_t head_dim, const RopeParams& params);
// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
double rope_attention_scaling(const RopeParams& params);

struct RopeTables {
  // [seq, head_dim] (one position range shared by every row) or [batch, seq, head_dim] (per-token
  // positions, e.g. packed rows whose positions restart at 0 per sample), in the compute dtype.
  at::Tensor cos, sin;
};
// positions: [seq] or [batch, seq] int64; the tables get the same leading dims plus head_dim.
// Angles are formed in fp32, cos and sin scaled by `scale` (rope_attention_scaling) and cast at
// the end, as transformers does.
RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, at::ScalarType dtype,
                       double scale = 1.0);

// Qwen3.5's interleaved M-RoPE: positions [3, batch, seq] (temporal, height, width) give the tables
// [batch, seq, head_dim] whose frequency j (of head_dim / 2) turns with the height position where
// j % 3 == 1 and j < 3 * sections[1], the width one where j % 3 == 2 and j < 3 * sections[2], the
// temporal one elsewhere (transformers' recomposition_frequencies); then as rope_tables. Equal to
// rope_tables of the temporal positions where the three agree (text).
RopeTables mrope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, const std::vector<int64_t>& sections,
                        at::ScalarType dtype, double scale = 1.0);

// Rotate-half RoPE: x * cos + rotate_half(x) * sin. x: [batch, heads, seq, head_dim].
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

}  // namespace qlora::modules
