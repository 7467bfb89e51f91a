// data/arrow_records: which files are Parquet / Arrow, and that a damaged or mislabelled one is a
// clear error naming it (never a crash). Rows of real Parquet and Arrow files, against `datasets`,
// are checked by conformance.parquet (tests/conformance/test_parquet.py).
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "fixtures.h"
#include "qlora/data/arrow_records.h"
#include "qlora/data/dataset.h"

using namespace qlora::data;
using qlora::data::test_fixtures::write_temp;

namespace {

// The std::runtime_error reading `path` throws, checked to name the file ("" and a failure if none).
std::string read_error(const std::string& path) {
  try {
    read_records(path, DatasetOptions{});
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    return what;
  }
  ADD_FAILURE() << path << ": expected an error";
  return "";
}

}  // namespace

TEST(ArrowRecords, KnowsParquetAndArrowByExtensionThenByMagic) {
  EXPECT_EQ(arrow_file_kind(write_temp("k.parquet", "{}")), ArrowFileKind::kParquet);
  EXPECT_EQ(arrow_file_kind(write_temp("k.feather", "")), ArrowFileKind::kIpcFile);
  EXPECT_EQ(arrow_file_kind(write_temp("k.arrow", std::string("ARROW1\0\0", 8))), ArrowFileKind::kIpcFile);
  EXPECT_EQ(arrow_file_kind(write_temp("k2.arrow", "xx")), ArrowFileKind::kIpcStream);
  EXPECT_EQ(arrow_file_kind(write_temp("k.bin", "PAR1....")), ArrowFileKind::kParquet);
  EXPECT_EQ(arrow_file_kind(write_temp("k.data", std::string("\xff\xff\xff\xff", 4))), ArrowFileKind::kIpcStream);
  EXPECT_EQ(arrow_file_kind(write_temp("k.jsonl", "{\"text\": \"PAR1\"}\n")), ArrowFileKind::kNone);
  EXPECT_EQ(arrow_file_kind(write_temp("k.json", "[]")), ArrowFileKind::kNone);
  EXPECT_EQ(arrow_file_kind("/nonexistent/k.jsonl"), ArrowFileKind::kNone);
}

TEST(ArrowRecords, DamagedOrMislabelledFilesAreErrorsNamingThem) {
  if (read_error(write_temp("probe.parquet", "")).find("built without Apache Arrow") != std::string::npos)
    GTEST_SKIP() << "built without Arrow (QLORA_ARROW)";
  EXPECT_NE(read_error(write_temp("truncated.parquet", "PAR1\x15\x04\x15\x10")).find("Parquet"), std::string::npos);
  EXPECT_NE(read_error(write_temp("json.parquet", "{\"text\": \"a\"}\n")).find("not a readable Parquet file"),
            std::string::npos);
  EXPECT_NE(read_error(write_temp("empty.parquet", "")).find("Parquet"), std::string::npos);
  EXPECT_NE(read_error(write_temp("bad.arrow", std::string("ARROW1\0\0garbage", 15))).find("Arrow IPC"), std::string::npos);
  EXPECT_NE(read_error(write_temp("bad2.arrow", std::string("\xff\xff\xff\xff\x10\0\0\0garbage", 15))).find("Arrow IPC"),
            std::string::npos);
  EXPECT_NE(read_error(write_temp("bad.feather", "not feather")).find("Arrow IPC file"), std::string::npos);
}
