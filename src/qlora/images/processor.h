// A model's image processor: one decoded image (decode.h) into the pixel values transformers' processor
// feeds the model, and the text that stands for the image in the rendered chat. Three processors, each
// as transformers 5.23 computes it with its torchvision backend (the one users get with torchvision
// installed; tests/conformance/test_image_processors.py compares with it):
//   qwen2_vl  Qwen2VLImageProcessor (what qwen3_5 / qwen3_5_moe / qwen3_vl / qwen2_vl / qwen2_5_vl map
//             to): smart_resize to multiples of patch_size x merge_size with width x height within
//             size.shortest_edge..size.longest_edge (min/max pixels), resize (bicubic unless the file says),
//             rescale + normalise, the image repeated temporal_patch_size times, patches in the
//             processor's order: pixel_values [grid_h * grid_w, 3 * T * P * P], grid [1, grid_h, grid_w],
//             grid_h * grid_w / merge_size^2 image tokens.
//   gemma3    Gemma3ImageProcessor: a fixed size.height x size.width (896 in the checkpoints), bilinear,
//             rescale + normalise: pixel_values [3, S, S]; image_seq_length tokens (processor_config.json);
//             do_pan_and_scan: true is refused.
//   gemma4    Gemma4ImageProcessor: the aspect-preserving size, multiples of patch_size x
//             pooling_kernel_size within max_soft_tokens x pooling_kernel_size^2 patches, bicubic,
//             rescale only: pixel_values [max_patches, P * P * 3] padded with zeros, grid = the patches'
//             (x, y) positions [max_patches, 2] padded with -1; patches / pooling_kernel_size^2 tokens.
// Rules come from the model directory: processor_config.json's "image_processor" section where it has
// one (as transformers prefers it), else preprocessor_config.json; a key the file omits (or sets to null)
// takes the class default transformers uses. The token strings come from tokenizer_config.json (its
// top-level or extra_special_tokens entries), with the processors' defaults where it has none.
// Resizing calls the ATen ops torchvision calls (the antialiased _upsample_*2d_aa, on uint8 where
// torchvision keeps uint8: bicubic always, bilinear on AVX2/AVX512 CPUs), so the values are equal.
#pragma once

#include "qlora/images/decode.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>

namespace qlora::images {

struct ImageProcessorError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class ProcessorKind { qwen2_vl, gemma3, gemma4 };
const char* processor_kind_name(ProcessorKind kind);  // "qwen2_vl", "gemma3", "gemma4"

enum class Resample { bilinear = 2, bicubic = 3 };  // PIL's numbers, as the files store them

struct ProcessorRules {
  ProcessorKind kind = ProcessorKind::qwen2_vl;
  Resample resample = Resample::bicubic;
  // do_convert_rgb: the image's transparent colour (decode.h) painted white; null in Gemma 3's file, where
  // Gemma3Processor's images_kwargs default (true) applies, as it does for the other classes.
  bool do_convert_rgb = true, do_rescale = true, do_normalize = true;
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean{}, image_std{};
  int64_t patch_size = 0;
  // qwen2_vl
  int64_t min_pixels = 0, max_pixels = 0, temporal_patch_size = 0, merge_size = 0;
  // gemma3
  int64_t height = 0, width = 0;
  // gemma4
  int64_t max_soft_tokens = 0, pooling_kernel_size = 0;
  // text
  int64_t image_seq_length = 0;  // gemma3: tokens per image
  std::string image_token, boi_token, eoi_token;
};

struct ProcessedImage {
  at::Tensor pixel_values;  // float32, as above
  at::Tensor grid;          // int64: qwen2_vl image_grid_thw [3]; gemma4 image_position_ids; gemma3 undefined
  int64_t num_image_tokens = 0;
  int64_t resized_height = 0, resized_width = 0;
};

class ImageProcessor {
 public:
  explicit ImageProcessor(ProcessorRules rules);

  // `source` names the image in errors (an image the rules cannot take, such as an aspect ratio over 200).
  ProcessedImage process(const Image& image, const std::string& source = "image") const;
  // The text the chat template emits for one image, which the processor replaces.
  const std::string& placeholder() const;
  // What replaces it: Qwen <|image_pad|> x n (its template writes <|vision_start|>/<|vision_end|> around
  // it); Gemma 3 "\n\n<start_of_image>" + <image_soft_token> x 256 + "<end_of_image>\n\n"; Gemma 4
  // <|image> + <|image|> x n + <image|>.
  std::string expansion(const ProcessedImage& processed) const;
  const ProcessorRules& rules() const { return rules_; }

 private:
  ProcessorRules rules_;
};

// The rules of the model directory `dir` (see above); throws ImageProcessorError naming the file and
// key when it holds no image processor this code knows, or one it would not compute exactly.
ProcessorRules read_processor_rules(const std::string& dir);
// Whether `dir` has the files read_processor_rules reads (preprocessor_config.json, or a
// processor_config.json with an "image_processor" section), whatever they hold.
bool has_processor_rules(const std::string& dir);
ImageProcessor processor_from_dir(const std::string& dir);

}  // namespace qlora::images
