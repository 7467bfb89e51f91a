#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "qlora/checkpoint/resume.h"
#include "qlora/checkpoint/xxh64.h"
#include "qlora/io/safetensors.h"

namespace fs = std::filesystem;
using namespace qlora::checkpoint;
using namespace qlora::io;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("qlora_resume_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

ResumeState sample_state(int64_t step) {
  ResumeState s;
  s.tensors.emplace_back("z.first", at::randn({3, 4}));
  s.tensors.emplace_back("rng.cpu", at::randint(0, 255, {16}, at::kByte));
  s.tensors.emplace_back("counter", at::full({2}, step, at::kLong));
  s.tensors.emplace_back("a.half", at::randn({5}).to(at::kBFloat16));
  s.meta = {{"global_step", step}, {"sampler", {{"epoch", 1}, {"offsets", {1, 2, 3}}}}, {"name", "x"}};
  return s;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// A one-process checkpoint: rank 0 of 1, its tensors and the meta.
ResumeState only_rank(const ResumeCheckpoint& c) {
  EXPECT_EQ(c.ranks.size(), 1u);
  EXPECT_FALSE(c.legacy_single_process);
  return {c.ranks.at(0), c.meta};
}

void expect_same(const ResumeState& a, const ResumeState& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].first, b.tensors[i].first);  // order preserved
    EXPECT_EQ(a.tensors[i].second.scalar_type(), b.tensors[i].second.scalar_type());
    EXPECT_TRUE(at::equal(a.tensors[i].second, b.tensors[i].second)) << a.tensors[i].first;
  }
  EXPECT_EQ(a.meta, b.meta);
}

}  // namespace

TEST(Resume, RoundTripKeepsTensorsDtypesOrderAndMeta) {
  const fs::path d = fresh_dir("roundtrip");
  const ResumeState s = sample_state(7);
  save_resume_checkpoint(d.string(), 7, s, 0);
  const auto latest = latest_resume_checkpoint(d.string());
  ASSERT_TRUE(latest);
  EXPECT_EQ(fs::path(*latest).filename(), "step_00000007");
  const ResumeState back = only_rank(load_resume_checkpoint(*latest));
  expect_same(s, back);
  back.tensors[0].second.add_(1);  // owned memory, not a read-only mapping
  const auto m = nlohmann::json::parse(read_all(fs::path(*latest) / "manifest.json"));
  EXPECT_EQ(m["format"], "qlora-resume-v1");
  EXPECT_EQ(m["step"], 7);
  EXPECT_EQ(m["world_size"], 1);
  EXPECT_EQ(m["files"]["rank_00000.safetensors"]["bytes"].get<uint64_t>(), fs::file_size(fs::path(*latest) / "rank_00000.safetensors"));
  EXPECT_EQ(m["files"]["meta.json"]["xxh64"].get<std::string>().size(), 16u);
  fs::remove_all(d);
}

TEST(Resume, NoCheckpointIsNullopt) {
  const fs::path d = fresh_dir("none");
  EXPECT_FALSE(latest_resume_checkpoint(d.string()));
  EXPECT_FALSE(latest_resume_checkpoint((d / "does_not_exist").string()));
  fs::remove_all(d);
}

TEST(Resume, KeepLastNPrunesOldestFirst) {
  const fs::path d = fresh_dir("prune");
  for (int64_t step : {10, 20, 30, 40}) save_resume_checkpoint(d.string(), step, sample_state(step), 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(d / "checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000030", "step_00000040"}));
  // Saving an older step than an existing one never removes the one just written.
  save_resume_checkpoint(d.string(), 5, sample_state(5), 1);
  EXPECT_TRUE(fs::exists(d / "checkpoints/step_00000005/manifest.json"));
  EXPECT_TRUE(fs::exists(d / "checkpoints/step_00000040/manifest.json"));
  EXPECT_FALSE(fs::exists(d / "checkpoints/step_00000030"));
  // keep_last_n <= 0 keeps everything.
  save_resume_checkpoint(d.string(), 50, sample_state(50), 0);
  EXPECT_TRUE(fs::exists(d / "checkpoints/step_00000005"));
  fs::remove_all(d);
}

