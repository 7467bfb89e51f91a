// HF tokenizer.json: what the conformance test (tests/conformance/test_tokenizer_hf.py, against the
// tokenizers package) cannot show on its generated files: the error paths, which name the file
// and the component; the merge order (a merge's line, not the joined token's id); the directory
// search order; BOS/EOS from tokenizer_config.json; continuations without the prepended "▁".
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "qlora/data/tokenizer.h"

#include "fixtures.h"

namespace qlora::data {
namespace {

using nlohmann::json;
using test_fixtures::data_dir;
using test_fixtures::open_error;
using test_fixtures::spm_style;
using test_fixtures::write_temp;
namespace fs = std::filesystem;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The message of Tokenizer::open(path)'s error, "" when it opens.
std::string error_of(const std::string& path) {
  try {
    Tokenizer::open(path);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

std::string write_json(const std::string& name, const json& j) { return write_temp(name, j.dump()); }

TEST(HfTokenizer, MergesByLineAndFallsBackToBytes) {
  const auto tok = Tokenizer::open(write_json("spm.json", spm_style()));
  EXPECT_EQ(tok.encode("ab"), (std::vector<int64_t>{7, 6}));  // "▁a" "b", not "▁" "ab"
  EXPECT_EQ(tok.encode("b\n"), (std::vector<int64_t>{4, 6, 8 + 10}));  // "\n" as <0x0A>
  EXPECT_EQ(tok.encode("ab</s>a"), (std::vector<int64_t>{7, 6, 2, 7}));  // the special is matched first
  EXPECT_EQ(tok.decode({7, 6, 2, 7}), "ab</s> a");
  EXPECT_EQ(tok.encode_continuation("ab"), (std::vector<int64_t>{3}));  // no prepended "▁": "a b" merges
  EXPECT_EQ(tok.bos_id(), 1);  // no tokenizer_config.json: the tokens named <s> and </s>
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.vocab_size(), 8 + 256);
  EXPECT_EQ(tok.id_to_piece(7), "▁a");
  EXPECT_THROW(tok.decode({8 + 256}), std::out_of_range);
}

TEST(HfTokenizer, MergesAsListsEqualMergesAsStrings) {
  json j = spm_style();
  j["model"]["merges"] = json::array({json::array({"▁", "a"}), json::array({"a", "b"})});
  EXPECT_EQ(Tokenizer::open(write_json("lists.json", j)).encode("ab ab"), (std::vector<int64_t>{7, 6, 7, 6}));
}

TEST(HfTokenizer, ErrorsNameFileAndComponent) {
  json j = spm_style();
  j["model"]["type"] = "WordPiece";
  std::string e = open_error("wordpiece.json", j.dump());
  EXPECT_TRUE(has(e, "model") && has(e, "WordPiece")) << e;
  e = open_error("malformed.json", "{\"model\": {\"type\": \"BPE\",");
  EXPECT_TRUE(has(e, "not valid JSON")) << e;
  j = spm_style();
  j["model"].erase("merges");
  e = open_error("nomerges.json", j.dump());
  EXPECT_TRUE(has(e, "merges")) << e;
  j = spm_style();
  j["model"]["merges"] = {"▁ a", "x y"};
  e = open_error("badmerge.json", j.dump());
  EXPECT_TRUE(has(e, "model.merges[1]") && has(e, "'x' is not in the vocab")) << e;
  j = spm_style();
  j["normalizer"]["normalizers"][1] = {{"type", "Lowercase"}};
  e = open_error("lowercase.json", j.dump());
  EXPECT_TRUE(has(e, "normalizer.normalizers[1]") && has(e, "Lowercase")) << e;
  j = spm_style();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}, {"x", 1}};
  e = open_error("option.json", j.dump());
  EXPECT_TRUE(has(e, "pre_tokenizer") && has(e, "unsupported option \"x\"")) << e;
  j = spm_style();
  j["model"]["dropout"] = 0.1;
  e = open_error("dropout.json", j.dump());
  EXPECT_TRUE(has(e, "dropout")) << e;
}

// Every value of a tokenizer.json replaced by one of another JSON type: the file opens, or its
// error names it (no bare "[json.exception.type_error...]" reaches the user).
TEST(HfTokenizer, EveryWronglyTypedValueIsAnErrorNamingTheFile) {
  const json base = spm_style();
  const json flat = base.flatten();
  const std::vector<json> others = {nullptr, 7, -1, 1e300, "x", json::array(), json::object(), json::array({1, 2})};
  int opened = 0, refused = 0;
  int vocab_entries = 0;
  for (const auto& [pointer, value] : flat.items()) {
    // The vocabulary's entries all take one path: a few of them are enough.
    if (pointer.rfind("/model/vocab/", 0) == 0 && ++vocab_entries > 4) continue;
    for (const json& other : others) {
      if (other == value) continue;
      json j = base;
      j[json::json_pointer(pointer)] = other;
      const std::string path = write_json("typed.json", j);
      try {
        Tokenizer::open(path);
        ++opened;
      } catch (const std::exception& e) {
        ++refused;
        EXPECT_TRUE(has(e.what(), path)) << pointer << " = " << other.dump() << ": " << e.what();
      }
    }
  }
  EXPECT_GT(refused, 100);  // the mutations do reach the checks
  EXPECT_GT(opened, 0);
}

TEST(HfTokenizer, DirectoryPicksModelThenOriginalThenTokenizerJson) {
  const fs::path dir = fs::path(testing::TempDir()) / "qlora_hf_dir";
  fs::remove_all(dir);
  fs::create_directories(dir / "original");
  const std::string none = error_of(dir.string());
  EXPECT_TRUE(has(none, dir.string()) && has(none, "no tokenizer.model, original/tokenizer.model or tokenizer.json")) << none;
  std::ofstream(dir / "tokenizer.json") << spm_style().dump();
  EXPECT_EQ(Tokenizer::open(dir.string()).path(), (dir / "tokenizer.json").string());
  const std::string spm = data_dir() + "/tokenizer/tokenizer.model";
  fs::copy_file(spm, dir / "original" / "tokenizer.model");
  EXPECT_EQ(Tokenizer::open(dir.string()).path(), (dir / "original" / "tokenizer.model").string());
  fs::copy_file(spm, dir / "tokenizer.model");
  EXPECT_EQ(Tokenizer::open(dir.string()).path(), (dir / "tokenizer.model").string());
  const std::string json_file = (dir / "tokenizer.json").string();

  // tokenizer_config.json beside it names BOS/EOS/pad, as a string or {"content": ...}.
  std::ofstream(dir / "tokenizer_config.json")
      << json{{"bos_token", nullptr}, {"eos_token", {{"content", "<s>"}}}, {"pad_token", "</s>"}}.dump();
  auto tok = Tokenizer::open(json_file);
  EXPECT_EQ(tok.bos_id(), -1);
  EXPECT_EQ(tok.encode_with_special("ab", true, false), tok.encode("ab"));  // no BOS to add, and no -1
  EXPECT_EQ(tok.eos_id(), 1);
  EXPECT_EQ(tok.pad_id(), 2);
  std::ofstream(dir / "tokenizer_config.json") << json{{"eos_token", "<|im_end|>"}}.dump();
  const std::string e = error_of(json_file);
  EXPECT_TRUE(has(e, "tokenizer_config.json") && has(e, "<|im_end|>")) << e;
}

// BOS/EOS as transformers adds them: the post_processor decides; a null one leaves it to
// tokenizer_config.json's add_bos_token / add_eos_token (absent: nothing); sentencepiece adds BOS.
TEST(HfTokenizer, AddsBosEosAsThePostProcessorSays) {
  const fs::path dir = fs::path(testing::TempDir()) / "qlora_hf_post";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string file = (dir / "tokenizer.json").string();
  const auto open_with = [&](const json& post, const json& config) {
    json j = spm_style();
    j["post_processor"] = post;
    std::ofstream(file) << j.dump();
    fs::remove(dir / "tokenizer_config.json");
    if (!config.is_null()) std::ofstream(dir / "tokenizer_config.json") << config.dump();
    return Tokenizer::open(file);
  };
  const json seq_a = {{"Sequence", {{"id", "A"}, {"type_id", 0}}}};
  const json bos = {{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}};
  const json eos = {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}};
  const json specials = {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}},
                         {"</s>", {{"id", "</s>"}, {"ids", {2}}, {"tokens", {"</s>"}}}}};
  const auto templ = [&](json single) {
    return json{{"type", "TemplateProcessing"}, {"single", single}, {"pair", json::array()}, {"special_tokens", specials}};
  };
  // SmolLM2's: a bare $A adds nothing, whatever tokenizer_config.json names as bos_token.
  // json::array: a braced list of one json is a copy of it under clang, an array under gcc.
  auto t = open_with(templ(json::array({seq_a})), {{"bos_token", "<s>"}});
  EXPECT_FALSE(t.adds_bos() || t.adds_eos());
  t = open_with(templ({bos, seq_a}), nullptr);  // Llama-2/Mistral HF files
  EXPECT_TRUE(t.adds_bos());
  EXPECT_FALSE(t.adds_eos());
  // Llama-3's: ByteLevel then TemplateProcessing; config flags do not override a post_processor.
  t = open_with({{"type", "Sequence"}, {"processors", {{{"type", "ByteLevel"}}, templ({bos, seq_a, eos})}}},
                {{"add_bos_token", false}});
  EXPECT_TRUE(t.adds_bos() && t.adds_eos());
  t = open_with({{"type", "ByteLevel"}}, nullptr);  // Qwen's
  EXPECT_FALSE(t.adds_bos() || t.adds_eos());
  t = open_with(nullptr, {{"add_bos_token", true}});
  EXPECT_TRUE(t.adds_bos());
  EXPECT_FALSE(t.adds_eos());
  t = open_with(nullptr, nullptr);
  EXPECT_FALSE(t.adds_bos() || t.adds_eos());
  // What qlora cannot describe is refused by name.
  std::string e;
  try {
    open_with({{"type", "Unknown"}}, nullptr);
  } catch (const std::runtime_error& x) {
    e = x.what();
  }
  EXPECT_TRUE(has(e, file) && has(e, "post_processor: unsupported type 'Unknown'")) << e;
  e.clear();
  try {
    open_with(templ({eos, seq_a}), nullptr);  // EOS where BOS goes
  } catch (const std::runtime_error& x) {
    e = x.what();
  }
  EXPECT_TRUE(has(e, "post_processor adds [2] before the text")) << e;
  // sentencepiece: BOS and no EOS, unless tokenizer_config.json beside it says otherwise.
  const std::string spm = data_dir() + "/tokenizer/tokenizer.model";
  EXPECT_TRUE(Tokenizer::open(spm).adds_bos());
  EXPECT_FALSE(Tokenizer::open(spm).adds_eos());
  fs::copy_file(spm, dir / "tokenizer.model");
  std::ofstream(dir / "tokenizer_config.json") << json{{"add_bos_token", false}, {"add_eos_token", true}}.dump();
  t = Tokenizer::open((dir / "tokenizer.model").string());
  EXPECT_FALSE(t.adds_bos());
  EXPECT_TRUE(t.adds_eos());
}

}  // namespace
}  // namespace qlora::data
