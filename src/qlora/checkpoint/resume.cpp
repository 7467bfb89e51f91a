#include "qlora/checkpoint/resume.h"
#include "qlora/io/read_file.h"

#include <ATen/ops/all.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "qlora/io/durable_file.h"
#include "qlora/io/safetensors.h"
#include "qlora/checkpoint/xxh64.h"

namespace fs = std::filesystem;

namespace qlora::checkpoint {

namespace {

constexpr const char* kFormat = "qlora-resume-v1";
// The one state file of the single-process format of earlier releases (read, never written).
constexpr const char* kLegacyState = "state.safetensors";
constexpr const char* kMeta = "meta.json";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kOrderKey = "qlora.tensor_order";  // safetensors metadata: JSON list of names
constexpr const char* kAside = ".old";  // where the move-aside replacement parks the old directory
constexpr int64_t kMaxWorld = 1 << 20;  // ranks a manifest may name (more is a damaged file)

std::string step_name(int64_t step) {
  char s[32];
  std::snprintf(s, sizeof s, "step_%08lld", static_cast<long long>(step));
  return s;
}

struct StepName {
  int64_t step;
  bool aside;  // step_<digits>.old: the previous copy of that step, parked by a replacing save
};

// "step_<digits>" or "step_<digits>.old" exactly (not .tmp or any other suffix).
std::optional<StepName> parse_step_name(std::string name) {
  const size_t suffix = std::strlen(kAside);
  const bool aside = name.size() > suffix && name.compare(name.size() - suffix, suffix, kAside) == 0;
  if (aside) name.resize(name.size() - suffix);
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  }
  return StepName{std::stoll(name.substr(5)), aside};
}

void fsync_dir(const fs::path& dir) { io::fsync_path(dir.string()); }

std::string read_text(const fs::path& path) {
  std::optional<std::string> text;
  try {
    text = io::read_file(path.string());
  } catch (const std::invalid_argument& e) {  // not a regular file, or past any size we write: damage
    throw ResumeError(std::string("resume checkpoint: ") + e.what());
  }
  if (!text) throw ResumeError("resume checkpoint: cannot read " + path.string());
  return std::move(*text);
}

// The manifest of `dir`, parsed and shape-checked; nullopt only when the file does not exist.
std::optional<nlohmann::json> read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifest;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    throw ResumeError(path.string() + ": manifest is not valid JSON: " + e.what());
  }
  // json::value() throws its own type_error for a "format" that is not a string: check the type.
  const bool format_ok = m.is_object() && m.contains("format") && m["format"].is_string() &&
                         m["format"].get<std::string>() == kFormat;
  if (!format_ok || !m.contains("step") || !m["step"].is_number_integer() || !m.contains("files") ||
      !m["files"].is_object()) {
    throw ResumeError(path.string() + ": not a " + std::string(kFormat) +
                      " manifest (expected format, integer step and a files object)");
  }
  return m;
}

// Whether `dir` holds a manifest that parses and names `step`. An unreadable manifest makes the
// directory not a checkpoint; load would name the problem.
bool is_complete(const fs::path& dir, int64_t step) {
  try {
    const auto m = read_manifest(dir);
    return m && (*m)["step"].get<int64_t>() == step;
  } catch (const ResumeError&) {
    return false;
  }
}

// step -> directory of every complete checkpoint under <output_dir>/checkpoints. A step's aside
// copy stands in only where step_N itself is not complete: that is the state a crash between the
// two renames of the move-aside replacement leaves, and then the aside is the newest full copy.
std::map<int64_t, fs::path> complete_checkpoints(const fs::path& root) {
  std::map<int64_t, fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const auto name = parse_step_name(e.path().filename().string());
    if (!name || !e.is_directory() || !is_complete(e.path(), name->step)) continue;
    if (name->aside) {
      out.try_emplace(name->step, e.path());
    } else {
      out[name->step] = e.path();
    }
  }
  return out;
}

// Atomically puts `from` at `to`, which may exist (then `from` ends up holding the old one).
// Returns true if `to` existed.
bool rename_dir_replacing(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  if (!fs::exists(to, ec)) {
    fs::rename(from, to);
    return false;
  }
#ifdef SYS_renameat2
  constexpr unsigned kRenameExchange = 2;  // RENAME_EXCHANGE from <linux/fs.h>
  if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), kRenameExchange) == 0) return true;
