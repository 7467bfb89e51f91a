// images/decode.h: errors (truncated, wrong magic, declared dimensions above the budget in a tiny file,
// URLs), EXIF orientations, and PIL's mode conversions on files written here byte by byte (PNG) or from
// the fuzz seeds (JPEG, WebP, written by PIL); images/processor.h: the rules' refusals, and each
// processor's shapes, padding, token counts and text. Pixel values against PIL and transformers
// themselves: conformance.image_processors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "qlora/images/decode.h"
#include "qlora/images/processor.h"

using namespace qlora::images;

namespace {

std::string seed(const std::string& name) {
  std::ifstream in(std::string(QLORA_SOURCE_DIR) + "/tests/fuzz/corpus/image/" + name, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void put32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

std::string chunk(const std::string& tag, const std::string& data) {
  std::string out;
  put32(out, static_cast<uint32_t>(data.size()));
  const std::string body = tag + data;
  out += body;
  put32(out, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()), body.size())));
  return out;
}

// A PNG of `w` x `h` with one IDAT holding `rows` (filter bytes included), plus `extra` chunks before it.
std::string png(uint32_t w, uint32_t h, int depth, int color, const std::string& rows, const std::string& extra = "",
                bool interlaced = false) {
  std::string ihdr;
  put32(ihdr, w);
  put32(ihdr, h);
  ihdr += std::string{static_cast<char>(depth), static_cast<char>(color), 0, 0, static_cast<char>(interlaced)};
  uLongf n = compressBound(rows.size());
  std::string z(n, '\0');
  compress(reinterpret_cast<Bytef*>(z.data()), &n, reinterpret_cast<const Bytef*>(rows.data()), rows.size());
  z.resize(n);
  return std::string("\x89PNG\r\n\x1A\n", 8) + chunk("IHDR", ihdr) + extra + chunk("IDAT", z) + chunk("IEND", "");
}

std::string error_of(const std::string& bytes, const DecodeOptions& options = {}) {
  try {
    decode_image(bytes, "photo.png", "record 7", options);
  } catch (const ImageError& e) {
    return e.what();
  }
  return "";
}

std::vector<int> row(const Image& im, int64_t y, int channel = 0) {
  std::vector<int> out;
  for (int64_t x = 0; x < im.width(); ++x) out.push_back(im.pixels[y][x][channel].item<int>());
  return out;
}

}  // namespace

TEST(ImageDecode, ErrorsNameTheSourceAndWhatWasWrong) {
  const std::string good = png(2, 1, 8, 0, std::string("\0\x10\x20", 3));
  EXPECT_EQ(decode_image(good, "photo.png").pixels.sizes(), (at::IntArrayRef{1, 2, 3}));
  const std::string truncated = error_of(good.substr(0, good.size() - 20));
  EXPECT_NE(truncated.find("image photo.png (record 7): not a readable PNG"), std::string::npos) << truncated;
  const std::string jpeg = seed("exif6.jpg");
  EXPECT_NE(error_of(jpeg.substr(0, jpeg.size() / 2)).find("Premature end of JPEG file"), std::string::npos);
  const std::string webp = seed("lossy.webp");
  EXPECT_NE(error_of(webp.substr(0, webp.size() - 10)).find("not a readable WebP"), std::string::npos);
  EXPECT_NE(error_of("GIF89a....").find("a GIF image: JPEG, PNG and WebP are read"), std::string::npos);
  EXPECT_NE(error_of("hello").find("no JPEG, PNG or WebP signature"), std::string::npos);
  EXPECT_NE(error_of("").find("an empty file"), std::string::npos);
}

TEST(ImageDecode, BudgetCheckedFromTheHeaderOfATinyFile) {
  // 60000 x 60000 declared in a file of ~70 bytes: refused before any pixel buffer exists.
  const std::string huge = png(60000, 60000, 8, 2, std::string(4, '\0'));
  const std::string e = error_of(huge);
  EXPECT_NE(e.find("declares 60000x60000 pixels, above the budget of 67108864 pixels"), std::string::npos) << e;
  DecodeOptions small;
  small.max_pixels = 3;
  EXPECT_NE(error_of(png(2, 2, 8, 0, std::string(6, '\0')), small).find("above the budget of 3"), std::string::npos);
  // libjpeg's and libwebp's headers too (the seeds are 6 x 8).
  EXPECT_NE(error_of(seed("exif6.jpg"), small).find("declares 6x8 pixels"), std::string::npos);
  EXPECT_NE(error_of(seed("lossy.webp"), small).find("declares 6x8 pixels"), std::string::npos);
}

