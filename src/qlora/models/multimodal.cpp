#include "qlora/models/multimodal.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace qlora::models {

at::Tensor mrope_positions(const at::Tensor& mask, const std::vector<ImageGrid>& grids, int64_t spatial_merge,
                           const at::Tensor& position_ids) {
  if (mask.dim() != 2 || mask.scalar_type() != at::kBool)
    throw std::invalid_argument("mrope_positions: the image-token mask must be bool [batch, seq]");
  if (spatial_merge < 1) throw std::invalid_argument("mrope_positions: spatial_merge_size must be >= 1");
  const at::Tensor m = mask.cpu().contiguous();
  if (position_ids.defined() && position_ids.sizes() != mask.sizes())
    throw std::invalid_argument("mrope_positions: position_ids must be [batch, seq] like the mask");
  const at::Tensor starts = position_ids.defined() ? position_ids.cpu().to(at::kLong).contiguous() : at::Tensor();
  const int64_t* restart = starts.defined() ? starts.data_ptr<int64_t>() : nullptr;
  const int64_t b = m.size(0), seq = m.size(1);
  at::Tensor out = at::zeros({3, b, seq}, at::kLong);
  auto pos = out.accessor<int64_t, 3>();
  const bool* is_image = m.data_ptr<bool>();
  size_t next = 0;  // the next image of `grids`
  for (int64_t r = 0; r < b; ++r) {
    int64_t p = 0;
    for (int64_t s = 0; s < seq;) {
      if (restart && restart[r * seq + s] == 0) p = 0;  // a packed row's next sample
      if (!is_image[r * seq + s]) {
        for (int a = 0; a < 3; ++a) pos[a][r][s] = p;
        ++p, ++s;
        continue;
      }
      if (next >= grids.size())
        throw std::invalid_argument("mrope_positions: more image runs than the " + std::to_string(grids.size()) +
                                    " images given");
      const auto [t, h, w] = grids[next++];
      if (h % spatial_merge || w % spatial_merge)
        throw std::invalid_argument("mrope_positions: an image grid of " + std::to_string(h) + " x " + std::to_string(w) +
                                    " patches is not a multiple of spatial_merge_size " + std::to_string(spatial_merge));
      const int64_t gh = h / spatial_merge, gw = w / spatial_merge, n = t * gh * gw;
      for (int64_t i = 0; i < n; ++i, ++s) {
        if (s >= seq || !is_image[r * seq + s])
          throw std::invalid_argument("mrope_positions: image " + std::to_string(next - 1) + " needs " +
                                      std::to_string(n) + " image tokens in a row, row " + std::to_string(r) +
                                      " has fewer at position " + std::to_string(s));
        pos[0][r][s] = p + i / (gh * gw);
        pos[1][r][s] = p + (i / gw) % gh;
        pos[2][r][s] = p + i % gw;
      }
      p += std::max(gh, gw);
    }
  }
  if (next != grids.size())
    throw std::invalid_argument("mrope_positions: " + std::to_string(grids.size()) + " images given, " +
                                std::to_string(next) + " image runs in the tokens");
  return out.to(mask.device());
}

vision::PixelInputs pixel_inputs(const std::vector<images::ProcessedImage>& images) {
  vision::PixelInputs in;
  if (images.empty()) return in;
  std::vector<at::Tensor> pixels, grids;
  for (const images::ProcessedImage& p : images) {
    pixels.push_back(p.pixel_values);
    if (p.grid.defined()) grids.push_back(p.grid);
  }
  const at::Tensor& g = images.front().grid;
  if (g.defined() && g.dim() == 1) {  // Qwen: rows of patches, grid [t, h, w]
    in.pixel_values = at::cat(pixels);
    in.grid_thw = at::stack(grids);
  } else {
    in.pixel_values = at::stack(pixels);
    if (g.defined()) in.position_ids = at::stack(grids);  // Gemma 4
  }
  return in;
}

ImageInputs image_inputs(const vision::Tower& tower, const std::vector<images::ProcessedImage>& images,
                         const at::Tensor& tokens, const at::Tensor& position_ids, const DecoderConfig& c) {
  if (c.image_token_id < 0)
    throw std::invalid_argument("image_inputs: the model's config names no image token (image_token_id)");
  ImageInputs in;
  in.mask = tokens.eq(c.image_token_id);
  const vision::PixelInputs pixels = pixel_inputs(images);
  in.features = tower.forward(pixels);
  const int64_t n = in.mask.sum().item<int64_t>();
  if (in.features.size(0) != n)
    throw std::invalid_argument("image_inputs: the tokens hold " + std::to_string(n) + " image tokens (id " +
                                std::to_string(c.image_token_id) + "), the " + std::to_string(images.size()) +
                                " image(s) take " + std::to_string(in.features.size(0)));
  if (!c.mrope_section.empty() && pixels.grid_thw.defined()) {
    std::vector<ImageGrid> grids;
    const at::Tensor g = pixels.grid_thw.cpu().to(at::kLong).contiguous();
    for (int64_t i = 0; i < g.size(0); ++i) grids.push_back({g[i][0].item<int64_t>(), g[i][1].item<int64_t>(), g[i][2].item<int64_t>()});
    in.positions = mrope_positions(in.mask, grids, c.image_spatial_merge, position_ids);
  }
  return in;
}

}  // namespace qlora::models
