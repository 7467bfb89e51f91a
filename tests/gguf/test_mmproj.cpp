// has_mmproj: which checkpoint directories get an mmproj GGUF beside an epoch's export.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "qlora/gguf/mmproj.h"

namespace qlora::gguf {
namespace {

namespace fs = std::filesystem;

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

struct Dir {
  fs::path path = fs::temp_directory_path() / ("qlora_mmproj_" + std::to_string(::getpid()) + "_" +
                                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
  Dir() { fs::create_directories(path); }
  ~Dir() { fs::remove_all(path); }
};

}  // namespace

TEST(Mmproj, ATowerWithoutImageProcessorRulesGetsNoMmprojAndSaysWhy) {
  Dir d;
  write(d.path / "config.json", R"({"model_type": "gemma3", "vision_config": {"hidden_size": 8}, "text_config": {}})");
  std::string why;
  EXPECT_FALSE(has_mmproj(d.path.string(), &why));
  EXPECT_NE(why.find("preprocessor_config.json"), std::string::npos) << why;
  EXPECT_NE(why.find(d.path.string()), std::string::npos) << why;

  write(d.path / "processor_config.json", R"({"processor_class": "Gemma3Processor"})");  // no "image_processor"
  EXPECT_FALSE(has_mmproj(d.path.string()));
  write(d.path / "processor_config.json", R"({"image_processor": {"image_mean": [0.5, 0.5, 0.5]}})");
  EXPECT_TRUE(has_mmproj(d.path.string()));
  fs::remove(d.path / "processor_config.json");
  write(d.path / "preprocessor_config.json", "{}");
  why.clear();
  EXPECT_TRUE(has_mmproj(d.path.string(), &why));
  EXPECT_TRUE(why.empty());
}

TEST(Mmproj, ATextModelOrAnUnknownTowerHasNone) {
  Dir d;
  write(d.path / "preprocessor_config.json", "{}");
  std::string why;
  write(d.path / "config.json", R"({"model_type": "llama"})");
  EXPECT_FALSE(has_mmproj(d.path.string(), &why));
  write(d.path / "config.json", R"({"model_type": "llava", "vision_config": {}})");
  EXPECT_FALSE(has_mmproj(d.path.string(), &why));
  write(d.path / "config.json", "not json");
  EXPECT_FALSE(has_mmproj(d.path.string(), &why));
  EXPECT_TRUE(why.empty()) << why;
}

}  // namespace qlora::gguf
