// An image file from untrusted bytes: JPEG, PNG or WebP decoded (libjpeg's and libpng's errors caught
// where they happen, the pixel budget checked from the header), its EXIF orientation applied, then a
// small one through Qwen2-VL's processor rules (smart_resize's edge cases: 1-pixel sides, aspect ratios).
#include <cstdint>
#include <exception>

#include "qlora/images/decode.h"
#include "qlora/images/processor.h"

namespace {

qlora::images::ImageProcessor small_qwen() {
  qlora::images::ProcessorRules r;
  r.kind = qlora::images::ProcessorKind::qwen2_vl;
  r.image_mean = r.image_std = {0.5, 0.5, 0.5};
  r.patch_size = 16;
  r.temporal_patch_size = 2;
  r.merge_size = 2;
  r.min_pixels = 32 * 32;
  r.max_pixels = 128 * 128;
  r.image_token = "<|image_pad|>";
  return qlora::images::ImageProcessor(r);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const qlora::images::ImageProcessor processor = small_qwen();
  qlora::images::DecodeOptions options;
  options.max_pixels = int64_t{4} << 20;  // fuzzing's memory bound (-rss_limit_mb), not a product limit
  try {
    const qlora::images::Image image = qlora::images::decode_image(data, size, "fuzz input", "record 0", options);
    if (image.height() * image.width() <= 64 * 64) (void)processor.process(image, "fuzz input");
  } catch (const std::exception&) {
  }
  return 0;
}
