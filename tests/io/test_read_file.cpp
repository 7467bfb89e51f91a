// io::read_file: what no reader can make sense of (a pipe, a device, a file past the bound) is refused
// naming the file, before anything blocks or allocates; a link to a regular file (the Hub cache's
// snapshots) reads as the file.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "qlora/io/read_file.h"

namespace fs = std::filesystem;
using qlora::io::read_file;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("qlora_read_file_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d / name;
}

std::string refusal(const std::string& path, uint64_t max_bytes = qlora::io::kMaxModelFileBytes) {
  try {
    read_file(path, max_bytes);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ReadFile, ReadsARegularFileAndALinkToOne) {
  const fs::path blob = scratch("blob");
  std::ofstream(blob) << "{\"a\": 1}";
  const fs::path link = scratch("config.json");
  fs::remove(link);
  fs::create_symlink(blob, link);
  EXPECT_EQ(read_file(blob.string()).value(), "{\"a\": 1}");
  EXPECT_EQ(read_file(link.string()).value(), "{\"a\": 1}");
  EXPECT_FALSE(read_file(scratch("absent.json").string()).has_value());
}

TEST(ReadFile, RefusesAPipeWithoutBlocking) {
  const fs::path fifo = scratch("fifo.json");
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string msg = refusal(fifo.string());  // open() of a FIFO with no writer would block
  EXPECT_NE(msg.find(fifo.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
}

TEST(ReadFile, RefusesADeviceThatNeverEnds) {
  const fs::path zero = scratch("tokenizer.json");
  fs::remove(zero);
  fs::create_symlink("/dev/zero", zero);
  const std::string msg = refusal(zero.string());
  EXPECT_NE(msg.find(zero.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
  EXPECT_NE(refusal(fs::temp_directory_path().string()).find("not a regular file"), std::string::npos);
}

TEST(ReadFile, RefusesAFilePastItsBoundBeforeReadingIt) {
  const fs::path big = scratch("big.json");
  {
    std::ofstream out(big);
    out << std::string(3 << 20, ' ');
  }
  const std::string msg = refusal(big.string(), uint64_t{2} << 20);
  EXPECT_NE(msg.find(big.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("3145728 bytes, more than the 2 MiB"), std::string::npos) << msg;
  EXPECT_EQ(read_file(big.string(), qlora::io::kNoSizeBound).value().size(), size_t{3} << 20);
  // A sparse file past the default bound: refused by its size, nothing read.
  const fs::path sparse = scratch("sparse.json");
  std::ofstream(sparse).close();
  fs::resize_file(sparse, qlora::io::kMaxModelFileBytes + 1);
  EXPECT_NE(refusal(sparse.string()).find("more than the 256 MiB"), std::string::npos);
  fs::remove(sparse);
}
