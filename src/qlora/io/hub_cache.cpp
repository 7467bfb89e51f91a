#include "qlora/io/hub_cache.h"

#include <pwd.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/io/read_file.h"

namespace qlora::io {

namespace fs = std::filesystem;

namespace {

const char* env(const char* name) { return std::getenv(name); }  // set-but-empty counts as set, as os.getenv

bool is_word(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// One part of a repo id: 1-96 of [A-Za-z0-9_.-], first and last a word character (the \b...\b
// of huggingface_hub's REPO_ID_REGEX).
bool valid_id_part(const std::string& s) {
  if (s.empty() || s.size() > 96 || !is_word(s.front()) || !is_word(s.back())) return false;
  for (char c : s)
    if (!is_word(c) && c != '-' && c != '.') return false;
  return true;
}

bool valid_repo_id(const std::string& id) {
  const size_t slash = id.find('/');
  if (slash != std::string::npos) {
    if (id.find('/', slash + 1) != std::string::npos || !valid_id_part(id.substr(0, slash))) return false;
  }
  const std::string name = slash == std::string::npos ? id : id.substr(slash + 1);
  if (!valid_id_part(name) || id.find("--") != std::string::npos || id.find("..") != std::string::npos) return false;
  return !(id.size() >= 4 && id.compare(id.size() - 4, 4, ".git") == 0);
}

// Python's os.path.expanduser: "~" is $HOME (else the passwd entry), "~user" that user's home.
std::string expand_user(const std::string& path) {
  if (path.empty() || path[0] != '~') return path;
  size_t i = path.find('/', 1);
  if (i == std::string::npos) i = path.size();
  std::string home;
  if (i == 1) {
    if (const char* h = env("HOME")) home = h;
    else if (const passwd* pw = ::getpwuid(::getuid())) home = pw->pw_dir;
    else return path;
  } else {
    const passwd* pw = ::getpwnam(path.substr(1, i - 1).c_str());
    if (!pw) return path;
    home = pw->pw_dir;
  }
  while (!home.empty() && home.back() == '/') home.pop_back();
  const std::string out = home + path.substr(i);
  return out.empty() ? "/" : out;
}

// Python's posixpath.expandvars: $NAME and ${NAME} of set variables replaced, others kept as written.
std::string expand_vars(const std::string& path) {
  std::string out;
  size_t i = 0;
  while (i < path.size()) {
    if (path[i] != '$') {
      out += path[i++];
      continue;
    }
    size_t j = i + 1;
    std::string name;
    if (j < path.size() && path[j] == '{') {
      const size_t close = path.find('}', j);
      if (close == std::string::npos) {
        out += path[i++];
        continue;
      }
      name = path.substr(j + 1, close - j - 1);
      j = close + 1;
    } else {
      while (j < path.size() && is_word(path[j])) ++j;
      name = path.substr(i + 1, j - i - 1);
      if (name.empty()) {
        out += path[i++];
        continue;
      }
    }
    const char* value = env(name.c_str());
    out += value ? std::string(value) : path.substr(i, j - i);
    i = j;
  }
  return out;
}

std::string expand(const std::string& p) { return expand_vars(expand_user(p)); }

bool is_commit_hash(const std::string& s) {
  if (s.size() != 40) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c)) && (c < 'a' || c > 'f')) return false;
  return true;
}

std::string describe(const HubId& id, HubRepoType type) {
  return std::string(type == HubRepoType::kDataset ? "data set" : "model") + " '" + id.repo_id + "' (revision '" +
         id.revision + "')";
}

[[noreturn]] void not_cached(const HubId& id, HubRepoType type, const fs::path& cache, const std::string& what) {
  throw HubCacheError(describe(id, type) + " is not in the Hugging Face cache " + cache.string() + ": " + what +
                      ". qlora never downloads; fetch it with `" + hub_download_command(id, type) +
                      "` (the cache is HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)");
}

