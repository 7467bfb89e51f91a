// PNG through libpng: png_error longjmps back into png_run, a frame holding no C++ object; the caller
// turns the recorded message into an ImageError. Samples are then mapped to RGB as PIL maps its modes.
#include "qlora/images/codecs.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include <png.h>

namespace qlora::images::detail {
namespace {

struct PngContext {
  png_structp png;
  png_infop info, end;
  char message[256];
  const uint8_t* data;
  size_t size, pos;
  int64_t max_pixels;
  bool over_budget;
  png_uint_32 width, height;
  int color_type, channels, bit_depth;  // channels and bit depth of the rows as read
  size_t rowbytes;
  bool has_transparent;
  uint8_t transparent[3];  // the tRNS colour as PIL's RGB image names it
  unsigned char* rows;  // malloc'ed [height, rowbytes], owned by the caller once set
  png_bytep* row_pointers;
};

void png_fatal(png_structp png, png_const_charp message) {
  auto* ctx = static_cast<PngContext*>(png_get_error_ptr(png));
  std::snprintf(ctx->message, sizeof ctx->message, "%s", message);
  png_longjmp(png, 1);
}

void png_warning_ignored(png_structp, png_const_charp) {}

void png_read_memory(png_structp png, png_bytep out, png_size_t length) {
  auto* ctx = static_cast<PngContext*>(png_get_io_ptr(png));
  if (length > ctx->size - ctx->pos) png_error(png, "truncated: the data ends before the image does");
  std::memcpy(out, ctx->data + ctx->pos, length);
  ctx->pos += length;
}

// Palettes become RGB, gray below 8 bits is scaled to 8 (PIL's "L;2"/"L;4" and "1" to "L" scale alike);
// alpha and 16-bit samples are kept here and mapped by to_rgb, PIL's way.
void png_set_transforms(PngContext* ctx) {
  if (ctx->color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(ctx->png);
  if (ctx->color_type == PNG_COLOR_TYPE_GRAY && ctx->bit_depth < 8) png_set_expand_gray_1_2_4_to_8(ctx->png);
  png_set_interlace_handling(ctx->png);
  png_read_update_info(ctx->png, ctx->info);
}

void set_transparent(PngContext* ctx, int r, int g, int b) {
  if (r > 255 || g > 255 || b > 255) return;  // PIL keeps 16-bit values, which no 8-bit pixel equals
  ctx->has_transparent = true;
  ctx->transparent[0] = static_cast<uint8_t>(r);
  ctx->transparent[1] = static_cast<uint8_t>(g);
  ctx->transparent[2] = static_cast<uint8_t>(b);
}

// PIL's info["transparency"] after convert("RGB"): a palette's single fully transparent entry (only
// when every other entry is opaque; other tRNS chunks are dropped by the conversion) by its colour; a
// gray level as is (PIL keeps the raw 2- and 4-bit value, turns 1-bit's 1 into 255 and clips 16-bit);
// an RGB value as is.
void read_transparent(PngContext* ctx) {
  png_bytep alpha = nullptr;
  int count = 0;
  png_color_16p color = nullptr;
  if (png_get_tRNS(ctx->png, ctx->info, &alpha, &count, &color) == 0) return;
  if (ctx->color_type == PNG_COLOR_TYPE_PALETTE) {
    png_colorp palette = nullptr;
    int entries = 0, zero = -1;
    if (png_get_PLTE(ctx->png, ctx->info, &palette, &entries) == 0 || alpha == nullptr) return;
    for (int i = 0; i < count; ++i) {
      if (alpha[i] == 0 && zero < 0) zero = i;
      else if (alpha[i] != 255) return;
    }
    if (zero >= 0 && zero < entries) set_transparent(ctx, palette[zero].red, palette[zero].green, palette[zero].blue);
  } else if (ctx->color_type == PNG_COLOR_TYPE_GRAY && color != nullptr) {
    int v = color->gray;
    if (ctx->bit_depth == 1) v = v != 0 ? 255 : 0;
    if (ctx->bit_depth == 16) v = std::min(v, 255);
    set_transparent(ctx, v, v, v);
  } else if (ctx->color_type == PNG_COLOR_TYPE_RGB && color != nullptr) {
    set_transparent(ctx, color->red, color->green, color->blue);
  }
}

// Returns false with ctx->message set on a libpng error. Only plain data lives in this frame.
bool png_run(PngContext* ctx) {
  if (setjmp(png_jmpbuf(ctx->png))) return false;
  png_set_read_fn(ctx->png, ctx, png_read_memory);
  png_read_info(ctx->png, ctx->info);
  ctx->width = png_get_image_width(ctx->png, ctx->info);
  ctx->height = png_get_image_height(ctx->png, ctx->info);
  ctx->color_type = png_get_color_type(ctx->png, ctx->info);
  ctx->bit_depth = png_get_bit_depth(ctx->png, ctx->info);
  read_transparent(ctx);
  if (static_cast<int64_t>(ctx->width) * ctx->height > ctx->max_pixels) {
    ctx->over_budget = true;
    return true;
  }
  png_set_transforms(ctx);
  ctx->channels = png_get_channels(ctx->png, ctx->info);
  ctx->bit_depth = png_get_bit_depth(ctx->png, ctx->info);
  ctx->rowbytes = png_get_rowbytes(ctx->png, ctx->info);
  ctx->rows = static_cast<unsigned char*>(std::malloc(ctx->rowbytes * ctx->height));
  ctx->row_pointers = static_cast<png_bytep*>(std::malloc(sizeof(png_bytep) * ctx->height));
  if (ctx->rows == nullptr || ctx->row_pointers == nullptr) {
    std::snprintf(ctx->message, sizeof ctx->message, "out of memory for %ux%u pixels", ctx->width, ctx->height);
    return false;
  }
  for (png_uint_32 y = 0; y < ctx->height; ++y) ctx->row_pointers[y] = ctx->rows + ctx->rowbytes * y;
  png_read_image(ctx->png, ctx->row_pointers);
  png_read_end(ctx->png, ctx->end);
  return true;
}

std::string png_exif(png_structp png, png_infop info) {
  png_uint_32 length = 0;
  png_bytep exif = nullptr;
  if (info != nullptr && png_get_eXIf_1(png, info, &length, &exif) != 0 && exif != nullptr)
    return std::string(reinterpret_cast<const char*>(exif), length);
  return {};
}

// ImageMagick's "Raw profile type exif" text: a header of three lines, then hex (whitespace ignored),
// as PIL's getexif decodes it; empty when it is not hex.
std::string raw_profile_exif(const std::string& text) {
  size_t at = 0;
  for (int line = 0; line < 3 && at != std::string::npos; ++line) at = text.find('\n', at == 0 && line == 0 ? 0 : at + 1);
  if (at == std::string::npos) return {};
  std::string out, digits;
  for (size_t i = at + 1; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ' ' || c == '\n' || c == '\t' || c == '\r') continue;
    if (!std::isxdigit(static_cast<unsigned char>(c))) return {};
    digits += c;
    if (digits.size() == 2) {
      out += static_cast<char>(std::stoi(digits, nullptr, 16));
      digits.clear();
    }
  }
  return digits.empty() ? out : std::string();
}

// The text chunks PIL reads orientation from, the later one winning as in PIL's info dict: the XMP
// packet ("XML:com.adobe.xmp") and, where no eXIf chunk is, the raw Exif profile.
void png_texts(png_structp png, png_infop info, std::string& xmp, std::string& raw_exif) {
  png_textp texts = nullptr;
  int count = 0;
  if (info == nullptr || png_get_text(png, info, &texts, &count) == 0) return;
  for (int i = 0; i < count; ++i) {
    const png_text& t = texts[i];
    const std::string value(t.text != nullptr ? t.text : "", t.itxt_length != 0 ? t.itxt_length : t.text_length);
    if (std::strcmp(t.key, "XML:com.adobe.xmp") == 0) xmp = value;
    if (std::strcmp(t.key, "Raw profile type exif") == 0) raw_exif = value;
  }
}

// One output channel from a row sample: 8-bit as is; 16-bit (big-endian) by its high byte, except
// single-channel gray, which PIL holds as "I;16" and converts to "L" by clipping at 255.
at::Tensor to_rgb(const PngContext& ctx) {
  const int64_t h = ctx.height, w = ctx.width;
  at::Tensor out = at::empty({h, w, 3}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  const bool wide = ctx.bit_depth == 16, gray = ctx.channels <= 2;
  const bool clip16 = wide && ctx.channels == 1;
  const int step = ctx.channels * (wide ? 2 : 1);
  for (int64_t y = 0; y < h; ++y) {
    const unsigned char* row = ctx.rows + ctx.rowbytes * y;
    for (int64_t x = 0; x < w; ++x) {
      const unsigned char* px = row + step * x;
      for (int c = 0; c < 3; ++c) {
        const unsigned char* s = px + (gray ? 0 : c) * (wide ? 2 : 1);
        uint8_t v = s[0];
        if (clip16) v = static_cast<uint8_t>(std::min(255, (s[0] << 8) | s[1]));
        o[(y * w + x) * 3 + c] = v;
      }
    }
  }
  return out;
}

}  // namespace

Decoded decode_png(const uint8_t* data, size_t size, const std::string& where, int64_t max_pixels) {
  PngContext ctx;
  std::memset(&ctx, 0, sizeof ctx);
  ctx.data = data;
  ctx.size = size;
  ctx.max_pixels = max_pixels;
  ctx.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &ctx, png_fatal, png_warning_ignored);
  if (ctx.png == nullptr) fail(where, "libpng could not start (out of memory)");
  ctx.info = png_create_info_struct(ctx.png);
  ctx.end = png_create_info_struct(ctx.png);
  // Bound what a header may ask of libpng before the pixel budget is checked: dimensions (PNG's own
  // limit is 2^31-1) and the memory of one ancillary chunk (a huge iCCP or zTXt).
  png_set_user_limits(ctx.png, 1u << 20, 1u << 20);
  png_set_chunk_malloc_max(ctx.png, 16u << 20);
  const bool ok = ctx.info != nullptr && ctx.end != nullptr && png_run(&ctx);
  Decoded out;
  if (ok && !ctx.over_budget) {
    out.exif = png_exif(ctx.png, ctx.end);
    if (out.exif.empty()) out.exif = png_exif(ctx.png, ctx.info);
    std::string raw_exif;
    png_texts(ctx.png, ctx.info, out.xmp, raw_exif);
    png_texts(ctx.png, ctx.end, out.xmp, raw_exif);
    if (out.exif.empty() && !raw_exif.empty()) out.exif = raw_profile_exif(raw_exif);
  }
  png_destroy_read_struct(&ctx.png, ctx.info != nullptr ? &ctx.info : nullptr, ctx.end != nullptr ? &ctx.end : nullptr);
  std::free(ctx.row_pointers);
  std::unique_ptr<unsigned char, decltype(&std::free)> rows(ctx.rows, &std::free);
  if (!ok) fail(where, std::string("not a readable PNG: ") + ctx.message);
  if (ctx.over_budget) check_dimensions(ctx.width, ctx.height, max_pixels, where);
  out.rgb = to_rgb(ctx);
  if (ctx.has_transparent) out.transparent = std::array<uint8_t, 3>{ctx.transparent[0], ctx.transparent[1], ctx.transparent[2]};
  return out;
}

}  // namespace qlora::images::detail
