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

// The JSON / JSONL file of `split` of data set `value` (config key `key`, e.g. "data.path"): an
// existing file is itself; a directory, or a Hub data set id found in the Hugging Face cache
// (io/hub_cache.h), is looked up by data_splits. Errors name the directory, the split and the
// splits there are; a split held in Parquet says qlora does not read Parquet yet and lists the
// files; one of several files is not chosen for the user (qlora reads one file per split).
std::string resolve_data_file(const std::string& value, const std::string& split, const std::string& key);

}  // namespace qlora::data