// huggingface_hub's IncompleteSnapshotError: the cached tree listing of the commit names files the
// snapshot lacks. A listing it would ignore (missing, unreadable, another format_version, an
// entry without size or blob_id or with an invalid Xet hash) is ignored here too.
void check_tree_listing(const HubId& id, HubRepoType type, const fs::path& storage, const std::string& commit,
                        const fs::path& snapshot) {
  const fs::path listing = storage / "trees" / (commit + ".json");
  std::vector<std::string> missing;
  try {
    const auto text = read_file(listing.string(), kNoSizeBound);
    if (!text) return;
    const auto j = nlohmann::json::parse(*text);
    if (j.value("format_version", nlohmann::json()) != 1) return;
    for (const auto& [path, info] : j.at("files").items()) {
      if (!info.contains("size") || !info.contains("blob_id")) return;
      if (info.contains("xet_hash") && !info["xet_hash"].is_null()) {
        const auto& x = info["xet_hash"].get_ref<const std::string&>();
        if (x.size() != 64 || x.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) return;
      }
      if (!fs::is_regular_file(snapshot / fs::path(path))) missing.push_back(path);
    }
  } catch (const std::exception&) {
    return;
  }
  if (missing.empty()) return;
  std::string sample;
  for (size_t i = 0; i < missing.size() && i < 3; ++i) sample += (i ? ", " : "") + missing[i];
  if (missing.size() > 3) sample += ", ... (" + std::to_string(missing.size() - 3) + " more)";
  throw HubCacheError(describe(id, type) + ": the cached snapshot " + snapshot.string() + " is incomplete: " +
                      std::to_string(missing.size()) + " file(s) its listing " + listing.string() +
                      " names are missing (" + sample + "); finish the download with `" +
                      hub_download_command(id, type) + "`");
}

}  // namespace

std::optional<HubId> parse_hub_id(const std::string& text) {
  HubId id;
  const size_t at = text.find('@');
  id.repo_id = text.substr(0, at);
  if (at != std::string::npos) {
    id.revision = text.substr(at + 1);
    if (id.revision.empty()) return std::nullopt;
  }
  if (!valid_repo_id(id.repo_id)) return std::nullopt;
  return id;
}

fs::path hub_cache_dir() {
  if (const char* c = env("HF_HUB_CACHE")) return expand(c);
  if (const char* c = env("HUGGINGFACE_HUB_CACHE")) return expand(c);
  std::string home;
  if (const char* h = env("HF_HOME")) {
    home = h;
  } else {
    const char* xdg = env("XDG_CACHE_HOME");
    home = ((xdg ? fs::path(xdg) : fs::path(expand_user("~")) / ".cache") / "huggingface").string();
  }
  return expand((fs::path(expand(home)) / "hub").string());
}

std::string hub_repo_folder(const std::string& repo_id, HubRepoType type) {
  std::string out = type == HubRepoType::kDataset ? "datasets" : "models";
  size_t start = 0;
  for (size_t slash; (slash = repo_id.find('/', start)) != std::string::npos; start = slash + 1)
    out += "--" + repo_id.substr(start, slash - start);
  return out + "--" + repo_id.substr(start);
}

std::string hub_download_command(const HubId& id, HubRepoType type) {
  std::string cmd = "hf download " + id.repo_id;
  if (id.revision != "main") cmd += " --revision " + id.revision;
  if (type == HubRepoType::kDataset) cmd += " --repo-type dataset";
  return cmd;
}

fs::path hub_snapshot_dir(const HubId& id, HubRepoType type, const fs::path& cache_dir) {
  std::error_code ec;
  const fs::path cache = fs::weakly_canonical(fs::absolute(cache_dir), ec);
  const fs::path storage = (ec ? cache_dir : cache) / hub_repo_folder(id.repo_id, type);
  std::string commit = id.revision;
  if (!is_commit_hash(id.revision)) {
    const fs::path ref = storage / "refs" / fs::path(id.revision);
    if (!fs::exists(storage)) not_cached(id, type, cache, "no " + storage.filename().string() + " in it");
    const auto text = fs::is_regular_file(ref) ? read_file(ref.string(), 4096) : std::nullopt;
    if (!text) not_cached(id, type, cache, "no ref " + ref.string() + " (the branches and tags cached are under refs/)");
    commit = *text;  // as written: huggingface_hub reads the ref without stripping it
  }
  const fs::path snapshot = storage / "snapshots" / commit;
  if (!fs::exists(snapshot))
    not_cached(id, type, cache, "no snapshot " + snapshot.string() + " for commit '" + commit + "'");
  check_tree_listing(id, type, storage, commit, snapshot);
  return snapshot;
}

std::string resolve_local_or_hub(const std::string& value, HubRepoType type, const std::string& key) {
  std::error_code ec;
  if (value.empty() || fs::exists(value, ec)) return value;
  const auto id = parse_hub_id(value);
  if (!id) return value;
  try {
    return hub_snapshot_dir(*id, type, hub_cache_dir()).string();
  } catch (const HubCacheError& e) {
    throw HubCacheError(key + " = \"" + value + "\": no such file or directory, and the " + e.what());
  }
}

}  // namespace qlora::io