TEST(ImageDecode, UrlsAreRefusedByName) {
  for (const char* url : {"http://example.com/a.png", "HTTPS://example.com/a.jpg"}) {
    try {
      load_image(url, "record 3");
      FAIL() << url;
    } catch (const ImageError& e) {
      EXPECT_NE(std::string(e.what()).find("a URL: images are read from local files only"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("record 3"), std::string::npos);
    }
  }
  EXPECT_THROW(load_image("/nonexistent/a.png"), ImageError);
}

TEST(ImageDecode, PilModes) {
  // 16-bit gray is clipped at 255 (PIL's I;16 -> L); 16-bit RGB keeps the high byte.
  const std::string g16 = png(3, 1, 16, 0, std::string("\0\x00\xC8\x01\x00\xFF\xFF", 7));
  EXPECT_EQ(row(decode_image(g16, "g16"), 0), (std::vector<int>{200, 255, 255}));
  const std::string rgb16 = png(1, 1, 16, 2, std::string("\0\x7F\x80\x80\xFF\x01\xFF", 7));
  const Image c = decode_image(rgb16, "rgb16");
  EXPECT_EQ((std::vector<int>{c.pixels[0][0][0].item<int>(), c.pixels[0][0][1].item<int>(), c.pixels[0][0][2].item<int>()}),
            (std::vector<int>{0x7F, 0x80, 0x01}));
  // 2-bit gray scaled to 8 bits (x 85); gray + alpha drops the alpha.
  EXPECT_EQ(row(decode_image(png(4, 1, 2, 0, std::string("\0\x1B", 2)), "g2"), 0), (std::vector<int>{0, 85, 170, 255}));
  EXPECT_EQ(row(decode_image(png(2, 1, 8, 4, std::string("\0\x10\x00\x20\xFF", 5)), "la"), 0, 2), (std::vector<int>{16, 32}));
  // A palette with one transparent entry: looked up as stored, its colour named for the processors.
  std::string plte("\x0A\x0B\x0C\x14\x15\x16", 6), trns("\xFF\x00", 2);
  const Image p = decode_image(png(2, 1, 8, 3, std::string("\0\x00\x01", 3), chunk("PLTE", plte) + chunk("tRNS", trns)), "p");
  EXPECT_EQ(row(p, 0), (std::vector<int>{10, 20}));
  ASSERT_TRUE(p.transparent.has_value());
  EXPECT_EQ(p.transparent->at(0), 20);
  // CMYK and grayscale JPEGs come out RGB.
  EXPECT_EQ(decode_image(seed("cmyk.jpg"), "cmyk").pixels.size(2), 3);
  const Image gray = decode_image(seed("gray.jpg"), "gray");
  EXPECT_TRUE(gray.pixels.select(2, 0).equal(gray.pixels.select(2, 2)));
}

TEST(ImageDecode, InterlacedPng) {
  // 3 x 3 gray, pixel (x, y) = 10 y + x, in Adam7's passes: 1 (0,0); 4 (2,0); 5 (0,2) (2,2);
  // 6 (1,0) / (1,2); 7 the middle row. Passes 2 and 3 are empty at this size.
  const std::string passes("\0\x00" "\0\x02" "\0\x14\x16" "\0\x01" "\0\x15" "\0\x0A\x0B\x0C", 15);
  const Image im = decode_image(png(3, 3, 8, 0, passes, "", /*interlaced=*/true), "adam7");
  for (int64_t y = 0; y < 3; ++y) EXPECT_EQ(row(im, y), (std::vector<int>{int(10 * y), int(10 * y + 1), int(10 * y + 2)}));
}

TEST(ImageDecode, ExifOrientations) {
  // A 3 x 2 image (values 0..5 row-major) with each orientation in a PNG eXIf chunk (big-endian TIFF).
  const std::string rows("\0\x00\x01\x02\0\x03\x04\x05", 8);
  const std::vector<std::vector<int>> upright = {
      {}, {0, 1, 2, 3, 4, 5}, {2, 1, 0, 5, 4, 3}, {5, 4, 3, 2, 1, 0}, {3, 4, 5, 0, 1, 2},
      {0, 3, 1, 4, 2, 5}, {3, 0, 4, 1, 5, 2}, {5, 2, 4, 1, 3, 0}, {2, 5, 1, 4, 0, 3}};
  for (int o = 1; o <= 8; ++o) {
    std::string tiff("MM\0\x2A\0\0\0\x08\0\x01\x01\x12\0\x03\0\0\0\x01\0", 19);
    tiff += static_cast<char>(o);
    tiff += std::string(6, '\0');
    const Image im = decode_image(png(3, 2, 8, 0, rows, chunk("eXIf", tiff)), "o");
    std::vector<int> got;
    for (int64_t y = 0; y < im.height(); ++y)
      for (int v : row(im, y)) got.push_back(v);
    EXPECT_EQ(got, upright[o]) << "orientation " << o;
    EXPECT_EQ(im.height(), o >= 5 ? 3 : 2) << "orientation " << o;
  }
  // The JPEG seed carries orientation 6 (90 degrees clockwise): 6 x 8 stored, 8 x 6 upright.
  const Image j = decode_image(seed("exif6.jpg"), "j");
  EXPECT_EQ(j.height(), 6);
  EXPECT_EQ(j.width(), 8);
}

TEST(ImageProcessorRules, RefusalsNameTheKey) {
  const std::string dir = std::string(QLORA_SOURCE_DIR) + "/tests/data/processors/";
  EXPECT_EQ(read_processor_rules(dir + "gemma3").image_seq_length, 256);
  EXPECT_EQ(read_processor_rules(dir + "qwen3_5").max_pixels, 16777216);
  EXPECT_EQ(read_processor_rules(dir + "gemma4").max_soft_tokens, 280);
  auto refusal = [](const std::string& dir) -> std::string {
    try {
      read_processor_rules(dir);
    } catch (const ImageProcessorError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal(dir + "nonexistent").find("no preprocessor_config.json"), std::string::npos);
  const std::string tmp = ::testing::TempDir() + "qlora_processor_rules";
  std::filesystem::create_directories(tmp);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": true})", "\"do_pan_and_scan\": true"},
      {R"({"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 100})", "must be one of 70, 140, 280"},
      {R"({"image_processor_type": "Qwen2VLImageProcessor", "resample": 0})", "(nearest): only bilinear"},
      {R"({"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 10}})", "needs both"},
      {R"({"image_processor_type": "SiglipImageProcessor"})", "not an image processor computed here"},
      {R"({"image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5, 0.5]})", "three numbers"}};
  for (const auto& [json, expected] : cases) {
    std::ofstream(tmp + "/preprocessor_config.json") << json;
    const std::string e = refusal(tmp);
    EXPECT_NE(e.find(expected), std::string::npos) << json << " -> " << e;
    EXPECT_NE(e.find("preprocessor_config.json"), std::string::npos) << e;
  }
}

