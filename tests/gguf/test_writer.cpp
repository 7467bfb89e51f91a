// The GGUF container writer (writer.h): the bytes of a small file, and its commit, which is the
// durable one of every file qlora writes (io/durable_file.h).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "qlora/gguf/writer.h"
#include "tests/io/failing_fsync.h"

namespace qlora::gguf {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  return (fs::path(::testing::TempDir()) / ("qlora_gguf_" + std::to_string(::getpid()) + "_" + name)).string();
}

// One F32 tensor of two values under one metadata key.
void write_small(const std::string& path, float a, float b) {
  Writer w(path, {{"general.name", Value::string("t")}}, {{"x", {2}, GgmlType::F32}});
  const float data[2] = {a, b};
  w.write(data, sizeof data);
  w.commit();
}

TEST(GgufWriter, CommitsAFileWithHeaderAndAlignedData) {
  const std::string path = temp_path("small.gguf");
  write_small(path, 1.0f, 2.0f);
  const std::string bytes = testing_io::file_text(path);
  ASSERT_GT(bytes.size(), Writer::kAlignment);
  EXPECT_EQ(bytes.substr(0, 4), "GGUF");
  EXPECT_EQ(bytes.size() % Writer::kAlignment, 0u);  // the last tensor is padded too
  float last[2];
  std::memcpy(last, bytes.data() + bytes.size() - Writer::kAlignment, sizeof last);
  EXPECT_EQ(last[0], 1.0f);
  EXPECT_EQ(last[1], 2.0f);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  fs::remove(path);
}

TEST(GgufWriter, FailingFsyncKeepsTheOldFile) {
  const std::string path = temp_path("old.gguf");
  write_small(path, 1.0f, 2.0f);
  testing_io::expect_commit_fails_cleanly(path, [&] { write_small(path, 3.0f, 4.0f); });
  fs::remove(path);
}

TEST(GgufWriter, WithoutCommitNothingAppears) {
  const std::string path = temp_path("abandoned.gguf");
  {
    Writer w(path, {}, {{"x", {2}, GgmlType::F32}});
    EXPECT_TRUE(fs::exists(path + ".tmp"));
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

}  // namespace
}  // namespace qlora::gguf
