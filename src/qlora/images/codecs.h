// The per-format decoders behind decode.h (internal to images/). Each returns the stored (not yet
// oriented) image as RGB uint8 [H, W, 3] and the raw Exif blob it carries, if any; every error throws
// ImageError prefixed with `where` (the source and record, as decode.h names them).
#pragma once

#include "qlora/images/decode.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace qlora::images::detail {

struct Decoded {
  at::Tensor rgb;    // uint8 [H, W, 3]
  std::string exif;  // an Exif blob, "Exif\0\0" + TIFF or bare TIFF; empty when the file has none
  std::string xmp;   // an XMP packet (where PIL finds one: JPEG APP1, PNG text "XML:com.adobe.xmp", WebP XMP)
  std::optional<std::array<uint8_t, 3>> transparent;  // Image::transparent, before orientation
};

Decoded decode_jpeg(const uint8_t* data, size_t size, const std::string& where, int64_t max_pixels);
Decoded decode_png(const uint8_t* data, size_t size, const std::string& where, int64_t max_pixels);
Decoded decode_webp(const uint8_t* data, size_t size, const std::string& where, int64_t max_pixels);

[[noreturn]] void fail(const std::string& where, const std::string& what);
// Throws unless 0 < width, height and width x height <= max_pixels (checked before any allocation).
void check_dimensions(int64_t width, int64_t height, int64_t max_pixels, const std::string& where);

}  // namespace qlora::images::detail
