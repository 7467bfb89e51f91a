// Reads a chat data file with images as lora_finetune's data does (the model's own chat template,
// its image processor), for tests/conformance/test_image_data.py:
//
//   image_data_tool MODEL_DIR DATA OUT_DIR [MAX_SEQ_LEN [preference]]
//
// OUT_DIR/samples.json: [{"tokens": [...], "labels": [...], "images": N}, ...]; with "preference", DATA
// holds preference pairs read as lora_dpo's data does, each pair two samples: its chosen, its rejected;
// OUT_DIR/images.safetensors: "s<i>.<k>.pixel_values" and "s<i>.<k>.grid" (where defined) of sample
// i's image k. An error (a record refused) exits 1 with its message on stderr.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/dataset.h"
#include "qlora/data/preference.h"
#include "qlora/data/sample_images.h"
#include "qlora/io/safetensors.h"

int main(int argc, char** argv) {
  const bool pairs = argc == 6 && std::string(argv[5]) == "preference";
  if (argc < 4 || argc > 6 || (argc == 6 && !pairs)) {
    std::fprintf(stderr, "usage: image_data_tool MODEL_DIR DATA OUT_DIR [MAX_SEQ_LEN [preference]]\n");
    return 2;
  }
  try {
    namespace data = qlora::data;
    const data::Tokenizer tok = data::Tokenizer::open(argv[1]);
    data::DatasetOptions o;
    o.kind = pairs ? data::DatasetKind::kPreference : data::DatasetKind::kChat;
    o.prompt_template = data::TemplateKind::kAuto;
    o.max_seq_len = argc >= 5 ? std::stoll(argv[4]) : 0;
    data::resolve_dataset_options(o, tok, std::nullopt, std::nullopt, nlohmann::ordered_json::object());
    std::vector<data::Sample> samples;
    if (!pairs) samples = data::load_dataset(argv[2], tok, o);
    else
      for (data::PreferencePair& p : data::load_preference_pairs(argv[2], tok, o, {o.max_seq_len, o.max_seq_len})) {
        samples.push_back(std::move(p.chosen));
        samples.push_back(std::move(p.rejected));
      }
    nlohmann::json out = nlohmann::json::array();
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (size_t i = 0; i < samples.size(); ++i) {
      const data::Sample& s = samples[i];
      out.push_back({{"tokens", s.tokens}, {"labels", s.labels}, {"images", s.images.size()}});
      for (size_t k = 0; k < s.images.size(); ++k) {
        const std::string key = "s" + std::to_string(i) + "." + std::to_string(k) + ".";
        const qlora::images::ProcessedImage p = data::image_pixels(s.images[k], o);  // as a batch makes them
        tensors.emplace_back(key + "pixel_values", p.pixel_values.contiguous());
        if (s.images[k].grid.defined()) tensors.emplace_back(key + "grid", s.images[k].grid.contiguous());
      }
    }
    std::filesystem::create_directories(argv[3]);
    std::ofstream(std::filesystem::path(argv[3]) / "samples.json") << out.dump();
    qlora::io::save_safetensors((std::filesystem::path(argv[3]) / "images.safetensors").string(), tensors);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
