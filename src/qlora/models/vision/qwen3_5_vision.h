// Qwen3.5's vision tower (Qwen3_5VisionModel, model.visual.* of Qwen3_5ForConditionalGeneration and
// Qwen3_5MoeForConditionalGeneration), as transformers 5.23 computes it:
//   patches     pixel_values [patches, C*T*P*P] (the processor's rows, in spatial-merge-block order) through
//               the Conv3d whose kernel is its stride [T, P, P] (one output per patch), plus its bias;
//   positions   the learned square table pos_embed [side^2, D] resampled bilinearly (align_corners) to each
//               image's h x w grid, 4 taps a patch in the merge-block order, summed in fp32;
//   rotary      axial 2-D: (row, col) of each patch; angles row * f ++ col * f over head_dim / 2, twice;
//               applied to q and k in fp32 (rotate-half over the whole head_dim);
//   blocks      x + proj(attn(norm1 x)), x + fc2(act(fc1(norm2 x))): LayerNorms (eps 1e-6), fused qkv with
//               bias, full attention within each frame of each image (no deepstack: Qwen3.5 has none);
//   merger      LayerNorm(D), 2x2 (merge^2) consecutive patches concatenated, linear_fc1, GELU (erf), linear_fc2
//               into out_hidden_size (the language model's width).
// Output: [sum of t*h*w / merge^2 over the images, out_hidden_size].
// NF4 (TowerLoadOptions::base_in_nf4): the blocks' qkv, proj, linear_fc1, linear_fc2. Dense: the patch
// conv, pos_embed, norms, biases, the merger (the projector).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace qlora::models::vision {

// The pos_embed interpolation: for the patches of every image of grid_thw ([images, 3] t, h, w; CPU
// integer), in the processor's order, the 4 table rows [patches, 4] int64 and weights [patches, 4]
// fp32, equal to transformers' get_vision_interpolation_indices_and_weights(bilinear, align_corners).
struct PosInterpolation {
  at::Tensor indices, weights;
  at::Tensor rows, cols;  // [patches] int64: each patch's grid position (the rotary's)
};
PosInterpolation qwen_pos_interpolation(const at::Tensor& grid_thw, int64_t side, int64_t merge);

}  // namespace qlora::models::vision
