// The format dispatch, errors, and PIL's ImageOps.exif_transpose on the decoded pixels.
#include "qlora/images/decode.h"

#include "qlora/images/codecs.h"
#include "qlora/io/read_file.h"

#include <ATen/ATen.h>

#include <strings.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include <libexif/exif-data.h>

namespace qlora::images {
namespace detail {

void fail(const std::string& where, const std::string& what) { throw ImageError(where + ": " + what); }

void check_dimensions(int64_t width, int64_t height, int64_t max_pixels, const std::string& where) {
  if (width <= 0 || height <= 0)
    fail(where, "declares an empty image (" + std::to_string(width) + "x" + std::to_string(height) + ")");
  if (width > max_pixels / height)
    fail(where, "declares " + std::to_string(width) + "x" + std::to_string(height) + " pixels, above the budget of " +
                    std::to_string(max_pixels) + " pixels");
}

}  // namespace detail

namespace {

// Image files larger than this are refused before reading: the pixel budget bounds what decoding
// allocates, this what reading the file does (an 8192 x 8192 PNG of noise is ~200 MB).
constexpr uint64_t kMaxImageFileBytes = uint64_t{1} << 30;

bool starts_with(const uint8_t* data, size_t size, const char* magic, size_t n, size_t at = 0) {
  return size >= at + n && std::memcmp(data + at, magic, n) == 0;
}

// What an unsupported file most likely is, for the error message.
std::string other_format(const uint8_t* data, size_t size) {
  if (starts_with(data, size, "GIF8", 4)) return "a GIF image";
  if (starts_with(data, size, "BM", 2)) return "a BMP image";
  if (starts_with(data, size, "II*\0", 4) || starts_with(data, size, "MM\0*", 4)) return "a TIFF image";
  if (starts_with(data, size, "ftyp", 4, 4)) return "an ISO media file (HEIF/AVIF?)";
  if (size == 0) return "an empty file";
  return "not an image file of a known format (no JPEG, PNG or WebP signature)";
}

// IFD0's orientation (0x0112), as PIL's getexif reads it; nullopt when the blob holds no such entry, 1
// when it holds one of another type than SHORT or LONG (PIL then reads no XMP either).
std::optional<int> exif_orientation(const std::string& blob) {
  if (blob.empty()) return std::nullopt;
  static const char kHeader[] = "Exif\0\0";
  const std::string data = blob.compare(0, 6, kHeader, 6) == 0 ? blob : std::string(kHeader, 6) + blob;
  ExifData* exif = exif_data_new();
  if (exif == nullptr) return std::nullopt;
  // Read what the file holds: no tags added or dropped by libexif's notion of the specification.
  exif_data_unset_option(exif, EXIF_DATA_OPTION_FOLLOW_SPECIFICATION);
  exif_data_unset_option(exif, EXIF_DATA_OPTION_IGNORE_UNKNOWN_TAGS);
  exif_data_load_data(exif, reinterpret_cast<const unsigned char*>(data.data()), static_cast<unsigned>(data.size()));
  std::optional<int> orientation;
  const ExifEntry* entry = exif_content_get_entry(exif->ifd[EXIF_IFD_0], EXIF_TAG_ORIENTATION);
  if (entry != nullptr) {
    const ExifByteOrder order = exif_data_get_byte_order(exif);
    orientation = 1;
    if (entry->format == EXIF_FORMAT_SHORT && entry->components >= 1 && entry->size >= 2)
      orientation = exif_get_short(entry->data, order);
    else if (entry->format == EXIF_FORMAT_LONG && entry->components >= 1 && entry->size >= 4)
      orientation = static_cast<int>(exif_get_long(entry->data, order));
  }
  exif_data_unref(exif);
  return orientation;
}

// PIL's fallback where the Exif has no orientation: the first match of tiff:Orientation(="|>)([0-9]).
std::optional<int> xmp_orientation(const std::string& xmp) {
  static const std::string kKey = "tiff:Orientation";
  for (size_t at = xmp.find(kKey); at != std::string::npos; at = xmp.find(kKey, at + 1)) {
    size_t p = at + kKey.size();
    if (xmp.compare(p, 2, "=\"") == 0)
      p += 2;
    else if (p < xmp.size() && xmp[p] == '>')
      p += 1;
    else
      continue;
    if (p < xmp.size() && xmp[p] >= '0' && xmp[p] <= '9') return xmp[p] - '0';
  }
  return std::nullopt;
}

// PIL's transposes for orientations 2..8 on [H, W, 3]; others leave the image as stored.
at::Tensor orient(const at::Tensor& rgb, int orientation) {
  switch (orientation) {
    case 2: return rgb.flip({1});                        // FLIP_LEFT_RIGHT
    case 3: return rgb.flip({0, 1});                     // ROTATE_180
    case 4: return rgb.flip({0});                        // FLIP_TOP_BOTTOM
    case 5: return rgb.transpose(0, 1);                  // TRANSPOSE
    case 6: return rgb.transpose(0, 1).flip({1});        // ROTATE_270 (90 degrees clockwise)
    case 7: return rgb.transpose(0, 1).flip({0, 1});     // TRANSVERSE
    case 8: return rgb.transpose(0, 1).flip({0});        // ROTATE_90 (counter-clockwise)
    default: return rgb;
  }
}

std::string where_of(std::string_view source, std::string_view record) {
  std::string where = "image " + std::string(source);
  if (!record.empty()) where += " (" + std::string(record) + ")";
  return where;
}

}  // namespace

ImageFormat sniff_format(const uint8_t* data, size_t size) {
  if (starts_with(data, size, "\xFF\xD8\xFF", 3)) return ImageFormat::jpeg;
  if (starts_with(data, size, "\x89PNG\r\n\x1A\n", 8)) return ImageFormat::png;
  if (starts_with(data, size, "RIFF", 4) && starts_with(data, size, "WEBP", 4, 8)) return ImageFormat::webp;
  return ImageFormat::unknown;
}

const char* format_name(ImageFormat format) {
  switch (format) {
    case ImageFormat::jpeg: return "JPEG";
    case ImageFormat::png: return "PNG";
    case ImageFormat::webp: return "WebP";
    default: return "unknown";
  }
}

Image decode_image(const uint8_t* data, size_t size, std::string_view source, std::string_view record,
                   const DecodeOptions& options) {
  const std::string where = where_of(source, record);
  detail::Decoded decoded;
  switch (sniff_format(data, size)) {
    case ImageFormat::jpeg: decoded = detail::decode_jpeg(data, size, where, options.max_pixels); break;
    case ImageFormat::png: decoded = detail::decode_png(data, size, where, options.max_pixels); break;
    case ImageFormat::webp: decoded = detail::decode_webp(data, size, where, options.max_pixels); break;
    default: detail::fail(where, other_format(data, size) + ": JPEG, PNG and WebP are read");
  }
  const int orientation = exif_orientation(decoded.exif).value_or(xmp_orientation(decoded.xmp).value_or(1));
  return Image{orient(decoded.rgb, orientation).contiguous(), decoded.transparent};
}

Image decode_image(std::string_view bytes, std::string_view source, std::string_view record,
                   const DecodeOptions& options) {
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), source, record, options);
}

Image load_image(const std::string& path, std::string_view record, const DecodeOptions& options) {
  const std::string where = where_of(path, record);
  for (const char* scheme : {"http://", "https://"}) {
    if (path.size() >= std::strlen(scheme) && strncasecmp(path.c_str(), scheme, std::strlen(scheme)) == 0)
      detail::fail(where, "a URL: images are read from local files only, nothing is downloaded");
  }
  std::optional<std::string> bytes;
  try {
    bytes = io::read_file(path, kMaxImageFileBytes);
  } catch (const std::invalid_argument& e) {
    throw ImageError(where + ": " + e.what());
  }
  if (!bytes) detail::fail(where, std::string("cannot be read: ") + std::strerror(errno));
  return decode_image(*bytes, path, record, options);
}

}  // namespace qlora::images