#endif
  // Filesystem without RENAME_EXCHANGE: move the old one aside, then the new one in.
  const fs::path aside = to.string() + kAside;
  fs::remove_all(aside);
  fs::rename(to, aside);
  fs::rename(from, to);
  fs::rename(aside, from);
  return true;
}

void remove_checkpoint(const fs::path& dir) {
  // Manifest first (made durable), so a crash mid-removal leaves a directory nobody will load.
  fs::remove(dir / kManifest);
  fsync_dir(dir);
  fs::remove_all(dir);
}

// Tidies what a crash inside a move-aside replacement left behind, once a later save has
// succeeded: an aside is dropped where its step_N is complete (it is the older copy), moved back
// to step_N where it is that step's only complete copy, and dropped where it is incomplete.
void settle_asides(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> asides;  // collected first: the loop below renames
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const auto name = parse_step_name(e.path().filename().string());
    if (name && name->aside && e.is_directory()) asides.emplace_back(name->step, e.path());
  }
  for (const auto& [step, aside] : asides) {
    const fs::path plain = root / step_name(step);
    if (is_complete(plain, step) || !is_complete(aside, step)) {
      remove_checkpoint(aside);
    } else {
      if (fs::exists(plain)) remove_checkpoint(plain);  // manifest-less: a half-pruned leftover
      fs::rename(aside, plain);
    }
  }
  if (!asides.empty()) fsync_dir(root);
}

}  // namespace

void commit_directory(const std::string& tmp, const std::string& final_dir) {
  if (rename_dir_replacing(tmp, final_dir)) {
    io::fsync_parent(final_dir);
    fs::remove_all(tmp);  // now holds the replaced directory
  }
  io::fsync_parent(final_dir);
}

namespace {

fs::path checkpoints_root(const std::string& output_dir) { return fs::path(output_dir) / "checkpoints"; }
fs::path tmp_dir_of(const fs::path& root, int64_t step) { return root.string() + "/" + step_name(step) + ".tmp"; }

// A fresh, empty step_N.tmp/ (a crashed save of this same step is incomplete by construction).
fs::path prepare_tmp(const fs::path& root, int64_t step) {
  if (step < 0) throw ResumeError("save_resume_checkpoint: negative step " + std::to_string(step));
  if (!fs::exists(root)) {
    fs::create_directories(root);
    fsync_dir(root.parent_path());
  }
  const fs::path tmp = tmp_dir_of(root, step);
  fs::remove_all(tmp);
  fs::create_directory(tmp);
  return tmp;
}

// One safetensors file of named tensors (any device; written from CPU copies), durable on return.
void write_state_file(const fs::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<std::pair<std::string, at::Tensor>> cpu;
  nlohmann::json order = nlohmann::json::array();
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) throw ResumeError("save_resume_checkpoint: tensor '" + name + "' is undefined");
    if (at::isFloatingType(t.scalar_type()) && !at::isfinite(t).all().item<bool>())
      throw ResumeError("save_resume_checkpoint: tensor '" + name + "' holds NaN or inf; not saving " + path.string() +
                        " (nothing non-finite is ever saved)");
    cpu.emplace_back(name, t.detach().to(at::kCPU).contiguous());
    order.push_back(name);
  }
  // save_safetensors orders entries by dtype width for alignment; the caller's order rides along.
  io::save_safetensors(path.string(), cpu, {{kOrderKey, order.dump()}});
}

// Writes meta.json and the manifest over every file in `files` (hashing what is on disk, not what
// was meant) and commits tmp/ as step_N.
void commit_checkpoint(const fs::path& root, const fs::path& tmp, int64_t step, const nlohmann::json& meta,
                       const std::vector<std::string>& files, nlohmann::json manifest_extra) {
  io::write_file_atomic((tmp / kMeta).string(), (meta.is_null() ? nlohmann::json::object() : meta).dump(2));
  nlohmann::json listed = nlohmann::json::object();
  std::vector<std::string> all = files;
  all.push_back(kMeta);
  for (const std::string& f : all) {
    uint64_t n = 0;
    const uint64_t h = xxh64_file((tmp / f).string(), &n);
    listed[f] = {{"bytes", n}, {"xxh64", xxh64_hex(h)}};
  }
  manifest_extra["format"] = kFormat;
  manifest_extra["step"] = step;
  manifest_extra["files"] = listed;
  io::write_file_atomic((tmp / kManifest).string(), manifest_extra.dump(2));  // fsyncs tmp/ as well
  commit_directory(tmp.string(), (root / step_name(step)).string());
  settle_asides(root);
}

