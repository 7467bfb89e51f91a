// The three processors' arithmetic, step by step as transformers 5.23 + torchvision 0.26 run it on CPU:
// the uint8 CHW image, torchvision's resize (same ATen op, same dtype), the fused rescale + normalise
// (or the rescale alone), then each processor's patch layout.
#include "qlora/images/processor.h"

#include <ATen/ATen.h>
#include <ATen/Version.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace qlora::images {
namespace {

[[noreturn]] void refuse_image(const std::string& source, const std::string& what) {
  throw ImageProcessorError(source + ": " + what);
}

// tvF.resize_image on a CPU tensor: uint8 goes to the antialiased ATen kernel as is for bicubic, and for
// bilinear where the CPU has AVX2/AVX512 (torchvision's _do_native_uint8_resize_on_cpu); otherwise it
// is resized in float32 and rounded back (bicubic clamped first). The same size returns the input.
at::Tensor torchvision_resize(const at::Tensor& image, int64_t height, int64_t width, Resample resample) {
  if (image.size(-2) == height && image.size(-1) == width) return image;
  const std::string capability = at::get_cpu_capability();
  const bool native = resample == Resample::bicubic || capability == "AVX2" || capability == "AVX512";
  const at::Tensor input = native ? image : image.to(at::kFloat);
  const std::vector<int64_t> size{height, width};
  at::Tensor out = resample == Resample::bicubic
                       ? at::_upsample_bicubic2d_aa(input, size, /*align_corners=*/false, std::nullopt, std::nullopt)
                       : at::_upsample_bilinear2d_aa(input, size, /*align_corners=*/false, std::nullopt, std::nullopt);
  if (!native) {
    if (resample == Resample::bicubic) out.clamp_(0, 255);
    out = out.round_().to(at::kByte);
  }
  return out;
}

// TorchvisionBackend.rescale_and_normalize: with both steps the factor is folded into mean and std
// (float32 tensors times 1 / rescale_factor) and the float32 image is normalised in place; with the
// rescale alone the uint8 image is multiplied by the factor (a float32 result).
at::Tensor rescale_and_normalize(const at::Tensor& image, const ProcessorRules& r) {
  auto channel = [](const std::array<double, 3>& v) { return at::tensor({v[0], v[1], v[2]}, at::kFloat); };
  if (r.do_normalize) {
    at::Tensor mean = channel(r.image_mean), std = channel(r.image_std);
    if (r.do_rescale) {
      mean = mean.mul(1.0 / r.rescale_factor);
      std = std.mul(1.0 / r.rescale_factor);
    }
    return image.to(at::kFloat).sub_(mean.view({-1, 1, 1})).div_(std.view({-1, 1, 1}));
  }
  if (r.do_rescale) return image.mul(r.rescale_factor);
  return image.to(at::kFloat);
}

// Qwen2-VL's smart_resize: Python's round (half to even), floor and ceil on doubles, in its order.
std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, const ProcessorRules& r, const std::string& source) {
  const int64_t factor = r.patch_size * r.merge_size;
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  if (std::max(h, w) / std::min(h, w) > 200)
    refuse_image(source, std::to_string(width) + "x" + std::to_string(height) +
                       " has an aspect ratio above 200, which Qwen2-VL's processor refuses");
  int64_t h_bar = static_cast<int64_t>(std::nearbyint(h / factor)) * factor;
  int64_t w_bar = static_cast<int64_t>(std::nearbyint(w / factor)) * factor;
  if (h_bar * w_bar > r.max_pixels) {
    const double beta = std::sqrt(h * w / static_cast<double>(r.max_pixels));
    h_bar = std::max(factor, static_cast<int64_t>(std::floor(h / beta / factor)) * factor);
    w_bar = std::max(factor, static_cast<int64_t>(std::floor(w / beta / factor)) * factor);
  } else if (h_bar * w_bar < r.min_pixels) {
    const double beta = std::sqrt(static_cast<double>(r.min_pixels) / (h * w));
    h_bar = static_cast<int64_t>(std::ceil(h * beta / factor)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / factor)) * factor;
  }
  return {h_bar, w_bar};
}

ProcessedImage process_qwen(const at::Tensor& chw, const ProcessorRules& r, const std::string& source) {
  const auto [height, width] = smart_resize(chw.size(1), chw.size(2), r, source);
  const at::Tensor resized = torchvision_resize(chw.unsqueeze(0), height, width, r.resample);
  const at::Tensor x = rescale_and_normalize(resized, r);
  const int64_t p = r.patch_size, m = r.merge_size, t = r.temporal_patch_size;
  const int64_t gh = height / p, gw = width / p;
  // [1, C, gh/m, m, p, gw/m, m, p] -> [1, gh/m, gw/m, m, m, C, p, p], the frame repeated t times.
  const at::Tensor patches = x.reshape({1, 3, gh / m, m, p, gw / m, m, p}).permute({0, 2, 5, 3, 6, 1, 4, 7});
  ProcessedImage out;
  out.pixel_values =
      patches.unsqueeze(6).expand({-1, -1, -1, -1, -1, -1, t, -1, -1}).reshape({gh * gw, 3 * t * p * p});
  out.grid = at::tensor({int64_t{1}, gh, gw}, at::kLong);
  out.num_image_tokens = gh * gw / (m * m);
  out.resized_height = height;
  out.resized_width = width;
  return out;
}

