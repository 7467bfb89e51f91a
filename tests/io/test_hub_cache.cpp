// io/hub_cache: Hub ids in the local Hugging Face cache, on hand-made cache trees: the cache
// directory from the environment in huggingface_hub's order, refs and commit-hash revisions, the
// errors for what is not cached, and a local path winning over an id. (conformance.hub_cache checks
// the same against huggingface_hub's own snapshot_download.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include "qlora/io/hub_cache.h"

namespace fs = std::filesystem;
using namespace qlora::io;

namespace {

const std::string kCommit = "0123456789abcdef0123456789abcdef01234567";
const std::string kOther = "fedcba9876543210fedcba9876543210fedcba98";

// Sets (or with nullopt unsets) variables for one test, restoring the old values after it.
class EnvGuard {
 public:
  void set(const char* name, std::optional<std::string> value) {
    if (!saved_.count(name)) {
      const char* old = std::getenv(name);
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
    }
    value ? ::setenv(name, value->c_str(), 1) : ::unsetenv(name);
  }
  ~EnvGuard() {
    for (const auto& [name, value] : saved_) value ? ::setenv(name.c_str(), value->c_str(), 1) : ::unsetenv(name.c_str());
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

fs::path scratch() {
  const fs::path d = fs::temp_directory_path() / ("qlora_hub_cache_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

// <cache>/models--org--name with refs/main -> kCommit, a tag v1 -> kOther and the PR ref
// refs/pr/1 -> kOther; both snapshots hold config.json.
fs::path make_cache(const fs::path& root) {
  const fs::path repo = root / "models--org--name";
  write(repo / "refs" / "main", kCommit);
  write(repo / "refs" / "v1", kOther);
  write(repo / "refs" / "refs" / "pr" / "1", kOther);
  write(repo / "snapshots" / kCommit / "config.json", "{}");
  write(repo / "snapshots" / kOther / "config.json", "{}");
  return root;
}

std::string error_of(const HubId& id, const fs::path& cache) {
  try {
    hub_snapshot_dir(id, HubRepoType::kModel, cache);
  } catch (const HubCacheError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(HubCache, ParsesIdsAsHuggingfaceHubValidatesThem) {
  const auto a = parse_hub_id("Qwen/Qwen2.5-7B-Instruct");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->repo_id, "Qwen/Qwen2.5-7B-Instruct");
  EXPECT_EQ(a->revision, "main");
  const auto b = parse_hub_id("gpt2@refs/pr/1");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->repo_id, "gpt2");
  EXPECT_EQ(b->revision, "refs/pr/1");
  for (const char* bad : {"", "/abs/path", "a/b/c", "org/", ".hidden/x", "org/name-", "a--b/c", "a/b..c", "a/b.git",
                          "org/name@", "./x", "data/train.jsonl/", "caf\xc3\xa9/x"})
    EXPECT_FALSE(parse_hub_id(bad)) << bad;
  EXPECT_EQ(hub_repo_folder("org/name", HubRepoType::kModel), "models--org--name");
  EXPECT_EQ(hub_repo_folder("gpt2", HubRepoType::kDataset), "datasets--gpt2");
}

TEST(HubCache, CacheDirectoryFollowsTheEnvironmentInHuggingfaceHubsOrder) {
  EnvGuard env;
  for (const char* v : {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"}) env.set(v, std::nullopt);
  env.set("HOME", "/home/u");
  EXPECT_EQ(hub_cache_dir(), fs::path("/home/u/.cache/huggingface/hub"));
  env.set("XDG_CACHE_HOME", "/xdg");
  EXPECT_EQ(hub_cache_dir(), fs::path("/xdg/huggingface/hub"));
  env.set("HF_HOME", "~/hf");  // expanduser
  EXPECT_EQ(hub_cache_dir(), fs::path("/home/u/hf/hub"));
  env.set("HUGGINGFACE_HUB_CACHE", "/legacy");
  EXPECT_EQ(hub_cache_dir(), fs::path("/legacy"));
  env.set("ROOT_OF", "/vol");
  env.set("HF_HUB_CACHE", "${ROOT_OF}/c/$ROOT_OF/$UNSET_VAR_X");  // expandvars; unknown names stay
  EXPECT_EQ(hub_cache_dir(), fs::path("/vol/c//vol/$UNSET_VAR_X"));
}

TEST(HubCache, ResolvesBranchesTagsPrRefsAndCommitHashes) {
  const fs::path cache = make_cache(scratch());
  const fs::path snaps = fs::canonical(cache) / "models--org--name" / "snapshots";
  EXPECT_EQ(hub_snapshot_dir(*parse_hub_id("org/name"), HubRepoType::kModel, cache), snaps / kCommit);
  EXPECT_EQ(hub_snapshot_dir(*parse_hub_id("org/name@v1"), HubRepoType::kModel, cache), snaps / kOther);
  EXPECT_EQ(hub_snapshot_dir(*parse_hub_id("org/name@refs/pr/1"), HubRepoType::kModel, cache), snaps / kOther);
  // A full commit hash needs no ref: the snapshot itself.
  fs::remove(cache / "models--org--name" / "refs" / "v1");
  EXPECT_EQ(hub_snapshot_dir(*parse_hub_id("org/name@" + kOther), HubRepoType::kModel, cache), snaps / kOther);
  // A relative cache directory is made absolute, as huggingface_hub's Path.resolve() does.
  const fs::path cwd = fs::current_path();
  fs::current_path(cache);
  EXPECT_EQ(hub_snapshot_dir(*parse_hub_id("org/name"), HubRepoType::kModel, "."), snaps / kCommit);
  fs::current_path(cwd);
  fs::remove_all(cache);
}

TEST(HubCache, WhatIsNotCachedIsAnErrorNamingTheCacheTheIdAndTheFetchCommand) {
  const fs::path cache = make_cache(scratch());
  const std::string missing = error_of(*parse_hub_id("org/other"), cache);
  EXPECT_TRUE(contains(missing, fs::canonical(cache).string())) << missing;
  EXPECT_TRUE(contains(missing, "'org/other' (revision 'main')")) << missing;
  EXPECT_TRUE(contains(missing, "models--org--other")) << missing;
  EXPECT_TRUE(contains(missing, "`hf download org/other`")) << missing;
  const std::string rev = error_of(*parse_hub_id("org/name@dev"), cache);
  EXPECT_TRUE(contains(rev, "revision 'dev'") && contains(rev, "refs/dev")) << rev;
  EXPECT_TRUE(contains(rev, "`hf download org/name --revision dev`")) << rev;
  const std::string commit = error_of(*parse_hub_id("org/name@" + std::string(40, 'a')), cache);
  EXPECT_TRUE(contains(commit, "no snapshot") && contains(commit, std::string(40, 'a'))) << commit;
  // A ref to a commit whose snapshot is gone.
  write(cache / "models--org--name" / "refs" / "main", kCommit + "\n");  // read as written, like huggingface_hub
  EXPECT_TRUE(contains(error_of(*parse_hub_id("org/name"), cache), "no snapshot"));
  try {
    hub_snapshot_dir(*parse_hub_id("yahma/alpaca-cleaned"), HubRepoType::kDataset, cache);
    FAIL();
  } catch (const HubCacheError& e) {
    EXPECT_TRUE(contains(e.what(), "data set 'yahma/alpaca-cleaned'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "`hf download yahma/alpaca-cleaned --repo-type dataset`")) << e.what();
  }
  fs::remove_all(cache);
}

TEST(HubCache, ASnapshotItsTreeListingShowsIncompleteIsRefused) {
  const fs::path cache = make_cache(scratch());
  const fs::path listing = cache / "models--org--name" / "trees" / (kCommit + ".json");
  write(listing, R"({"format_version": 1, "files": {"config.json": {"size": 2, "blob_id": "x"},
                     "model.safetensors": {"size": 9, "blob_id": "y"}}})");
  const std::string e = error_of(*parse_hub_id("org/name"), cache);
  EXPECT_TRUE(contains(e, "incomplete") && contains(e, "model.safetensors")) << e;
  write(cache / "models--org--name" / "snapshots" / kCommit / "model.safetensors", "x");
  EXPECT_EQ(error_of(*parse_hub_id("org/name"), cache), "");
  write(listing, R"({"format_version": 2, "files": {"absent.bin": {"size": 1, "blob_id": "z"}}})");  // unknown: ignored
  EXPECT_EQ(error_of(*parse_hub_id("org/name"), cache), "");
  fs::remove_all(cache);
}

TEST(HubCache, AnExistingPathWinsOverAnId) {
  EnvGuard env;
  const fs::path root = scratch();
  env.set("HF_HUB_CACHE", make_cache(root / "cache").string());
  const fs::path cwd = fs::current_path();
  fs::current_path(root);
  const std::string resolved = resolve_local_or_hub("org/name", HubRepoType::kModel, "model.checkpoint_dir");
  EXPECT_EQ(resolved, (fs::canonical(root / "cache") / "models--org--name" / "snapshots" / kCommit).string());
  fs::create_directories(root / "org" / "name");
  EXPECT_EQ(resolve_local_or_hub("org/name", HubRepoType::kModel, "model.checkpoint_dir"), "org/name");
  EXPECT_EQ(resolve_local_or_hub("/no/such/dir", HubRepoType::kModel, "model.checkpoint_dir"), "/no/such/dir");
  try {
    resolve_local_or_hub("org/absent", HubRepoType::kModel, "model.checkpoint_dir");
    FAIL();
  } catch (const HubCacheError& e) {
    EXPECT_TRUE(contains(e.what(), "model.checkpoint_dir = \"org/absent\": no such file or directory")) << e.what();
  }
  fs::current_path(cwd);
  fs::remove_all(root);
}
