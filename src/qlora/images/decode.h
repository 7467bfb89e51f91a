// Image files into pixels: JPEG, PNG and WebP bytes into an RGB uint8 tensor [H, W, 3], as transformers'
// load_image gives them (PIL: Image.open, ImageOps.exif_transpose, then .convert("RGB")):
//   - EXIF orientation 1..8 applied (the Exif blob of a JPEG's APP1, a PNG's eXIf chunk or its "Raw profile
//     type exif" text, a WebP's EXIF chunk; IFD0's tag 0x0112 only, as PIL reads it; where the Exif has no
//     such tag, an XMP packet's tiff:Orientation, as PIL falls back to it; other values leave the image
//     as stored);
//   - PIL's modes converted as PIL converts them: grayscale replicated; 1/2/4-bit gray scaled to 8 bits;
//     palette looked up (its transparency ignored); an alpha channel dropped, not composited (convert
//     drops it); 16-bit RGB/RGBA/gray+alpha samples keep their high byte, while 16-bit grayscale is
//     clipped at 255 (PIL's "I;16" to "L"); CMYK and YCCK JPEGs (Adobe's inverted CMYK where its APP14
//     marker says so) by PIL's cmyk2rgb: nk - round(c * nk / 255) with nk = 255 - k.
//   - Refused by name: animated WebP, and any other format (GIF, BMP, TIFF, HEIF...).
// Libraries (Debian packages, linked through pkg-config):
//   libjpeg62-turbo-dev  libjpeg-turbo, the decoder Pillow's wheels bundle too, so decoded JPEG pixels
//                        are the same integers (islow IDCT and fancy upsampling, both libraries' defaults);
//   libpng-dev           the reference PNG library (Pillow has its own PNG reader over zlib; PNG is
//                        lossless, so any correct decoder gives PIL's samples; only the mode
//                        conversions above are PIL's own);
//   libwebp-dev          Google's libwebp (and libwebpdemux for a WebP's EXIF chunk), which Pillow wraps;
//   libexif-dev          parses the Exif blob (byte order, IFD0, the orientation entry's type).
// Errors: a truncated, corrupt or wrong-magic file, an unknown format, or an image above the pixel budget
// throws ImageError naming the source (the path or the caller's label, and the record label) and what
// was wrong; the budget is checked from the header, before any pixel buffer is allocated. libjpeg's and
// libpng's errors are caught where they happen (setjmp in frames holding no C++ object), never unwound
// through C code.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace qlora::images {

struct ImageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// 64 Mpixel: a 8192 x 8192 photograph; its RGB buffer is 192 MiB.
inline constexpr int64_t kDefaultMaxPixels = int64_t{64} << 20;

struct DecodeOptions {
  int64_t max_pixels = kDefaultMaxPixels;  // width x height, as declared by the file's header
};

// An upright RGB image: pixels is uint8 [height, width, 3], contiguous. `transparent` is the colour a PNG's
// tRNS chunk names (a palette entry, a gray level or an RGB value, as PIL's converted image still names it
// in info["transparency"]): transformers' processors composite such an image on white, so the pixels of
// that colour become white there (processor.h does it); load_image's pixels keep them.
struct Image {
  at::Tensor pixels;
  std::optional<std::array<uint8_t, 3>> transparent;
  int64_t height() const { return pixels.size(0); }
  int64_t width() const { return pixels.size(1); }
};

enum class ImageFormat { jpeg, png, webp, unknown };
// From the first bytes (magic numbers); unknown for anything else, including too few bytes.
ImageFormat sniff_format(const uint8_t* data, size_t size);
const char* format_name(ImageFormat format);

// Decodes an image held in memory. `source` names it in errors (a path, or "images[2] of data.parquet");
// `record` is the caller's record label ("record 17"), appended when not empty.
Image decode_image(const uint8_t* data, size_t size, std::string_view source, std::string_view record = {},
                   const DecodeOptions& options = {});
Image decode_image(std::string_view bytes, std::string_view source, std::string_view record = {},
                   const DecodeOptions& options = {});

// Reads and decodes a local file. http:// and https:// are refused by name: nothing is downloaded.
Image load_image(const std::string& path, std::string_view record = {}, const DecodeOptions& options = {});

}  // namespace qlora::images