ProcessedImage process_gemma3(const at::Tensor& chw, const ProcessorRules& r) {
  const at::Tensor resized = torchvision_resize(chw.unsqueeze(0), r.height, r.width, r.resample);
  ProcessedImage out;
  out.pixel_values = rescale_and_normalize(resized, r).squeeze(0);
  out.num_image_tokens = r.image_seq_length;
  out.resized_height = r.height;
  out.resized_width = r.width;
  return out;
}

// Gemma 4's get_aspect_ratio_preserving_size.
std::pair<int64_t, int64_t> gemma4_size(int64_t height, int64_t width, const ProcessorRules& r, const std::string& source) {
  const int64_t max_patches = r.max_soft_tokens * r.pooling_kernel_size * r.pooling_kernel_size;
  const int64_t target_px = max_patches * r.patch_size * r.patch_size;
  const double factor = std::sqrt(static_cast<double>(target_px) / static_cast<double>(height * width));
  const int64_t side = r.pooling_kernel_size * r.patch_size;
  int64_t th = static_cast<int64_t>(std::floor(factor * height / side)) * side;
  int64_t tw = static_cast<int64_t>(std::floor(factor * width / side)) * side;
  const std::string dims = std::to_string(width) + "x" + std::to_string(height);
  if (th == 0 && tw == 0) refuse_image(source, dims + " would be resized to 0x0 by Gemma 4's processor");
  const int64_t max_side = (max_patches / (r.pooling_kernel_size * r.pooling_kernel_size)) * side;
  if (th == 0) {
    th = side;
    tw = std::min(static_cast<int64_t>(std::floor(static_cast<double>(width) / height)) * side, max_side);
  } else if (tw == 0) {
    tw = side;
    th = std::min(static_cast<int64_t>(std::floor(static_cast<double>(height) / width)) * side, max_side);
  }
  if (th * tw > target_px) refuse_image(source, dims + " would need more than " + std::to_string(max_patches) + " patches");
  return {th, tw};
}

ProcessedImage process_gemma4(const at::Tensor& chw, const ProcessorRules& r, const std::string& source) {
  const auto [height, width] = gemma4_size(chw.size(1), chw.size(2), r, source);
  const at::Tensor resized = torchvision_resize(chw.unsqueeze(0), height, width, r.resample).squeeze(0);
  const at::Tensor x = rescale_and_normalize(resized, r);
  const int64_t p = r.patch_size, ph = height / p, pw = width / p, n = ph * pw;
  const int64_t max_patches = r.max_soft_tokens * r.pooling_kernel_size * r.pooling_kernel_size;
  const at::Tensor patches = x.reshape({3, ph, p, pw, p}).permute({1, 3, 2, 4, 0}).reshape({n, -1});
  const std::vector<at::Tensor> xy = at::meshgrid({at::arange(pw), at::arange(ph)}, "xy");
  const at::Tensor positions = at::stack(xy, -1).reshape({n, 2});
  ProcessedImage out;
  out.pixel_values = at::zeros({max_patches, patches.size(1)}, at::kFloat);
  out.pixel_values.narrow(0, 0, n).copy_(patches);
  out.grid = at::full({max_patches, 2}, -1, at::kLong);
  out.grid.narrow(0, 0, n).copy_(positions);
  out.num_image_tokens = n / (r.pooling_kernel_size * r.pooling_kernel_size);
  out.resized_height = height;
  out.resized_width = width;
  return out;
}

std::string repeat(const std::string& s, int64_t n) {
  std::string out;
  out.reserve(s.size() * static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out += s;
  return out;
}

}  // namespace

ImageProcessor::ImageProcessor(ProcessorRules rules) : rules_(std::move(rules)) {}

ProcessedImage ImageProcessor::process(const Image& image, const std::string& source) const {
  const at::Tensor& hwc = image.pixels;
  if (!hwc.defined() || hwc.dim() != 3 || hwc.size(2) != 3 || hwc.scalar_type() != at::kByte)
    refuse_image(source, "not an RGB uint8 image [H, W, 3]");
  at::Tensor rgb = hwc;
  if (image.transparent && rules_.do_convert_rgb) {  // convert_to_rgb: RGBA composited on white, so the transparent colour is white
    const auto& c = *image.transparent;
    const at::Tensor colour = at::tensor({c[0], c[1], c[2]}, at::kByte);
    rgb = hwc.masked_fill(hwc.eq(colour).all(-1, /*keepdim=*/true), 255);
  }
  const at::Tensor chw = rgb.permute({2, 0, 1}).contiguous();
  switch (rules_.kind) {
    case ProcessorKind::qwen2_vl: return process_qwen(chw, rules_, source);
    case ProcessorKind::gemma3: return process_gemma3(chw, rules_);
    default: return process_gemma4(chw, rules_, source);
  }
}

const std::string& ImageProcessor::placeholder() const {
  return rules_.kind == ProcessorKind::gemma3 ? rules_.boi_token : rules_.image_token;
}

std::string ImageProcessor::expansion(const ProcessedImage& processed) const {
  const std::string soft = repeat(rules_.image_token, processed.num_image_tokens);
  switch (rules_.kind) {
    case ProcessorKind::qwen2_vl: return soft;
    case ProcessorKind::gemma3: return "\n\n" + rules_.boi_token + soft + rules_.eoi_token + "\n\n";
    default: return rules_.boi_token + soft + rules_.eoi_token;
  }
}

}  // namespace qlora::images