// Leaves the keep_last_n newest complete checkpoints (by step) and `step`, which is never removed.
void prune(const fs::path& root, int64_t step, int64_t keep_last_n) {
  if (keep_last_n <= 0) return;
  const auto complete = complete_checkpoints(root);
  int64_t kept = 0;
  for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
    if (it->first == step || kept < keep_last_n) {
      ++kept;
      continue;
    }
    remove_checkpoint(it->second);
  }
  fsync_dir(root);
}

// Checks the manifest of `dir` and the size and XXH64 of every file it lists (`required` among
// them) before anything is read.
nlohmann::json verify_checkpoint(const std::string& dir, const std::vector<std::string>& required) {
  const fs::path d(dir);
  const auto manifest = read_manifest(d);
  if (!manifest) {
    throw ResumeError("resume checkpoint " + dir + ": missing " + kManifest +
                      " (an incomplete save, or not a resume checkpoint)");
  }
  const nlohmann::json& files = (*manifest)["files"];
  for (const std::string& r : required)
    if (!files.contains(r)) throw ResumeError("resume checkpoint " + dir + ": manifest does not list " + r);
  for (const auto& [name, entry] : files.items()) {
    if (name.find('/') != std::string::npos || name == "..") {
      throw ResumeError("resume checkpoint " + dir + ": manifest names an invalid file '" + name + "'");
    }
    const fs::path path = d / name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) throw ResumeError("resume checkpoint " + dir + ": file " + name + " is missing");
    if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_unsigned() ||
        !entry.contains("xxh64") || !entry["xxh64"].is_string()) {
      throw ResumeError("resume checkpoint " + dir + ": manifest entry for " + name +
                        " needs bytes (a non-negative integer) and xxh64 (a string), not " + entry.dump());
    }
    uint64_t n = 0;
    std::string h;
    try {
      h = xxh64_hex(xxh64_file(path.string(), &n));
    } catch (const std::runtime_error& e) {
      throw ResumeError("resume checkpoint " + dir + ": " + e.what());
    }
    const uint64_t want_n = entry["bytes"].get<uint64_t>();
    if (n != want_n) {
      throw ResumeError("resume checkpoint " + dir + ": file " + name + " has " + std::to_string(n) +
                        " bytes, manifest says " + std::to_string(want_n) + " (truncated or replaced)");
    }
    if (h != entry["xxh64"].get<std::string>()) {
      throw ResumeError("resume checkpoint " + dir + ": file " + name + " fails its checksum (xxh64 " + h +
                        ", manifest says " + entry["xxh64"].get<std::string>() + ")");
    }
  }
  return *manifest;
}

nlohmann::json read_meta(const std::string& dir) {
  try {
    return nlohmann::json::parse(read_text(fs::path(dir) / kMeta));
  } catch (const nlohmann::json::exception& e) {
    throw ResumeError("resume checkpoint " + dir + ": " + kMeta + " is not valid JSON: " + e.what());
  }
}

// The tensors of one state file in the order they were saved, owning their memory (not views of
// the mapping).
// Any error (a malformed header or tensor order, a name it lacks) is a ResumeError naming the file.
std::vector<std::pair<std::string, at::Tensor>> read_state_file(const fs::path& path) {
  try {
    const io::SafetensorsFile f = io::SafetensorsFile::open(path.string());
    std::vector<std::string> names;
    const auto it = f.metadata().find(kOrderKey);
    if (it != f.metadata().end()) {
      names = nlohmann::json::parse(it->second).get<std::vector<std::string>>();
    } else {
      for (const io::TensorInfo& ti : f.tensors()) names.push_back(ti.name);
    }
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const std::string& name : names) out.emplace_back(name, f.tensor(name).clone());
    return out;
  } catch (const std::exception& e) {
    throw ResumeError("resume checkpoint file " + path.string() + ": " + e.what());
  }
}

std::string rank_file(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank_%05d.safetensors", rank);
  return buf;
}

}  // namespace

