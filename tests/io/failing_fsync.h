// For tests of the durable writes (io/durable_file.h): a disk whose fsync fails, and the check that a
// commit over an existing file then fails cleanly.
#pragma once

#include <gtest/gtest.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>

#include "qlora/io/durable_file.h"

namespace qlora::testing_io {

// While alive, every fsync through io::fsync_path fails with EIO, as on a failing disk.
struct FailingFsync {
  FailingFsync() { io::install_durable_faults({[](const std::string&) { return EIO; }}); }
  ~FailingFsync() { io::install_durable_faults({}); }
  FailingFsync(const FailingFsync&) = delete;
  FailingFsync& operator=(const FailingFsync&) = delete;
};

inline std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `commit`, a durable write over `path` (which exists), with fsync failing: it must throw an
// error naming path, leave path's old bytes in place and no path.tmp behind.
inline void expect_commit_fails_cleanly(const std::string& path, const std::function<void()>& commit) {
  ASSERT_TRUE(std::filesystem::exists(path)) << "the test needs an old file at " << path;
  const std::string old = file_text(path);
  try {
    FailingFsync failing;
    commit();
    ADD_FAILURE() << "committing " << path << " with fsync failing did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fsync"), std::string::npos) << e.what();
  }
  EXPECT_EQ(file_text(path), old) << "the old " << path << " was replaced";
  EXPECT_FALSE(std::filesystem::exists(io::aside_path(path))) << "a half-committed .tmp was left";
}

}  // namespace qlora::testing_io
