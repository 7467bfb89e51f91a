// data/data_files: splits of a data set directory by the Hub's file naming (as `datasets` applies it),
// data.path + data.split resolved to the file (or glob of shards) to read, and globs expanded. (conformance.hub_cache
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
  EXPECT_EQ(resolve_data_file(pq.string(), "train", "data.path"), (pq / "data/train-00000-of-00001.parquet").string());
  const fs::path csv = tree({"train.csv"});
  EXPECT_TRUE(contains(error_of(csv.string(), "train"), "no JSON, JSONL, Parquet or Arrow file"));
  for (const auto& p : {d, pq, csv}) fs::remove_all(p);
}

TEST(DataFiles, ASplitOfSeveralFilesIsTheGlobNamingThemAlone) {
  const fs::path d = tree({"data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                           "data/test-00000-of-00001.parquet", "README.md"});
  const std::string glob = resolve_data_file(d.string(), "train", "data.path");
  EXPECT_EQ(glob, (d / "data/train-0000*-of-00002.parquet").string());
  EXPECT_EQ(expand_data_path(glob), (std::vector<std::string>{(d / "data/train-00000-of-00002.parquet").string(),
                                                              (d / "data/train-00001-of-00002.parquet").string()}));
  const fs::path two = tree({"train-0.jsonl", "train-1.jsonl"});
  EXPECT_EQ(resolve_data_file(two.string(), "train", "data.path"), (two / "train-*.jsonl").string());
  // Files in different folders: "*" stays within one name, so no one glob names them.
  const fs::path nested = tree({"train/a.jsonl", "train/b/c.jsonl"});
  const std::string msg = error_of(nested.string(), "train");
  EXPECT_TRUE(contains(msg, "no one glob names alone") && contains(msg, "c.jsonl")) << msg;
  for (const auto& p : {d, two, nested}) fs::remove_all(p);
}

TEST(DataFiles, ExpandsDirectoriesAndGlobsToTheirDataFilesSorted) {
  const fs::path d = tree({"b.parquet", "a.parquet", "notes.txt", "sub/c.arrow", ".hidden.parquet"});
  EXPECT_EQ(expand_data_path(d.string()),
            (std::vector<std::string>{(d / "a.parquet").string(), (d / "b.parquet").string(), (d / "sub/c.arrow").string()}));
  EXPECT_EQ(expand_data_path((d / "?.parquet").string()),
            (std::vector<std::string>{(d / "a.parquet").string(), (d / "b.parquet").string()}));
  EXPECT_EQ(expand_data_path((d / "**/*.arrow").string()), (std::vector<std::string>{(d / "sub/c.arrow").string()}));
  EXPECT_EQ(expand_data_path((d / "a.parquet").string()), (std::vector<std::string>{(d / "a.parquet").string()}));
  EXPECT_EQ(expand_data_path("/nonexistent/x.jsonl"), (std::vector<std::string>{"/nonexistent/x.jsonl"}));
  try {
    expand_data_path((d / "*.jsonl").string());
    ADD_FAILURE() << "a glob matching nothing was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(contains(e.what(), "*.jsonl") && contains(e.what(), "matches this glob")) << e.what();
  }
  fs::remove_all(d);
}