TEST(Resume, TruncatedOrAlteredStateIsDetectedAndNamed) {
  const fs::path d = fresh_dir("corrupt");
  save_resume_checkpoint(d.string(), 3, sample_state(3), 0);
  const fs::path ck = d / "checkpoints/step_00000003";
  const fs::path st = ck / "rank_00000.safetensors";
  std::string bytes = read_all(st);

  bytes.back() ^= 0x01;  // one flipped bit in the data section
  std::ofstream(st, std::ios::binary | std::ios::trunc) << bytes;
  try {
    load_resume_checkpoint(ck.string());
    FAIL() << "altered file accepted";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("rank_00000.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(ck.string()), std::string::npos) << e.what();
  }

  std::ofstream(st, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 10);
  try {
    load_resume_checkpoint(ck.string());
    FAIL() << "truncated file accepted";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("rank_00000.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }

  fs::remove(ck / "meta.json");
  EXPECT_THROW(load_resume_checkpoint(ck.string()), ResumeError);
  fs::remove(ck / "manifest.json");
  try {
    load_resume_checkpoint(ck.string());
    FAIL() << "checkpoint without manifest accepted";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

TEST(Resume, LeftoverTmpFromCrashIsIgnored) {
  const fs::path d = fresh_dir("crash");
  const ResumeState s = sample_state(100);
  save_resume_checkpoint(d.string(), 100, s, 2);
  // A save of step 200 that died before its manifest: files present, no manifest.
  const fs::path tmp = d / "checkpoints/step_00000200.tmp";
  fs::create_directories(tmp);
  std::ofstream(tmp / "rank_00000.safetensors") << "partial";
  // And one that died after its manifest but before the rename: still only a .tmp.
  const fs::path tmp2 = d / "checkpoints/step_00000300.tmp";
  fs::copy(d / "checkpoints/step_00000100", tmp2);
  // A half-pruned directory (manifest already removed).
  fs::create_directories(d / "checkpoints/step_00000400");
  const auto latest = latest_resume_checkpoint(d.string());
  ASSERT_TRUE(latest);
  EXPECT_EQ(fs::path(*latest).filename(), "step_00000100");
  expect_same(s, only_rank(load_resume_checkpoint(*latest)));
  EXPECT_TRUE(fs::exists(tmp));  // left for inspection, not removed
  // The next save of the crashed step replaces the leftover.
  save_resume_checkpoint(d.string(), 200, sample_state(200), 0);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(fs::path(*latest_resume_checkpoint(d.string())).filename(), "step_00000200");
  fs::remove_all(d);
}

TEST(Resume, SavingSameStepTwiceReplaces) {
  const fs::path d = fresh_dir("twice");
  save_resume_checkpoint(d.string(), 9, sample_state(1), 3);
  const ResumeState second = sample_state(2);
  save_resume_checkpoint(d.string(), 9, second, 3);
  const auto latest = latest_resume_checkpoint(d.string());
  ASSERT_TRUE(latest);
  expect_same(second, only_rank(load_resume_checkpoint(*latest)));
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d / "checkpoints")) ++n;
  EXPECT_EQ(n, 1u);  // no .tmp or .old left behind
  fs::remove_all(d);
}

// Without RENAME_EXCHANGE, replacing step_N renames step_N -> step_N.old, step_N.tmp -> step_N,
// step_N.old -> step_N.tmp, then removes step_N.tmp. A crash after each rename is built by hand
// here; every state must resume from a complete copy of step N.
TEST(Resume, CrashInsideMoveAsideReplacementLeavesStepLoadable) {
  const fs::path d = fresh_dir("aside"), scratch = fresh_dir("aside_scratch");
  const fs::path root = d / "checkpoints", plain = root / "step_00000005", aside = root / "step_00000005.old",
                 tmp = root / "step_00000005.tmp";
  const ResumeState older = sample_state(3), before = sample_state(5), after = sample_state(50);
  save_resume_checkpoint(d.string(), 3, older, 0);
  save_resume_checkpoint(scratch.string(), 5, after, 0);  // the new copy, complete as in step_N.tmp
  auto start = [&] {  // the moment the save's step_N.tmp is complete, before any rename
    for (const fs::path& p : {plain, aside, tmp}) fs::remove_all(p);
    save_resume_checkpoint(d.string(), 5, before, 0);
    fs::copy(scratch / "checkpoints/step_00000005", tmp, fs::copy_options::recursive);
  };
  auto expect_latest = [&](const fs::path& dir, const ResumeState& s, const char* state) {
    const auto latest = latest_resume_checkpoint(d.string());
    ASSERT_TRUE(latest) << state;
    EXPECT_EQ(fs::path(*latest), dir) << state;
    expect_same(s, only_rank(load_resume_checkpoint(*latest)));
  };

  start();
  fs::rename(plain, aside);
  expect_latest(aside, before, "step_N moved aside, new copy not yet in");
  fs::rename(tmp, plain);
  expect_latest(plain, after, "new copy in, old one still aside");
  fs::rename(aside, tmp);
  expect_latest(plain, after, "old copy back in .tmp, not yet removed");

  // An aside whose manifest is gone (a removal that crashed) is not a checkpoint.
  start();
  fs::rename(plain, aside);
  fs::remove(aside / "manifest.json");
  expect_latest(root / "step_00000003", older, "aside without manifest");
  fs::remove_all(d);
  fs::remove_all(scratch);
}

TEST(Resume, NextSaveSettlesAsides) {
  const fs::path d = fresh_dir("settle");
  const fs::path root = d / "checkpoints";
  const ResumeState s5 = sample_state(5);
  save_resume_checkpoint(d.string(), 5, s5, 0);
  // The aside is step 5's only copy: a save of another step moves it back under its name.
  fs::rename(root / "step_00000005", root / "step_00000005.old");
  save_resume_checkpoint(d.string(), 6, sample_state(6), 0);
  EXPECT_FALSE(fs::exists(root / "step_00000005.old"));
  expect_same(s5, only_rank(load_resume_checkpoint((root / "step_00000005").string())));
  // Beside a complete step_5 the aside is the older copy: removed. Without a manifest: removed.
  fs::copy(root / "step_00000005", root / "step_00000005.old", fs::copy_options::recursive);
  fs::create_directories(root / "step_00000004.old");
  save_resume_checkpoint(d.string(), 7, sample_state(7), 0);
  EXPECT_FALSE(fs::exists(root / "step_00000005.old"));
  EXPECT_FALSE(fs::exists(root / "step_00000004.old"));
  expect_same(s5, only_rank(load_resume_checkpoint((root / "step_00000005").string())));
  // Saving the aside's own step again replaces both.
  fs::rename(root / "step_00000007", root / "step_00000007.old");
  const ResumeState again = sample_state(70);
  save_resume_checkpoint(d.string(), 7, again, 0);
  EXPECT_FALSE(fs::exists(root / "step_00000007.old"));
  expect_same(again, only_rank(load_resume_checkpoint(*latest_resume_checkpoint(d.string()))));
  // keep_last_n counts a restored aside like any checkpoint.
  fs::rename(root / "step_00000007", root / "step_00000007.old");
  save_resume_checkpoint(d.string(), 8, sample_state(8), 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000007", "step_00000008"}));
  fs::remove_all(d);
}

// The single-process format of earlier releases (state.safetensors, a manifest without
// world_size) still loads, flagged so the engine converts its per-adapter names; its files are
// verified like any other.
TEST(Resume, LegacySingleProcessFormatLoadsFlagged) {
  const fs::path d = fresh_dir("legacy");
  const fs::path ck = d / "checkpoints/step_00000004";
  fs::create_directories(ck);
  const ResumeState s = sample_state(4);
  save_safetensors((ck / "state.safetensors").string(), s.tensors, {});
  std::ofstream(ck / "meta.json") << s.meta.dump();
  nlohmann::json files = nlohmann::json::object();
  for (const char* f : {"state.safetensors", "meta.json"}) {
    uint64_t n = 0;
    const std::string h = xxh64_hex(xxh64_file((ck / f).string(), &n));
    files[f] = {{"bytes", n}, {"xxh64", h}};
  }
  std::ofstream(ck / "manifest.json") << nlohmann::json{{"format", "qlora-resume-v1"}, {"step", 4}, {"files", files}}.dump();
  ASSERT_EQ(latest_resume_checkpoint(d.string()), ck.string());
  const ResumeCheckpoint c = load_resume_checkpoint(ck.string());
  EXPECT_TRUE(c.legacy_single_process);
  ASSERT_EQ(c.ranks.size(), 1u);
  EXPECT_EQ(c.ranks[0].size(), s.tensors.size());
  EXPECT_EQ(c.meta, s.meta);
  std::ofstream(ck / "state.safetensors", std::ios::app) << "x";
  EXPECT_THROW(load_resume_checkpoint(ck.string()), ResumeError);
  fs::remove_all(d);
}

namespace {

// A barrier of `n` threads (C++17 has no std::barrier): the ranks of a simulated job.
class ThreadBarrier {
 public:
  explicit ThreadBarrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const int64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  int64_t gen_ = 0;
};

// Ranks 0-1 save into `a`, ranks 2-3 into `b` (node-local output dirs), each directory committed by its lead.
void save_two_dirs(const fs::path& a, const fs::path& b, int64_t step, int64_t keep_last_n) {
  ThreadBarrier barrier(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&, r] {
      RankSync sync;
      sync.rank = r;
      sync.world_size = 4;
      sync.barrier = [&] { barrier.wait(); };
      sync.lead = r < 2 ? 0 : 2;
      sync.ranks_here = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
      ResumeState s = sample_state(step);
      s.tensors[2].second.fill_(r);  // "counter": whose file it is
      save_resume_checkpoint((r < 2 ? a : b).string(), step, s, keep_last_n, sync);
    });
  for (auto& t : ranks) t.join();
}

}  // namespace

TEST(Resume, NodeLocalDirsKeepTheirOwnRanksFiles) {
  const fs::path a = fresh_dir("node_a"), b = fresh_dir("node_b");
  for (int64_t step : {2, 4, 6}) save_two_dirs(a, b, step, /*keep_last_n=*/2);
  for (const auto& [dir, here] : {std::pair{a, std::vector<int>{0, 1}}, std::pair{b, std::vector<int>{2, 3}}}) {
    EXPECT_EQ(resume_checkpoints(dir.string()).size(), 2u);  // pruned in each directory
    const auto path = latest_resume_checkpoint(dir.string());
    ASSERT_TRUE(path);
    EXPECT_EQ(resume_checkpoint_step(*path), 6);
    const ResumeCheckpoint c = load_resume_checkpoint(*path);
    EXPECT_EQ(c.world_size, 4);
    EXPECT_EQ(c.ranks_here, here);
    ASSERT_EQ(c.ranks.size(), 4u);
    for (int r = 0; r < 4; ++r) {
      const bool mine = std::find(here.begin(), here.end(), r) != here.end();
      EXPECT_EQ(c.ranks[r].empty(), !mine) << dir << " rank " << r;
      EXPECT_EQ(fs::exists(fs::path(*path) / ("rank_0000" + std::to_string(r) + ".safetensors")), mine);
      if (mine) EXPECT_EQ(c.ranks[r][2].second[0].item<int64_t>(), r);
    }
  }
}

TEST(Resume, MalformedRanksHereIsRefusedByName) {
  const fs::path a = fresh_dir("node_bad"), b = fresh_dir("node_bad_b");
  save_two_dirs(a, b, 1, 0);
  const fs::path dir = *latest_resume_checkpoint(b.string());
  const std::string manifest = read_all(dir / "manifest.json");
  for (const char* bad : {"[3, 2]", "[2, 9]", "[]", "\"2\""}) {
    std::string m = manifest;
    const size_t at = m.find("\"ranks_here\"");
    ASSERT_NE(at, std::string::npos);
    const size_t open = m.find('[', at), close = m.find(']', open);
    m.replace(open, close - open + 1, bad);
    std::ofstream(dir / "manifest.json", std::ios::binary) << m;
    try {
      load_resume_checkpoint(dir.string());
      ADD_FAILURE() << "ranks_here " << bad << " was accepted";
    } catch (const ResumeError& e) {
      EXPECT_NE(std::string(e.what()).find("ranks_here"), std::string::npos) << e.what();
    }
  }
}

// A manifest whose fields have the wrong JSON types is damage (ResumeError, so resume tries an
// older checkpoint), not a JSON library error: fuzz_resume found "format" as an object escaping.
TEST(Resume, ManifestFieldsOfTheWrongTypeAreDamage) {
  const fs::path d = fresh_dir("wrong_types");
  save_resume_checkpoint(d.string(), 3, sample_state(3), 0);
  const fs::path ck = d / "checkpoints/step_00000003";
  const std::string manifest = read_all(ck / "manifest.json");
  nlohmann::json good = nlohmann::json::parse(manifest);
  for (const char* key : {"format", "step", "files"}) {
    for (const nlohmann::json& bad : {nlohmann::json::object(), nlohmann::json::array(), nlohmann::json(7.5)}) {
      nlohmann::json m = good;
      m[key] = bad;
      std::ofstream(ck / "manifest.json", std::ios::binary | std::ios::trunc) << m.dump();
      try {
        load_resume_checkpoint(ck.string());
        ADD_FAILURE() << key << " = " << bad.dump() << " was accepted";
      } catch (const ResumeError& e) {
        EXPECT_NE(std::string(e.what()).find("manifest"), std::string::npos) << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << key << " = " << bad.dump() << ": not a ResumeError: " << e.what();
      }
    }
  }
  std::ofstream(ck / "manifest.json", std::ios::binary | std::ios::trunc) << manifest;
  EXPECT_NO_THROW(load_resume_checkpoint(ck.string()));
}
