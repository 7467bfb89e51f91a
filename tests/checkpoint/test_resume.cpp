#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "qlora/checkpoint/resume.h"

namespace fs = std::filesystem;
using namespace qlora::checkpoint;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("qlora_resume_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

ResumeState sample_state(int64_t step) {
  ResumeState s;
  s.tensors.emplace_back("z.first", at::randn({3, 4}));
  s.tensors.emplace_back("rng.cpu", at::randint(0, 255, {16}, at::kByte));
  s.tensors.emplace_back("counter", at::full({2}, step, at::kLong));
  s.tensors.emplace_back("a.half", at::randn({5}).to(at::kBFloat16));
  s.meta = {{"global_step", step}, {"sampler", {{"epoch", 1}, {"offsets", {1, 2, 3}}}}, {"name", "x"}};
  return s;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void expect_same(const ResumeState& a, const ResumeState& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].first, b.tensors[i].first);  // order preserved
    EXPECT_EQ(a.tensors[i].second.scalar_type(), b.tensors[i].second.scalar_type());
    EXPECT_TRUE(at::equal(a.tensors[i].second, b.tensors[i].second)) << a.tensors[i].first;
  }
  EXPECT_EQ(a.meta, b.meta);
}

}  // namespace

TEST(Xxh64, KnownVectorsAndStreaming) {
  EXPECT_EQ(xxh64("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(xxh64("abc", 3), 0x44BC2CF5AD770999ULL);
  // The file path hashes in 1 MiB chunks: it must agree with one-shot hashing across stripes.
  const fs::path d = fresh_dir("xxh");
  std::string data(3 * (1 << 20) + 37, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  std::ofstream(d / "f", std::ios::binary) << data;
  uint64_t n = 0;
  EXPECT_EQ(xxh64_file((d / "f").string(), &n), xxh64(data.data(), data.size()));
  EXPECT_EQ(n, data.size());
  fs::remove_all(d);
}

TEST(Resume, RoundTripKeepsTensorsDtypesOrderAndMeta) {
  const fs::path d = fresh_dir("roundtrip");
  const ResumeState s = sample_state(7);
  save_resume_checkpoint(d.string(), 7, s, 0);
  const auto latest = latest_resume_checkpoint(d.string());
  ASSERT_TRUE(latest);
  EXPECT_EQ(fs::path(*latest).filename(), "step_00000007");
  const ResumeState back = load_resume_checkpoint(*latest);
  expect_same(s, back);
  back.tensors[0].second.add_(1);  // owned memory, not a read-only mapping
  const auto m = nlohmann::json::parse(read_all(fs::path(*latest) / "manifest.json"));
  EXPECT_EQ(m["format"], "qlora-resume-v1");
  EXPECT_EQ(m["step"], 7);
  EXPECT_EQ(m["files"]["state.safetensors"]["bytes"].get<uint64_t>(), fs::file_size(fs::path(*latest) / "state.safetensors"));
  EXPECT_EQ(m["files"]["meta.json"]["xxh64"].get<std::string>().size(), 16u);
  fs::remove_all(d);
}

TEST(Resume, NoCheckpointIsNullopt) {
  const fs::path d = fresh_dir("none");
  EXPECT_FALSE(latest_resume_checkpoint(d.string()));
  EXPECT_FALSE(latest_resume_checkpoint((d / "does_not_exist").string()));
  fs::remove_all(d);
}

TEST(Resume, KeepLastNPrunesOldestFirst) {
  const fs::path d = fresh_dir("prune");
  for (int64_t step : {10, 20, 30, 40}) save_resume_checkpoint(d.string(), step, sample_state(step), 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(d / "checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000030", "step_00000040"}));
  // Saving an older step than an existing one never removes the one just written.
  save_resume_checkpoint(d.string(), 5, sample_state(5), 1);
  EXPECT_TRUE(fs::exists(d / "checkpoints/step_00000005/manifest.json"));
  EXPECT_TRUE(fs::exists(d / "checkpoints/step_00000040/manifest.json"));
  EXPECT_FALSE(fs::exists(d / "checkpoints/step_00000030"));
  // keep_last_n <= 0 keeps everything.
  save_resume_checkpoint(d.string(), 50, sample_state(50), 0);
  EXPECT_TRUE(fs::exists(d / "checkpoints/step_00000005"));
  fs::remove_all(d);
}

TEST(Resume, TruncatedOrAlteredStateIsDetectedAndNamed) {
  const fs::path d = fresh_dir("corrupt");
  save_resume_checkpoint(d.string(), 3, sample_state(3), 0);
  const fs::path ck = d / "checkpoints/step_00000003";
  const fs::path st = ck / "state.safetensors";
  std::string bytes = read_all(st);

  bytes.back() ^= 0x01;  // one flipped bit in the data section
  std::ofstream(st, std::ios::binary | std::ios::trunc) << bytes;
  try {
    load_resume_checkpoint(ck.string());
    FAIL() << "altered file accepted";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("state.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(ck.string()), std::string::npos) << e.what();
  }

  std::ofstream(st, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 10);
  try {
    load_resume_checkpoint(ck.string());
    FAIL() << "truncated file accepted";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("state.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }

  fs::remove(ck / "meta.json");
  EXPECT_THROW(load_resume_checkpoint(ck.string()), ResumeError);
  fs::remove(ck / "manifest.json");
  try {
    load_resume_checkpoint(ck.string());
    FAIL() << "checkpoint without manifest accepted";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

TEST(Resume, LeftoverTmpFromCrashIsIgnored) {
  const fs::path d = fresh_dir("crash");
  const ResumeState s = sample_state(100);
  save_resume_checkpoint(d.string(), 100, s, 2);
  // A save of step 200 that died before its manifest: files present, no manifest.
  const fs::path tmp = d / "checkpoints/step_00000200.tmp";
  fs::create_directories(tmp);
  std::ofstream(tmp / "state.safetensors") << "partial";
  // And one that died after its manifest but before the rename: still only a .tmp.
  const fs::path tmp2 = d / "checkpoints/step_00000300.tmp";
  fs::copy(d / "checkpoints/step_00000100", tmp2);
  // A half-pruned directory (manifest already removed).
  fs::create_directories(d / "checkpoints/step_00000400");
  const auto latest = latest_resume_checkpoint(d.string());
  ASSERT_TRUE(latest);
  EXPECT_EQ(fs::path(*latest).filename(), "step_00000100");
  expect_same(s, load_resume_checkpoint(*latest));
  EXPECT_TRUE(fs::exists(tmp));  // left for inspection, not removed
  // The next save of the crashed step replaces the leftover.
  save_resume_checkpoint(d.string(), 200, sample_state(200), 0);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(fs::path(*latest_resume_checkpoint(d.string())).filename(), "step_00000200");
  fs::remove_all(d);
}

TEST(Resume, SavingSameStepTwiceReplaces) {
  const fs::path d = fresh_dir("twice");
  save_resume_checkpoint(d.string(), 9, sample_state(1), 3);
  const ResumeState second = sample_state(2);
  save_resume_checkpoint(d.string(), 9, second, 3);
  const auto latest = latest_resume_checkpoint(d.string());
  ASSERT_TRUE(latest);
  expect_same(second, load_resume_checkpoint(*latest));
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d / "checkpoints")) ++n;
  EXPECT_EQ(n, 1u);  // no .tmp or .old left behind
  fs::remove_all(d);
}
