// Images as the language model takes them (a vision-language model's text side): the tower's features
// placed at the image tokens, Qwen3.5's 3-D rotary positions of those tokens, and which image each
// token belongs to (Gemma's bidirectional attention among one image's tokens). The tower and the
// pixels are elsewhere (models/vision/, src/qlora/images/): here the features are given.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <vector>

#include "qlora/images/processor.h"
#include "qlora/models/decoder_config.h"
#include "qlora/models/vision/tower.h"

namespace qlora::models {

struct ImageInputs {
  // [image tokens, hidden]: the tower's output for the batch's images, in token order (row by row,
  // left to right); differentiable where the tower trains. Placed as transformers' masked_scatter
  // places them: after the embedding (and its scale), replacing the image tokens' rows.
  at::Tensor features;
  at::Tensor mask;  // [batch, seq] bool: the image tokens
  // Qwen3.5's M-RoPE: [3, batch, seq] int64 (temporal, height, width; mrope_positions); undefined:
  // the 1-D positions (equal on every axis, as for text alone).
  at::Tensor positions;
};

// One image's grid as its tower sees it: temporal, height and width patches (before the merge).
using ImageGrid = std::array<int64_t, 3>;

// Qwen3.5's 3-D positions (transformers' Qwen3_5Model.get_rope_index) of tokens [batch, seq] whose
// image tokens are `mask` (each image one contiguous run of t * h * w / merge^2 tokens; `grids` the
// batch's images in token order): text tokens count on from the last position on all three axes;
// an image starting at position p gives its tokens (p + t, p + row, p + column) over its merged grid,
// and the text after it continues at p + max(h, w) / merge. position_ids [batch, seq] (undefined: one
// sample a row) restart at 0 where a packed row's next sample starts, and so do these. Throws
// std::invalid_argument when the runs and grids disagree.
at::Tensor mrope_positions(const at::Tensor& mask, const std::vector<ImageGrid>& grids, int64_t spatial_merge,
                           const at::Tensor& position_ids = {});

// A batch's processed images (images/processor.h, in token order) as the tower takes them: Qwen's
// patch rows concatenated with their grids stacked, Gemma's images stacked (Gemma 4's position ids too),
// told apart by their grids (3 entries, none, or [patches, 2]).
vision::PixelInputs pixel_inputs(const std::vector<images::ProcessedImage>& images);

// The language model's ImageInputs for tokens [batch, seq] holding `images`' image tokens (config
// c.image_token_id): the tower's features of the images, the mask, and for a model with M-RoPE (Qwen3.5)
// the 3-D positions over the images' grids (position_ids [batch, seq]: where packed samples start;
// undefined: one a row). Throws std::invalid_argument when the tokens hold another number of image
// tokens than the images take.
ImageInputs image_inputs(const vision::Tower& tower, const std::vector<images::ProcessedImage>& images,
                         const at::Tensor& tokens, const at::Tensor& position_ids, const DecoderConfig& c);

}  // namespace qlora::models
