// data/data_files: splits of a data set directory by the Hub's file naming (as `datasets` applies it),
// and data.path + data.split resolved to the one JSON / JSONL file to read. (conformance.hub_cache
// compares the splits with datasets' own get_data_patterns on the same trees.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qlora/data/data_files.h"

namespace fs = std::filesystem;
using namespace qlora::data;

namespace {

fs::path tree(const std::vector<std::string>& files) {
  static int n = 0;
  const fs::path d = fs::temp_directory_path() / ("qlora_data_files_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
  fs::remove_all(d);
  for (const auto& f : files) {
    fs::create_directories((d / f).parent_path());
    std::ofstream(d / f) << "{}\n";
  }
  return d;
}

DataSplits splits_of(const std::vector<std::string>& files) {
  const fs::path d = tree(files);
  try {
    DataSplits s = data_splits(d);
    fs::remove_all(d);
    return s;
  } catch (...) {
    fs::remove_all(d);
    throw;
  }
}

std::string error_of(const std::string& value, const std::string& split) {
  try {
    resolve_data_file(value, split, "data.path");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(DataFiles, ShardedFilesUnderDataNameTheirSplits) {
  const DataSplits s = splits_of({"README.md", "data/test-00000-of-00001.parquet", "data/train-00000-of-00002.parquet",
                                  "data/train-00001-of-00002.parquet", "data/extra-00000-of-00001.parquet",
                                  "other/valid.json"});
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].first, "train");
  EXPECT_EQ(s[0].second, (std::vector<std::string>{"data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"}));
  EXPECT_EQ(s[1].first, "test");
  EXPECT_EQ(s[2].first, "extra");
}

TEST(DataFiles, SplitKeywordsInFolderNamesComeBeforeFileNames) {
  const DataSplits dirs = splits_of({"train/a.jsonl", "data/dev-2/b.jsonl", "test.jsonl"});
  ASSERT_EQ(dirs.size(), 2u);
  EXPECT_EQ(dirs[0], (DataSplits::value_type{"train", {"train/a.jsonl"}}));
  EXPECT_EQ(dirs[1], (DataSplits::value_type{"validation", {"data/dev-2/b.jsonl"}}));
  const DataSplits names = splits_of({"alpaca_train.jsonl", "alpaca_test.jsonl", "val.json", "trainer.json", "notes.txt"});
  ASSERT_EQ(names.size(), 3u);
  EXPECT_EQ(names[0], (DataSplits::value_type{"train", {"alpaca_train.jsonl"}}));  // "trainer" is no keyword
  EXPECT_EQ(names[1], (DataSplits::value_type{"validation", {"val.json"}}));
  EXPECT_EQ(names[2], (DataSplits::value_type{"test", {"alpaca_test.jsonl"}}));
}

TEST(DataFiles, WithoutSplitNamesEveryDataFileIsTrainAndHiddenFilesAreNone) {
  const DataSplits s = splits_of({"alpaca_data_cleaned.json", "README.md", ".gitattributes", ".cache/x.json",
                                  "__pycache__/y.json", "sub/z.json"});
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0], (DataSplits::value_type{"train", {"alpaca_data_cleaned.json", "sub/z.json"}}));
  EXPECT_THROW(splits_of({"README.md"}), std::invalid_argument);
}

TEST(DataFiles, ResolvesTheSplitsOneJsonFileOrSaysWhyNot) {
  const fs::path d = tree({"train.jsonl", "test.jsonl"});
  EXPECT_EQ(resolve_data_file(d.string(), "train", "data.path"), (d / "train.jsonl").string());
  EXPECT_EQ(resolve_data_file(d.string(), "test", "data.path"), (d / "test.jsonl").string());
  EXPECT_EQ(resolve_data_file((d / "test.jsonl").string(), "train", "data.path"), (d / "test.jsonl").string());
  const std::string no_split = error_of(d.string(), "validation");
  EXPECT_TRUE(contains(no_split, "no split 'validation'") && contains(no_split, "train, test")) << no_split;
  const fs::path pq = tree({"data/train-00000-of-00001.parquet"});
  const std::string parquet = error_of(pq.string(), "train");
  EXPECT_TRUE(contains(parquet, "Parquet, which qlora does not read yet") &&
              contains(parquet, "train-00000-of-00001.parquet")) << parquet;
  const fs::path two = tree({"train-0.jsonl", "train-1.jsonl"});
  EXPECT_TRUE(contains(error_of(two.string(), "train"), "2 JSON/JSONL files"));
  const fs::path csv = tree({"train.csv"});
  EXPECT_TRUE(contains(error_of(csv.string(), "train"), "no JSON or JSONL file"));
  for (const auto& p : {d, pq, two, csv}) fs::remove_all(p);
}
