// Durable writes (io/durable_file.h): write aside, fsync, rename, fsync the directory; and what a
// failing fsync leaves (the old file, no .tmp, an error naming the file).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "qlora/io/durable_file.h"
#include "qlora/io/safetensors.h"
#include "tests/io/failing_fsync.h"

namespace qlora::io {
namespace {

namespace fs = std::filesystem;
using testing_io::expect_commit_fails_cleanly;
using testing_io::file_text;

class DurableFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("qlora_durable_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(DurableFile, WriteFileAtomicReplaces) {
  const std::string p = path("note.txt");
  write_file_atomic(p, "one");
  write_file_atomic(p, "two");
  EXPECT_EQ(file_text(p), "two");
  EXPECT_FALSE(fs::exists(aside_path(p)));
}

// The order that makes the commit durable: the new bytes reach the disk before the rename, and
// the directory holding the rename after it.
TEST_F(DurableFile, FsyncsTheFileAsideThenItsDirectory) {
  std::vector<std::string> synced;
  install_durable_faults({[&](const std::string& p) { return synced.push_back(p), 0; }});
  write_file_atomic(path("note.txt"), "one");
  install_durable_faults({});
  EXPECT_EQ(synced, (std::vector<std::string>{aside_path(path("note.txt")), dir_.string()}));
}

TEST_F(DurableFile, FailingFsyncKeepsTheOldFile) {
  const std::string p = path("note.txt");
  write_file_atomic(p, "old");
  expect_commit_fails_cleanly(p, [&] { write_file_atomic(p, "new"); });
}

TEST_F(DurableFile, SafetensorsWriterCommitsThroughIt) {
  const std::string p = path("w.safetensors");
  save_safetensors(p, {{"w", at::arange(4, at::kFloat)}});
  expect_commit_fails_cleanly(p, [&] { save_safetensors(p, {{"w", at::zeros({4})}}); });
  EXPECT_TRUE(SafetensorsFile::open(p).tensor("w").equal(at::arange(4, at::kFloat)));
}

TEST_F(DurableFile, FsyncOfAMissingPathNamesIt) {
  try {
    fsync_path(path("absent"));
    ADD_FAILURE() << "no error";
  } catch (const DurableFileError& e) {
    EXPECT_NE(std::string(e.what()).find(path("absent")), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace qlora::io
