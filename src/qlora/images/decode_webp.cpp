// WebP through libwebp (status codes, no longjmp): the still image as RGB (its alpha dropped, as PIL's
// convert("RGB") drops it; libwebp's RGB samples do not depend on the alpha channel) and the EXIF chunk
// and XMP chunks through libwebpdemux.
#include "qlora/images/codecs.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>

#include <webp/decode.h>
#include <webp/demux.h>

namespace qlora::images::detail {
namespace {

const char* webp_status(VP8StatusCode status) {
  switch (status) {
    case VP8_STATUS_OUT_OF_MEMORY: return "out of memory";
    case VP8_STATUS_INVALID_PARAM: return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR: return "corrupt bitstream";
    case VP8_STATUS_UNSUPPORTED_FEATURE: return "unsupported feature";
    case VP8_STATUS_SUSPENDED: return "suspended";
    case VP8_STATUS_USER_ABORT: return "aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA: return "truncated: the data ends before the image does";
    default: return "unknown error";
  }
}

// The EXIF and XMP chunks, as PIL's info["exif"] and info["xmp"].
void webp_metadata(const uint8_t* data, size_t size, Decoded& out) {
  WebPData blob{data, size};
  WebPDemuxer* demux = WebPDemux(&blob);
  if (demux == nullptr) return;
  for (auto [fourcc, into] : {std::pair{"EXIF", &out.exif}, std::pair{"XMP ", &out.xmp}}) {
    WebPChunkIterator chunk;
    if (WebPDemuxGetChunk(demux, fourcc, 1, &chunk) != 0) {
      into->assign(reinterpret_cast<const char*>(chunk.chunk.bytes), chunk.chunk.size);
      WebPDemuxReleaseChunkIterator(&chunk);
    }
  }
  WebPDemuxDelete(demux);
}

}  // namespace

Decoded decode_webp(const uint8_t* data, size_t size, const std::string& where, int64_t max_pixels) {
  WebPDecoderConfig config;
  if (WebPInitDecoderConfig(&config) == 0) fail(where, "libwebp's version does not match its headers");
  const VP8StatusCode header = WebPGetFeatures(data, size, &config.input);
  if (header != VP8_STATUS_OK) fail(where, std::string("not a readable WebP: ") + webp_status(header));
  if (config.input.has_animation != 0)
    fail(where, "an animated WebP: only still images are read (PIL would take its first frame)");
  check_dimensions(config.input.width, config.input.height, max_pixels, where);
  const int64_t h = config.input.height, w = config.input.width;
  Decoded out;
  out.rgb = at::empty({h, w, 3}, at::kByte);
  config.output.colorspace = MODE_RGB;
  config.output.is_external_memory = 1;
  config.output.u.RGBA.rgba = out.rgb.data_ptr<uint8_t>();
  config.output.u.RGBA.stride = static_cast<int>(w * 3);
  config.output.u.RGBA.size = static_cast<size_t>(h * w * 3);
  const VP8StatusCode status = WebPDecode(data, size, &config);
  WebPFreeDecBuffer(&config.output);
  if (status != VP8_STATUS_OK) fail(where, std::string("not a readable WebP: ") + webp_status(status));
  webp_metadata(data, size, out);
  return out;
}

}  // namespace qlora::images::detail
