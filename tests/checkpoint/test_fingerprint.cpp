#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "qlora/checkpoint/fingerprint.h"
#include "qlora/checkpoint/resume.h"
#include "qlora/io/safetensors.h"
#include "qlora/checkpoint/xxh64.h"

namespace fs = std::filesystem;
using namespace qlora::checkpoint;
using namespace qlora::io;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("qlora_fingerprint_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string tiny_dir() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return (fs::path(d ? d : "tests/data") / "tiny_llama").string();
}

void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

void flip_byte(const fs::path& p, uint64_t offset) {
  std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(offset));
  const char c = static_cast<char>(f.get() ^ 0x01);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(c);
}

// Data-section offset -> file offset in a checkpoint's model.safetensors.
uint64_t file_offset(const fs::path& dir, uint64_t data_offset) {
  return SafetensorsFile::open((dir / "model.safetensors").string()).data_offset() + data_offset;
}

// One 64 KiB tensor, so the sampled windows leave most of its bytes unread, and a small one.
// Data section: a.weight at [0, 65536), b.weight at [65536, 65792).
fs::path make_checkpoint(const fs::path& dir, std::vector<int64_t> shape = {256, 64}) {
  fs::create_directories(dir);
  write_all(dir / "config.json", R"({"model_type": "llama", "hidden_size": 64})");
  save_safetensors((dir / "model.safetensors").string(),
                   {{"a.weight", at::arange(256 * 64, at::kFloat).reshape(shape)}, {"b.weight", at::ones({64})}});
  return dir;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Xxh64, KnownVectorsAndStreaming) {
  EXPECT_EQ(xxh64("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(xxh64("abc", 3), 0x44BC2CF5AD770999ULL);
  // The file path hashes in 1 MiB chunks: it must agree with one-shot hashing across stripes.
  const fs::path d = fresh_dir("xxh");
  std::string data(3 * (1 << 20) + 37, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  write_all(d / "f", data);
  uint64_t n = 0;
  EXPECT_EQ(xxh64_file((d / "f").string(), &n), xxh64(data.data(), data.size()));
  EXPECT_EQ(n, data.size());
  // Pieces of every length around the 32-byte stripe give the digest of the whole.
  for (size_t piece : {1, 7, 31, 32, 33, 100}) {
    Xxh64 h;
    for (size_t at = 0; at < 4096; at += piece) h.update(data.data() + at, std::min(piece, 4096 - at));
    EXPECT_EQ(h.digest(), xxh64(data.data(), 4096)) << "pieces of " << piece;
  }
  EXPECT_EQ(xxh64_hex(0xEF46DB3751D8E999ULL), "ef46db3751d8e999");
  fs::remove_all(d);
}

TEST(Fingerprint, FileIsContentNotPath) {
  const fs::path d = fresh_dir("file");
  std::string data(3 * (1 << 20) + 5, 'x');
  write_all(d / "a.jsonl", data);
  write_all(d / "b.jsonl", data);
  const std::string fp = fingerprint_file((d / "a.jsonl").string());
  EXPECT_EQ(fp.size(), 16u);
  EXPECT_EQ(fp, fingerprint_file((d / "b.jsonl").string()));
  flip_byte(d / "b.jsonl", data.size() / 2);  // one byte, far from either end
  EXPECT_NE(fp, fingerprint_file((d / "b.jsonl").string()));
  const std::string missing = (d / "gone.jsonl").string();
  EXPECT_NE(error_of([&] { fingerprint_file(missing); }).find(missing), std::string::npos);
  fs::remove_all(d);
}

TEST(Fingerprint, CheckpointDirIsContentNotPath) {
  const fs::path d = fresh_dir("same");
  const std::string a = fingerprint_checkpoint_dir(make_checkpoint(d / "a").string());
  EXPECT_EQ(a.size(), 16u);
  EXPECT_EQ(a, fingerprint_checkpoint_dir(make_checkpoint(d / "b").string()));
  // Sharded: the bundled two-shard fixture, copied elsewhere.
  fs::copy(tiny_dir(), d / "tiny", fs::copy_options::recursive);
  EXPECT_EQ(fingerprint_checkpoint_dir(tiny_dir()), fingerprint_checkpoint_dir((d / "tiny").string()));
  fs::remove_all(d);
}

TEST(Fingerprint, CheckpointDirSeesSampledValuesConfigShapeAndTokenizer) {
  const fs::path d = fresh_dir("change");
  const std::string base = fingerprint_checkpoint_dir(make_checkpoint(d / "base").string());
  auto changed = [&](const std::string& name, auto&& edit) {
    const fs::path c = make_checkpoint(d / name);
    edit(c);
    return fingerprint_checkpoint_dir(c.string());
  };
  EXPECT_NE(base, changed("start", [](const fs::path& c) { flip_byte(c / "model.safetensors", file_offset(c, 0)); }));
  EXPECT_NE(base, changed("middle", [](const fs::path& c) {
    flip_byte(c / "model.safetensors", file_offset(c, 32768));  // the middle of a.weight
  }));
  EXPECT_NE(base, changed("last", [](const fs::path& c) {
    flip_byte(c / "model.safetensors", file_offset(c, 65791));  // the last byte of the data section
  }));
  EXPECT_NE(base, changed("config", [](const fs::path& c) {
    write_all(c / "config.json", R"({"model_type": "llama", "hidden_size": 65})");
  }));
  EXPECT_NE(base, changed("tokenizer", [](const fs::path& c) { write_all(c / "tokenizer.model", "spm"); }));
  // Same bytes, transposed shape: only the header differs.
  const fs::path t = make_checkpoint(d / "shape", {64, 256});
  EXPECT_NE(base, fingerprint_checkpoint_dir(t.string()));
  // A changed shard of a sharded checkpoint.
  fs::copy(tiny_dir(), d / "tiny", fs::copy_options::recursive);
  const fs::path shard = d / "tiny" / "model-00002-of-00002.safetensors";
  flip_byte(shard, SafetensorsFile::open(shard.string()).data_offset());
  EXPECT_NE(fingerprint_checkpoint_dir(tiny_dir()), fingerprint_checkpoint_dir((d / "tiny").string()));
  fs::remove_all(d);
}

// The documented limit: a change confined to bytes outside every sampled window is not seen.
TEST(Fingerprint, CheckpointDirDoesNotReadUnsampledBytes) {
  const fs::path d = fresh_dir("unsampled");
  const std::string base = fingerprint_checkpoint_dir(make_checkpoint(d / "base").string());
  const fs::path c = make_checkpoint(d / "edited");
  flip_byte(c / "model.safetensors", file_offset(c, 10000));  // inside a.weight, between windows
  EXPECT_EQ(base, fingerprint_checkpoint_dir(c.string()));
  fs::remove_all(d);
}

TEST(Fingerprint, CheckpointDirMissingFilesAreNamed) {
  const fs::path d = fresh_dir("missing");
  const fs::path c = make_checkpoint(d / "c");
  fs::remove(c / "config.json");
  EXPECT_NE(error_of([&] { fingerprint_checkpoint_dir(c.string()); }).find("config.json"), std::string::npos);
  make_checkpoint(c);
  fs::remove(c / "model.safetensors");
  EXPECT_NE(error_of([&] { fingerprint_checkpoint_dir(c.string()); }).find("model.safetensors"), std::string::npos);
  fs::copy(tiny_dir(), d / "tiny", fs::copy_options::recursive);
  fs::remove(d / "tiny" / "model-00002-of-00002.safetensors");
  EXPECT_NE(error_of([&] { fingerprint_checkpoint_dir((d / "tiny").string()); }).find("model-00002-of-00002"),
            std::string::npos);
  fs::remove_all(d);
}

TEST(Fingerprint, ResumeCheckNamesTheChangedInput) {
  const nlohmann::json saved = {{"epoch", 1},
                                {"data_path", "/old/data.jsonl"},
                                {"data_fingerprint", "00000000000000aa"},
                                {"base_dir", "/old/base"},
                                {"base_fingerprint", "00000000000000bb"},
                                {"tokenizer_path", "/old/base/original/tokenizer.model"},
                                {"tokenizer_fingerprint", "00000000000000ee"}};
  nlohmann::json now = saved;
  now["data_path"] = "/new/data.jsonl";  // moved, same content
  now["base_dir"] = "/new/base";
  EXPECT_FALSE(check_input_fingerprints(saved, now, "ck/step_4"));

  now["data_fingerprint"] = "00000000000000cc";
  std::string e = error_of([&] { check_input_fingerprints(saved, now, "ck/step_4"); });
  for (const char* want : {"ck/step_4", "data file", "/old/data.jsonl", "/new/data.jsonl", "new output_dir"})
    EXPECT_NE(e.find(want), std::string::npos) << want << " in: " << e;
  EXPECT_EQ(e.find("base checkpoint"), std::string::npos) << e;
  EXPECT_THROW(check_input_fingerprints(saved, now, "ck"), ResumeError);

  now = saved;
  now["base_fingerprint"] = "00000000000000dd";
  e = error_of([&] { check_input_fingerprints(saved, now, "ck/step_4"); });
  for (const char* want : {"base checkpoint", "/old/base", "new output_dir"})
    EXPECT_NE(e.find(want), std::string::npos) << want << " in: " << e;
  EXPECT_EQ(e.find("data file"), std::string::npos) << e;

  now = saved;
  now["tokenizer_fingerprint"] = "00000000000000ff";
  e = error_of([&] { check_input_fingerprints(saved, now, "ck/step_4"); });
  EXPECT_NE(e.find("the tokenizer changed: /old/base/original/tokenizer.model"), std::string::npos) << e;
}

TEST(Fingerprint, ResumeCheckWarnsOnCheckpointsWithoutFingerprints) {
  const nlohmann::json old_meta = {{"epoch", 1}, {"global_step", 4}};
  const nlohmann::json now = {{"data_path", "d"}, {"data_fingerprint", "1"}, {"base_dir", "b"},
                              {"base_fingerprint", "2"}, {"tokenizer_path", "t"}, {"tokenizer_fingerprint", "3"}};
  const auto warning = check_input_fingerprints(old_meta, now, "ck/step_4");
  ASSERT_TRUE(warning);
  for (const char* want : {"ck/step_4", "data file", "base checkpoint"})
    EXPECT_NE(warning->find(want), std::string::npos) << want << " in: " << *warning;
}
