#include "qlora/data/data_files.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <system_error>

#include "qlora/io/hub_cache.h"

namespace qlora::data {

namespace fs = std::filesystem;

namespace {

struct SplitKeywords {
  const char* split;
  std::vector<const char*> keywords;
};
const SplitKeywords kDefaultSplits[] = {{"train", {"train", "training"}},
                                        {"validation", {"validation", "valid", "dev", "val"}},
                                        {"test", {"test", "testing", "eval", "evaluation"}}};
const char* const kSep = "[-._ 0-9]";  // datasets' NON_WORDS_CHARS as a glob class
const char* const kNotDataFiles[] = {"README.md",         "config.json",    "dataset_info.json",
                                     "dataset_infos.json", "dummy_data.zip", "dataset_dict.json"};

// fsspec's glob (>= 2023.12, Python glob semantics) as a regex over '/'-separated relative paths:
// "**/" any number of folders, a trailing "/**" anything below, "*" within one name, "[...]" a class.
std::regex glob_regex(const std::string& glob) {
  std::string re;
  for (size_t i = 0; i < glob.size(); ++i) {
    const char c = glob[i];
    if (glob.compare(i, 3, "**/") == 0) {
      re += "(?:.*/)?";
      i += 2;
    } else if (glob.compare(i, 2, "**") == 0) {
      re += ".*";
      ++i;
    } else if (c == '*') {
      re += "[^/]*";
    } else if (c == '?') {
      re += "[^/]";
    } else if (c == '[') {
      const size_t close = glob.find(']', i);
      re += glob.substr(i, close - i + 1);
      i = close;
    } else {
      if (std::string_view("\\^$.|?+()[]{}").find(c) != std::string_view::npos) re += '\\';
      re += c;
    }
  }
  return std::regex(re);
}

// Every data file candidate under `dir`: regular files (or links to them), relative, sorted;
// hidden names, "__" folders and the repository's metadata files left out.
std::vector<std::string> candidate_files(const fs::path& dir) {
  std::vector<std::string> out;
  for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator(); ++it) {
    const std::string name = it->path().filename().string();
    const bool is_dir = it->is_directory();
    if (name.rfind('.', 0) == 0 || (is_dir && name.rfind("__", 0) == 0)) {
      if (is_dir) it.disable_recursion_pending();
      continue;
    }
    if (is_dir || !fs::is_regular_file(it->path())) continue;
    if (std::find(std::begin(kNotDataFiles), std::end(kNotDataFiles), name) != std::end(kNotDataFiles)) continue;
    out.push_back(it->path().lexically_relative(dir).generic_string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> matching(const std::vector<std::string>& files, const std::vector<std::string>& globs) {
  std::vector<std::regex> res;
  for (const auto& g : globs) res.push_back(glob_regex(g));
  std::vector<std::string> out;
  for (const auto& f : files)
    if (std::any_of(res.begin(), res.end(), [&](const std::regex& r) { return std::regex_match(f, r); }))
      out.push_back(f);
  return out;
}

// Step 1: data/<split>-NNNNN-of-NNNNN*.*; the split is the name before the last such suffix.
DataSplits sharded_splits(const std::vector<std::string>& files, const fs::path& dir) {
  const std::regex shard("data/[^/]*-[0-9]{5}-of-[0-9]{5}[^/]*\\.[^/]*");
  const std::regex name("^(.+)-[0-9]{5}-of-[0-9]{5}");
  const std::regex valid_split("^\\w+(\\.\\w+)*$");
  std::map<std::string, std::vector<std::string>> by_split;
  for (const auto& f : files) {
    std::smatch m;
    const std::string base = f.substr(5);
    if (!std::regex_match(f, shard) || !std::regex_search(base, m, name)) continue;
    if (!std::regex_match(m.str(1), valid_split))
      throw std::invalid_argument(dir.string() + ": " + f + " names split '" + m.str(1) +
                                  "'; a split name is letters, digits and '_', parts joined by '.'");
    by_split[m.str(1)].push_back(f);
  }
  DataSplits out;
  for (const auto& d : kDefaultSplits)
    if (auto it = by_split.find(d.split); it != by_split.end()) out.emplace_back(*it), by_split.erase(it);
  for (auto& kv : by_split) out.emplace_back(std::move(kv));
  return out;
}

using PatternTable = std::vector<std::pair<std::string, std::vector<std::string>>>;

PatternTable keyword_patterns(bool in_dir_name) {
  const std::string s = kSep;
  PatternTable table;
  for (const auto& d : kDefaultSplits) {
    std::vector<std::string> globs;
    for (const std::string k : d.keywords) {
      if (in_dir_name) {
        for (const auto& g : {"**/" + k + "/**", "**/" + k + s + "*/**", "**/*" + s + k + "/**",
                              "**/*" + s + k + s + "*/**"})
          globs.push_back(g);
      } else {
        globs.push_back("**/" + k + s + "*");
        globs.push_back("**/*" + s + k + s + "*");
      }
    }
    table.emplace_back(d.split, globs);
  }
  return table;
}

// Steps 2-5: the first table in which some split matches a file gives every split it matches.
DataSplits default_splits(const std::vector<std::string>& files) {
  const std::vector<PatternTable> tables = {{{"logs", {"**/*.eval"}}},
                                            {{"test", {"**/task.toml", "**/instruction.md"}}},
                                            keyword_patterns(true),
                                            keyword_patterns(false),
                                            {{"train", {"**"}}}};
  for (const auto& table : tables) {
    DataSplits out;
    for (const auto& [split, globs] : table)
      if (auto m = matching(files, globs); !m.empty()) out.emplace_back(split, std::move(m));
    if (!out.empty()) return out;
  }
  return {};
}

bool has_extension(const std::string& file, const char* ext) {
  const std::string e = ext;
  return file.size() > e.size() && file.compare(file.size() - e.size(), e.size(), e) == 0;
}

// The extensions qlora reads: JSON and JSONL (dataset.h), Parquet and Arrow IPC (arrow_records.h).
bool is_data_file(const std::string& file) {
  for (const char* ext : {".json", ".jsonl", ".parquet", ".arrow", ".feather"})
    if (has_extension(file, ext)) return true;
  return false;
}

std::string listed(const fs::path& dir, const std::vector<std::string>& files) {
  std::string out;
  for (size_t i = 0; i < files.size(); ++i) out += (i ? ", " : "") + (dir / files[i]).string();
  return out;
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// One glob (relative to the data set's directory) naming exactly `files` among the directory's
// data files: their common prefix, "*", their common suffix (the shards of a split); nullopt where
// no such glob names them alone.
std::optional<std::string> glob_of(const std::vector<std::string>& files, const std::vector<std::string>& all) {
  std::string prefix = files.front(), suffix = files.front();
  size_t shortest = prefix.size();
  for (const auto& f : files) {
    prefix.resize(static_cast<size_t>(std::mismatch(prefix.begin(), prefix.end(), f.begin(), f.end()).first -
                                      prefix.begin()));
    suffix.erase(0, static_cast<size_t>(suffix.rend() - std::mismatch(suffix.rbegin(), suffix.rend(), f.rbegin(),
                                                                      f.rend()).first));
    shortest = std::min(shortest, f.size());
  }
  suffix.erase(0, std::min(suffix.size(), prefix.size() + suffix.size() - std::min(prefix.size() + suffix.size(), shortest)));
  const std::string glob = prefix + "*" + suffix;
  if (has_glob_chars(prefix + suffix) || matching(all, {glob}) != files) return std::nullopt;
  return glob;
}

// The data file of a split, or a glob naming its several files (read one after the other), or an
// error saying why there is none to read.
std::string split_file(const fs::path& dir, const std::string& split, const std::vector<std::string>& files,
                       const std::string& key) {
  std::vector<std::string> data;
  std::copy_if(files.begin(), files.end(), std::back_inserter(data), is_data_file);
  const std::string where = key + ": split '" + split + "' of " + dir.string();
  if (data.empty())
    throw std::invalid_argument(where + " has no JSON, JSONL, Parquet or Arrow file (qlora reads those); found " +
                                listed(dir, files));
  if (data.size() == 1) return (dir / data.front()).string();
  std::vector<std::string> all;
  for (auto& f : candidate_files(dir))
    if (is_data_file(f)) all.push_back(std::move(f));
  const auto glob = glob_of(data, all);
  if (!glob)
    throw std::invalid_argument(where + " has " + std::to_string(data.size()) + " data files (" + listed(dir, data) +
                                ") that no one glob names alone; set " + key + " to a file or a glob of them");
  return (dir / *glob).string();
}

}  // namespace

DataSplits data_splits(const fs::path& dir) {
  const auto files = candidate_files(dir);
  DataSplits splits = sharded_splits(files, dir);
  if (splits.empty()) splits = default_splits(files);
  if (splits.empty()) throw std::invalid_argument(dir.string() + ": no data file in it");
  return splits;
}

std::string resolve_data_file(const std::string& value, const std::string& split, const std::string& key) {
  std::error_code ec;
  if (value.empty() || fs::is_regular_file(value, ec)) return value;
  const std::string dir_path = io::resolve_local_or_hub(value, io::HubRepoType::kDataset, key);
  if (!fs::is_directory(dir_path, ec)) return value;
  const fs::path dir(dir_path);
  const DataSplits splits = data_splits(dir);
  std::string names;
  for (const auto& [name, files] : splits) {
    if (name == split) return split_file(dir, split, files, key);
    names += (names.empty() ? "" : ", ") + name;
  }
  throw std::invalid_argument(key + " = \"" + value + "\": " + dir.string() + " has no split '" + split +
                              "' (its splits: " + names + "); set data.split to one of them");
}

std::vector<std::string> expand_data_path(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return {path};
  std::string base = path, pattern;
  if (fs::is_directory(path, ec)) {
    pattern = "**";
  } else if (const size_t wild = path.find_first_of("*?["); wild != std::string::npos) {
    const size_t slash = path.rfind('/', wild);
    base = slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
    pattern = slash == std::string::npos ? path : path.substr(slash + 1);
  } else {
    return {path};  // missing: its reader says so, naming it
  }
  if (!fs::is_directory(base, ec)) throw std::invalid_argument(path + ": no such directory " + base);
  std::vector<std::string> out;
  for (const auto& f : matching(candidate_files(base), {pattern}))
    if (is_data_file(f)) out.push_back(base == "." ? f : (fs::path(base) / f).string());
  if (out.empty())
    throw std::invalid_argument(path + ": no JSON, JSONL, Parquet or Arrow file " +
                                (pattern == "**" ? "in this directory" : "matches this glob"));
  return out;
}

}  // namespace qlora::data
