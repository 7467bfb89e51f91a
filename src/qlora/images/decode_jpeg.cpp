// JPEG through libjpeg-turbo: errors longjmp back into jpeg_run, a frame holding no C++ object; the
// caller turns the recorded message into an ImageError.
#include "qlora/images/codecs.h"

#include <ATen/ATen.h>

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <jpeglib.h>
#include <jerror.h>

namespace qlora::images::detail {
namespace {

// A legitimate progressive JPEG has about ten scans; a crafted one can hold thousands of tiny ones,
// each a pass over the whole coefficient buffer (libjpeg-turbo's own fuzzers stop at 500 too).
constexpr int kMaxJpegScans = 500;

struct JpegContext {
  jpeg_decompress_struct cinfo;
  jpeg_error_mgr errors;
  jpeg_progress_mgr progress;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  const uint8_t* data;
  size_t size;
  int64_t max_pixels;
  bool created;
  bool over_budget;
  int channels;       // of the output rows: 1 (gray), 3 (RGB) or 4 (CMYK)
  unsigned char* rows;  // malloc'ed [height, width, channels], owned by the caller once set
  // malloc'ed copies of the Exif and XMP APP1 markers (libjpeg frees its own at the end)
  unsigned char *exif, *xmp;
  size_t exif_size, xmp_size;
};

[[noreturn]] void jpeg_fatal(j_common_ptr cinfo) {
  auto* ctx = reinterpret_cast<JpegContext*>(cinfo->client_data);
  (*cinfo->err->format_message)(cinfo, ctx->message);
  std::longjmp(ctx->jump, 1);
}

// Warnings about corrupt data are ignored, as PIL ignores them; the end of the data before the image
// is complete is an error (PIL: "image file is truncated"), not the grey rows libjpeg would invent.
void jpeg_message(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) jpeg_fatal(cinfo);
}

void jpeg_progress(j_common_ptr cinfo) {
  auto* d = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (d->progressive_mode && d->input_scan_number > kMaxJpegScans) {
    auto* ctx = reinterpret_cast<JpegContext*>(cinfo->client_data);
    std::snprintf(ctx->message, sizeof ctx->message, "a progressive JPEG of more than %d scans", kMaxJpegScans);
    std::longjmp(ctx->jump, 1);
  }
}

void copy_marker(const jpeg_marker_struct& m, size_t skip, unsigned char** out, size_t* size) {
  std::free(*out);
  *size = m.data_length - skip;
  *out = static_cast<unsigned char*>(std::malloc(*size + 1));
  if (*out != nullptr) std::memcpy(*out, m.data + skip, *size);
  else *size = 0;
}

// As PIL reads them: the first APP1 marker holding "Exif\0\0" (PIL appends later ones, which only a
// file splitting one IFD0 across markers would need) and the last holding Adobe's XMP namespace,
// copied while libjpeg still holds them.
void copy_app1_markers(JpegContext* ctx) {
  static const char kXmp[] = "http://ns.adobe.com/xap/1.0/";  // with its NUL: 29 bytes
  for (jpeg_saved_marker_ptr m = ctx->cinfo.marker_list; m != nullptr; m = m->next) {
    if (m->marker != JPEG_APP0 + 1) continue;
    if (ctx->exif == nullptr && m->data_length >= 6 && std::memcmp(m->data, "Exif\0\0", 6) == 0)
      copy_marker(*m, 0, &ctx->exif, &ctx->exif_size);
    else if (m->data_length >= sizeof kXmp && std::memcmp(m->data, kXmp, sizeof kXmp) == 0)
      copy_marker(*m, sizeof kXmp, &ctx->xmp, &ctx->xmp_size);
  }
}

// Returns false with ctx->message set on a libjpeg error; true otherwise (over_budget says whether it
// stopped at the header). Only plain data lives in this frame, so longjmp skips no destructor.
bool jpeg_run(JpegContext* ctx) {
  if (setjmp(ctx->jump)) return false;
  jpeg_create_decompress(&ctx->cinfo);
  ctx->created = true;
  ctx->cinfo.client_data = ctx;
  ctx->cinfo.progress = &ctx->progress;
  jpeg_mem_src(&ctx->cinfo, ctx->data, static_cast<unsigned long>(ctx->size));
  jpeg_save_markers(&ctx->cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(&ctx->cinfo, TRUE);
  copy_app1_markers(ctx);
  jpeg_decompress_struct& c = ctx->cinfo;
  if (c.num_components == 1) {
    c.out_color_space = JCS_GRAYSCALE;
    ctx->channels = 1;
  } else if (c.num_components == 3) {
    c.out_color_space = JCS_RGB;
    ctx->channels = 3;
  } else if (c.num_components == 4) {
    c.out_color_space = JCS_CMYK;  // from CMYK or YCCK
    ctx->channels = 4;
  } else {
    std::snprintf(ctx->message, sizeof ctx->message, "a JPEG of %d components (PIL reads 1, 3 or 4)",
                  c.num_components);
    return false;
  }
  if (c.image_width == 0 || c.image_height == 0 ||
      static_cast<int64_t>(c.image_width) * c.image_height > ctx->max_pixels) {
    ctx->over_budget = true;
    return true;
  }
  jpeg_start_decompress(&c);
  const size_t stride = static_cast<size_t>(c.output_width) * ctx->channels;
  ctx->rows = static_cast<unsigned char*>(std::malloc(stride * c.output_height));
  if (ctx->rows == nullptr) {
    std::snprintf(ctx->message, sizeof ctx->message, "out of memory for %ux%u pixels", c.output_width,
                  c.output_height);
    return false;
  }
  while (c.output_scanline < c.output_height) {
    JSAMPROW row = ctx->rows + stride * c.output_scanline;
    jpeg_read_scanlines(&c, &row, 1);
  }
  jpeg_finish_decompress(&c);
  return true;
}


// PIL's cmyk2rgb after its "CMYK;I" unpacking (Adobe's inverted samples, assumed for every 4-component
// JPEG as PIL assumes it): with c, k the stored samples inverted, each channel is nk - c * nk / 255
// rounded as PIL's MULDIV255 rounds, nk = 255 - k.
at::Tensor cmyk_to_rgb(const uint8_t* cmyk, int64_t height, int64_t width) {
  at::Tensor out = at::empty({height, width, 3}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < height * width; ++i) {
    const int nk = cmyk[4 * i + 3];  // 255 - (255 - stored k)
    for (int ch = 0; ch < 3; ++ch) {
      const int c = 255 - cmyk[4 * i + ch];
      const int t = c * nk + 128;
      o[3 * i + ch] = static_cast<uint8_t>(nk - (((t >> 8) + t) >> 8));
    }
  }
  return out;
}

}  // namespace

Decoded decode_jpeg(const uint8_t* data, size_t size, const std::string& where, int64_t max_pixels) {
  JpegContext ctx;
  std::memset(&ctx, 0, sizeof ctx);
  ctx.cinfo.err = jpeg_std_error(&ctx.errors);
  ctx.errors.error_exit = jpeg_fatal;
  ctx.errors.emit_message = jpeg_message;
  ctx.progress.progress_monitor = jpeg_progress;
  ctx.data = data;
  ctx.size = size;
  ctx.max_pixels = max_pixels;
  const bool ok = jpeg_run(&ctx);
  Decoded out;
  const int64_t height = ctx.cinfo.output_height, width = ctx.cinfo.output_width;
  const int64_t declared_w = ctx.cinfo.image_width, declared_h = ctx.cinfo.image_height;
  if (ctx.exif != nullptr) out.exif.assign(reinterpret_cast<const char*>(ctx.exif), ctx.exif_size);
  if (ctx.xmp != nullptr) out.xmp.assign(reinterpret_cast<const char*>(ctx.xmp), ctx.xmp_size);
  std::free(ctx.exif);
  std::free(ctx.xmp);
  if (ctx.created) jpeg_destroy_decompress(&ctx.cinfo);
  // The rows are freed with the tensor that wraps them, or here on any error.
  std::unique_ptr<unsigned char, decltype(&std::free)> rows(ctx.rows, &std::free);
  if (!ok) fail(where, std::string("not a readable JPEG: ") + ctx.message);
  if (ctx.over_budget) check_dimensions(declared_w, declared_h, max_pixels, where);
  const at::Tensor stored = at::from_blob(rows.get(), {height, width, ctx.channels}, at::kByte);
  if (ctx.channels == 4)
    out.rgb = cmyk_to_rgb(rows.get(), height, width);
  else if (ctx.channels == 1)
    out.rgb = stored.expand({height, width, 3}).contiguous();
  else
    out.rgb = at::from_blob(rows.release(), {height, width, 3}, [](void* p) { std::free(p); }, at::kByte);
  return out;
}

}  // namespace qlora::images::detail
