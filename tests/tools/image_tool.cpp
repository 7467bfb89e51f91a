// Decodes image files and runs model directories' image processors on them, for
// tests/conformance/test_image_processors.py (one process for every image: LibTorch loads once).
//   image_tool OUT_DIR [--processor NAME=DIR]... IMAGE...
// For the i-th IMAGE (0-based): OUT_DIR/i.decode.safetensors holds "rgb" (uint8 [H, W, 3]); for each
// processor OUT_DIR/i.NAME.safetensors holds "pixel_values" (float32), "grid" (int64, where the processor
// has one), "num_image_tokens" and "resized" ([height, width]) (int64), with the metadata "placeholder"
// and "expansion". An image or processor that fails writes OUT_DIR/i.error.txt (or i.NAME.error.txt)
// with its message instead.
#include <ATen/ATen.h>

#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "qlora/images/decode.h"
#include "qlora/images/processor.h"
#include "qlora/io/safetensors.h"

using namespace qlora;

namespace {

void write_error(const std::string& path, const std::string& message) { std::ofstream(path) << message; }

void run_processor(const images::ImageProcessor& processor, const images::Image& image, const std::string& stem,
                   const std::string& source) {
  try {
    const images::ProcessedImage p = processor.process(image, source);
    std::vector<std::pair<std::string, at::Tensor>> tensors{
        {"pixel_values", p.pixel_values.contiguous()},
        {"num_image_tokens", at::tensor({p.num_image_tokens}, at::kLong)},
        {"resized", at::tensor({p.resized_height, p.resized_width}, at::kLong)}};
    if (p.grid.defined()) tensors.emplace_back("grid", p.grid.contiguous());
    io::save_safetensors(stem + ".safetensors", tensors,
                         {{"placeholder", processor.placeholder()}, {"expansion", processor.expansion(p)}});
  } catch (const std::exception& e) {
    write_error(stem + ".error.txt", e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: image_tool OUT_DIR [--processor NAME=DIR]... IMAGE...\n");
    return 2;
  }
  const std::string out = argv[1];
  try {
    std::vector<std::pair<std::string, images::ImageProcessor>> processors;
    std::vector<std::string> paths;
    for (int i = 2; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--processor" && i + 1 < argc) {
        const std::string spec = argv[++i];
        const size_t eq = spec.find('=');
        processors.emplace_back(spec.substr(0, eq), images::processor_from_dir(spec.substr(eq + 1)));
      } else {
        paths.push_back(arg);
      }
    }
    for (size_t i = 0; i < paths.size(); ++i) {
      const std::string stem = out + "/" + std::to_string(i);
      images::Image image;
      try {
        image = images::load_image(paths[i], "test record " + std::to_string(i));
      } catch (const images::ImageError& e) {
        write_error(stem + ".error.txt", e.what());
        continue;
      }
      io::save_safetensors(stem + ".decode.safetensors", {{"rgb", image.pixels}});
      for (const auto& [name, processor] : processors) run_processor(processor, image, stem + "." + name, paths[i]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "image_tool: %s\n", e.what());
    return 1;
  }
  return 0;
}
