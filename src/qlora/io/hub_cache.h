// Models and data sets named by Hub id ("Qwen/Qwen2.5-7B-Instruct", "yahma/alpaca-cleaned@main"),
// found in the local Hugging Face cache the way huggingface_hub finds them offline
// (snapshot_download(local_files_only=True)). Nothing is ever downloaded: an id that is not in the
// cache is an error naming where it looked and the `hf download` command that would fetch it.
//
// The cache directory, in huggingface_hub's order: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE (legacy),
// $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub; "~" and $VARS in them
// expanded as Python's os.path.expanduser / expandvars do, then made absolute with symlinks
// resolved (Path.resolve). A repository lives in <cache>/<kind>s--<org>--<name>/: refs/<revision>
// holds the commit a branch or tag (or refs/pr/N) points to, snapshots/<commit>/ the files. A
// revision of 40 lowercase hex digits is that commit itself.
#pragma once

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>

namespace qlora::io {

struct HubCacheError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

enum class HubRepoType { kModel, kDataset };

// A Hub id as written in a config: "name" or "org/name" (huggingface_hub's repo id rules: each part
// 1-96 of [A-Za-z0-9_.-], starting and ending with a letter, digit or '_'; no "--" or ".."; not
// ending in ".git"), optionally "@revision" (a branch, tag, refs/pr/N or commit hash).
struct HubId {
  std::string repo_id;
  std::string revision = "main";  // huggingface_hub's DEFAULT_REVISION
};

// nullopt when `text` is not of that form (it is then only ever a path).
std::optional<HubId> parse_hub_id(const std::string& text);

// The cache directory huggingface_hub would use with this process's environment (not made
// absolute; hub_snapshot_dir does that).
std::filesystem::path hub_cache_dir();

// "models--org--name" / "datasets--org--name".
std::string hub_repo_folder(const std::string& repo_id, HubRepoType type);

// The snapshot directory of `id` in `cache_dir` (absolute, symlinks in cache_dir resolved): what
// snapshot_download(repo_id, revision=..., repo_type=..., cache_dir=..., local_files_only=True)
// returns. A snapshot that its cached tree listing (trees/<commit>.json) shows incomplete is an
// error, as there. Throws HubCacheError naming the cache, the id, the revision, what is missing
// and the command that fetches it.
std::filesystem::path hub_snapshot_dir(const HubId& id, HubRepoType type, const std::filesystem::path& cache_dir);

// `value` of config key `key` (e.g. "model.checkpoint_dir"): an existing file or directory is
// returned unchanged (a path always wins); else a Hub id resolves to its snapshot directory in
// hub_cache_dir(); anything else is returned unchanged, for the reader to report as missing.
std::string resolve_local_or_hub(const std::string& value, HubRepoType type, const std::string& key);

// "hf download org/name [--revision R] [--repo-type dataset]": what fetches `id` into the cache.
std::string hub_download_command(const HubId& id, HubRepoType type);

}  // namespace qlora::io
