// Which files of a data set directory (a Hub snapshot or a local folder) hold which split, by the
// Hub's file-naming conventions as the `datasets` library applies them when a repository has no
// data_files configuration (datasets/data_files.py, get_data_patterns), tried in this order:
//   1. data/<split>-NNNNN-of-NNNNN*.* (sharded, any split name);
//   2. **/*.eval files: split "logs"; **/task.toml or **/instruction.md: split "test";
//   3. a directory named for a split (train/, data/validation/, dev-2/, x_test/ ...);
//   4. a file name with a split keyword between separators (train.jsonl, my_test-0.json ...);
//   5. every file: split "train".
// Keywords: train, training | validation, valid, dev, val | test, testing, eval, evaluation;
// separators "-", "_", ".", " " and digits. Hidden files and folders (".x"), folders starting
// with "__" and README.md, config.json, dataset_info(s).json, dummy_data.zip, dataset_dict.json
// are never data files.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace qlora::data {

// Split name -> the files (paths relative to `dir`, '/'-separated, sorted), in datasets' order:
// train, validation, test first, then the others by name. Throws std::invalid_argument naming
// `dir` when it holds no data file or a sharded file names a split datasets refuses.
using DataSplits = std::vector<std::pair<std::string, std::vector<std::string>>>;
DataSplits data_splits(const std::filesystem::path& dir);

// The data file (JSON, JSONL, Parquet, Arrow IPC) of `split` of data set `value` (config key `key`,
// e.g. "data.path"): an existing file or a glob is itself; a directory, or a Hub data set id found
// in the Hugging Face cache (io/hub_cache.h), is looked up by data_splits, and a split of several
// files (Parquet shards) becomes the glob "<dir>/<common prefix>*<common suffix>" that names them
// and no other data file there. Errors name the directory, the split and the splits there are, or
// the files no one glob names alone.
std::string resolve_data_file(const std::string& value, const std::string& split, const std::string& key);

// The files a data path names, in order: an existing file is itself; a directory, every data file
// below it (by extension: .json, .jsonl, .parquet, .arrow, .feather; hidden ones left out), sorted;
// a path with a glob in it ("*" within a name, "**/" any folders, "?", "[...]"), the data files it
// matches, sorted. Anything else is returned as it is, for its reader to say it is missing. Throws
// std::invalid_argument naming the path when a directory or glob names no data file.
std::vector<std::string> expand_data_path(const std::string& path);

}  // namespace qlora::data