void save_resume_checkpoint(const std::string& output_dir, int64_t global_step, const ResumeState& mine,
                            int64_t keep_last_n, const RankSync& sync) {
  const auto barrier = [&] {
    if (sync.barrier) sync.barrier();
  };
  const bool lead = sync.rank == sync.lead;
  const fs::path root = checkpoints_root(output_dir);
  if (lead) prepare_tmp(root, global_step);
  barrier();  // step_N.tmp/ exists
  const fs::path tmp = tmp_dir_of(root, global_step);
  write_state_file(tmp / rank_file(sync.rank), mine.tensors);
  barrier();  // every rank's part is durable: only now may it become a checkpoint
  if (lead) {
    std::vector<int> here = sync.ranks_here;
    if (here.empty())
      for (int r = 0; r < sync.world_size; ++r) here.push_back(r);
    std::vector<std::string> files;
    for (int r : here) files.push_back(rank_file(r));
    nlohmann::json extra = {{"world_size", sync.world_size}, {"mesh", sync.mesh}};
    if (!sync.ranks_here.empty()) extra["ranks_here"] = sync.ranks_here;
    commit_checkpoint(root, tmp, global_step, mine.meta, files, extra);
  }
  barrier();  // committed in every directory: older checkpoints are no longer needed anywhere
  if (lead) prune(root, global_step, keep_last_n);
  barrier();  // pruned before anyone goes on, or saves again
}

std::optional<std::string> latest_resume_checkpoint(const std::string& output_dir) {
  const auto all = complete_checkpoints(checkpoints_root(output_dir));
  if (all.empty()) return std::nullopt;
  return all.rbegin()->second.string();
}

std::vector<std::string> resume_checkpoints(const std::string& output_dir) {
  std::vector<std::string> out;
  const auto all = complete_checkpoints(checkpoints_root(output_dir));
  for (auto it = all.rbegin(); it != all.rend(); ++it) out.push_back(it->second.string());
  return out;
}

std::string set_aside_damaged(const std::string& dir) { return set_aside(dir, "damaged"); }

std::string set_aside(const std::string& dir, const std::string& reason) {
  std::string to = dir + "." + reason;
  for (int k = 1; fs::exists(to); ++k) to = dir + "." + reason + "." + std::to_string(k);
  fs::rename(dir, to);
  fsync_dir(fs::path(dir).parent_path());
  return to;
}

ResumeCheckpoint load_resume_checkpoint(const std::string& dir) {
  const auto manifest = read_manifest(fs::path(dir));
  if (!manifest) throw ResumeError("resume checkpoint " + dir + ": missing " + kManifest);
  ResumeCheckpoint out;
  if (!manifest->contains("world_size")) {  // the single-process format of earlier releases
    verify_checkpoint(dir, {kLegacyState, kMeta});
    out.meta = read_meta(dir);
    out.ranks.push_back(read_state_file(fs::path(dir) / kLegacyState));
    out.legacy_single_process = true;
    return out;
  }
  const nlohmann::json& world_json = (*manifest)["world_size"];
  if (!world_json.is_number_integer() || world_json.get<int64_t>() < 1 || world_json.get<int64_t>() > kMaxWorld)
    throw ResumeError("resume checkpoint " + dir + ": manifest.json's world_size must be an integer in [1, " +
                      std::to_string(kMaxWorld) + "], not " + world_json.dump());
  const int world = world_json.get<int>();
  out.world_size = world;
  if (manifest->contains("ranks_here")) {
    const nlohmann::json& here = (*manifest)["ranks_here"];
    const auto bad = [&] {
      throw ResumeError("resume checkpoint " + dir + ": manifest.json's ranks_here must be ascending ranks below "
                        "world_size " + std::to_string(world) + ", not " + here.dump());
    };
    if (!here.is_array() || here.empty()) bad();
    for (const auto& r : here) {
      if (!r.is_number_integer() || r.get<int64_t>() < 0 || r.get<int64_t>() >= world ||
          (!out.ranks_here.empty() && r.get<int>() <= out.ranks_here.back()))
        bad();
      out.ranks_here.push_back(r.get<int>());
    }
  }
  std::vector<int> present = out.ranks_here;
  if (present.empty())
    for (int r = 0; r < world; ++r) present.push_back(r);
  std::vector<std::string> required = {kMeta};
  for (int r : present) required.push_back(rank_file(r));
  verify_checkpoint(dir, required);
  out.meta = read_meta(dir);
  out.ranks.resize(static_cast<size_t>(world));
  for (int r : present) out.ranks[static_cast<size_t>(r)] = read_state_file(fs::path(dir) / rank_file(r));
  return out;
}

int64_t resume_checkpoint_step(const std::string& dir) {
  const auto manifest = read_manifest(fs::path(dir));
  if (!manifest) throw ResumeError("resume checkpoint " + dir + ": missing " + kManifest);
  return (*manifest)["step"].get<int64_t>();
}

}  // namespace qlora::checkpoint