TEST(ImageProcessors, ShapesTokensAndText) {
  const std::string dir = std::string(QLORA_SOURCE_DIR) + "/tests/data/processors/";
  Image image{at::randint(0, 256, {97, 173, 3}, at::kByte), std::nullopt};
  // Qwen3.5: 97 x 173 is below 65536 pixels, so smart_resize scales it up to 192 x 352 (12 x 22 patches).
  const ImageProcessor qwen = processor_from_dir(dir + "qwen3_5");
  const ProcessedImage q = qwen.process(image);
  EXPECT_EQ(q.grid.sizes(), (at::IntArrayRef{3}));
  EXPECT_EQ((std::vector<int64_t>{q.grid[0].item<int64_t>(), q.grid[1].item<int64_t>(), q.grid[2].item<int64_t>()}),
            (std::vector<int64_t>{1, 12, 22}));
  EXPECT_EQ(q.pixel_values.sizes(), (at::IntArrayRef{12 * 22, 3 * 2 * 16 * 16}));
  EXPECT_EQ(q.num_image_tokens, 66);
  EXPECT_EQ(qwen.placeholder(), "<|image_pad|>");
  EXPECT_EQ(qwen.expansion(q).size(), 66 * std::string("<|image_pad|>").size());
  // Gemma 4: patches beyond the image are zeros at position (-1, -1).
  const ImageProcessor gemma4 = processor_from_dir(dir + "gemma4");
  const ProcessedImage g4 = gemma4.process(image);
  const int64_t n = g4.num_image_tokens * 9;
  EXPECT_EQ(g4.pixel_values.sizes(), (at::IntArrayRef{280 * 9, 16 * 16 * 3}));
  EXPECT_TRUE(g4.grid.narrow(0, n, 280 * 9 - n).eq(-1).all().item<bool>());
  EXPECT_TRUE(g4.pixel_values.narrow(0, n, 280 * 9 - n).eq(0).all().item<bool>());
  std::string soft;
  for (int64_t i = 0; i < g4.num_image_tokens; ++i) soft += "<|image|>";
  EXPECT_EQ(gemma4.expansion(g4), "<|image>" + soft + "<image|>");
  // Gemma 3: 896 x 896, 256 tokens wrapped in blank lines; a transparent colour is painted white (1.0).
  const ImageProcessor gemma3 = processor_from_dir(dir + "gemma3");
  Image flat{at::full({5, 7, 3}, 40, at::kByte), std::array<uint8_t, 3>{40, 40, 40}};
  const ProcessedImage g3 = gemma3.process(flat);
  EXPECT_EQ(g3.pixel_values.sizes(), (at::IntArrayRef{3, 896, 896}));
  EXPECT_TRUE(g3.pixel_values.eq(1.0f).all().item<bool>());
  EXPECT_EQ(gemma3.placeholder(), "<start_of_image>");
  const std::string e = gemma3.expansion(g3);
  EXPECT_EQ(e.rfind("\n\n<start_of_image><image_soft_token>", 0), 0u);
  EXPECT_EQ(e.substr(e.size() - 16), "<end_of_image>\n\n");
  EXPECT_EQ(g3.num_image_tokens, 256);
}
