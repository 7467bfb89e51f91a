#include "qlora/checkpoint/resume.h"

#include <ATen/ops/empty.h>
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

#include "qlora/checkpoint/safetensors.h"

namespace fs = std::filesystem;

namespace qlora::checkpoint {

namespace {

constexpr const char* kFormat = "qlora-resume-v1";
constexpr const char* kState = "state.safetensors";
constexpr const char* kMeta = "meta.json";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kOrderKey = "qlora.tensor_order";  // safetensors metadata: JSON list of names

// ---- XXH64 (the published algorithm; little-endian reads) ----
constexpr uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL, P3 = 1609587929392839161ULL,
                   P4 = 9650029242287828579ULL, P5 = 2870177450012600261ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // x86/arm64 little-endian hosts only, as the rest of the safetensors code assumes
}
inline uint32_t read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t round64(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
inline uint64_t merge64(uint64_t h, uint64_t v) { return (h ^ round64(0, v)) * P1 + P4; }

// Streaming state, so a file is hashed in fixed-size chunks.
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed) : seed_(seed), v_{seed + P1 + P2, seed + P2, seed, seed - P1} {}

  void update(const uint8_t* p, size_t n) {
    total_ += n;
    if (buffered_ > 0) {
      const size_t take = std::min(n, 32 - buffered_);
      std::memcpy(buf_ + buffered_, p, take);
      buffered_ += take, p += take, n -= take;
      if (buffered_ < 32) return;
      stripe(buf_);
      buffered_ = 0;
    }
    for (; n >= 32; p += 32, n -= 32) stripe(p);
    std::memcpy(buf_, p, n);
    buffered_ = n;
  }

  uint64_t digest() const {
    uint64_t h;
    if (total_ >= 32) {
      h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
      for (uint64_t v : v_) h = merge64(h, v);
    } else {
      h = seed_ + P5;
    }
    h += total_;
    const uint8_t* p = buf_;
    size_t n = buffered_;
    for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ round64(0, read64(p)), 27) * P1 + P4;
    if (n >= 4) {
      h = rotl(h ^ (uint64_t{read32(p)} * P1), 23) * P2 + P3;
      p += 4, n -= 4;
    }
    for (; n > 0; ++p, --n) h = rotl(h ^ (uint64_t{*p} * P5), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
  }

 private:
  void stripe(const uint8_t* p) {
    for (int i = 0; i < 4; ++i) v_[i] = round64(v_[i], read64(p + 8 * i));
  }
  uint64_t seed_;
  uint64_t v_[4];
  uint8_t buf_[32] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

std::string hex64(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

std::string step_name(int64_t step) {
  char s[32];
  std::snprintf(s, sizeof s, "step_%08lld", static_cast<long long>(step));
  return s;
}

// "step_<digits>" exactly (no .tmp or other suffix) -> step.
std::optional<int64_t> parse_step_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  }
  return std::stoll(name.substr(5));
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) throw ResumeError("resume checkpoint: cannot open directory " + dir.string() + ": " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw ResumeError("resume checkpoint: fsync of " + dir.string() + " failed: " + std::strerror(err));
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ResumeError("resume checkpoint: cannot read " + path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
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
  if (!m.is_object() || m.value("format", "") != kFormat || !m.contains("step") || !m["step"].is_number_integer() ||
      !m.contains("files") || !m["files"].is_object()) {
    throw ResumeError(path.string() + ": not a " + std::string(kFormat) +
                      " manifest (expected format, integer step and a files object)");
  }
  return m;
}

// step -> directory of every complete checkpoint under <output_dir>/checkpoints.
std::map<int64_t, fs::path> complete_checkpoints(const fs::path& root) {
  std::map<int64_t, fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const auto step = parse_step_name(e.path().filename().string());
    if (!step || !e.is_directory()) continue;
    try {
      const auto m = read_manifest(e.path());
      if (m && (*m)["step"].get<int64_t>() == *step) out[*step] = e.path();
    } catch (const ResumeError&) {
      // An unreadable manifest makes the directory not a checkpoint; load would name the problem.
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
  const fs::path aside = to.string() + ".old";
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

}  // namespace

void commit_directory(const std::string& tmp, const std::string& final_dir) {
  const fs::path parent = fs::path(final_dir).parent_path();
  if (rename_dir_replacing(tmp, final_dir)) {
    fsync_dir(parent);
    fs::remove_all(tmp);  // now holds the replaced directory
  }
  fsync_dir(parent);
}

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed) {
  Xxh64 h(seed);
  h.update(static_cast<const uint8_t*>(data), nbytes);
  return h.digest();
}

uint64_t xxh64_file(const std::string& path, uint64_t* nbytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ResumeError("resume checkpoint: cannot read " + path);
  Xxh64 h(0);
  std::vector<char> buf(1 << 20);
  uint64_t total = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<size_t>(in.gcount());
    h.update(reinterpret_cast<const uint8_t*>(buf.data()), got);
    total += got;
  }
  if (in.bad()) throw ResumeError("resume checkpoint: read error in " + path);
  if (nbytes) *nbytes = total;
  return h.digest();
}

void save_resume_checkpoint(const std::string& output_dir, int64_t global_step, const ResumeState& state,
                            int64_t keep_last_n) {
  if (global_step < 0) throw ResumeError("save_resume_checkpoint: negative step " + std::to_string(global_step));
  const fs::path root = fs::path(output_dir) / "checkpoints";
  const fs::path final_dir = root / step_name(global_step);
  const fs::path tmp = root.string() + "/" + step_name(global_step) + ".tmp";
  if (!fs::exists(root)) {
    fs::create_directories(root);
    fsync_dir(root.parent_path());
  }
  fs::remove_all(tmp);  // a crashed save of this same step: incomplete by construction
  fs::create_directory(tmp);

  std::vector<std::pair<std::string, at::Tensor>> cpu;
  nlohmann::json order = nlohmann::json::array();
  for (const auto& [name, t] : state.tensors) {
    if (!t.defined()) throw ResumeError("save_resume_checkpoint: tensor '" + name + "' is undefined");
    cpu.emplace_back(name, t.detach().to(at::kCPU).contiguous());
    order.push_back(name);
  }
  // save_safetensors orders entries by dtype width for alignment; the caller's order rides along.
  save_safetensors((tmp / kState).string(), cpu, {{kOrderKey, order.dump()}});
  cpu.clear();
  write_file_atomic((tmp / kMeta).string(), (state.meta.is_null() ? nlohmann::json::object() : state.meta).dump(2));

  nlohmann::json files = nlohmann::json::object();
  for (const char* f : {kState, kMeta}) {
    uint64_t n = 0;
    const uint64_t h = xxh64_file((tmp / f).string(), &n);  // hash what is on disk, not what we meant
    files[f] = {{"bytes", n}, {"xxh64", hex64(h)}};
  }
  const nlohmann::json manifest = {{"format", kFormat}, {"step", global_step}, {"files", files}};
  write_file_atomic((tmp / kManifest).string(), manifest.dump(2));  // fsyncs tmp/ as well

  commit_directory(tmp.string(), final_dir.string());

  if (keep_last_n <= 0) return;
  const auto all = complete_checkpoints(root);
  int64_t kept = 0;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->first == global_step || kept < keep_last_n) {
      ++kept;
      continue;
    }
    remove_checkpoint(it->second);
  }
  fsync_dir(root);
}

std::optional<std::string> latest_resume_checkpoint(const std::string& output_dir) {
  const auto all = complete_checkpoints(fs::path(output_dir) / "checkpoints");
  if (all.empty()) return std::nullopt;
  return all.rbegin()->second.string();
}

ResumeState load_resume_checkpoint(const std::string& dir) {
  const fs::path d(dir);
  const auto manifest = read_manifest(d);
  if (!manifest) {
    throw ResumeError("resume checkpoint " + dir + ": missing " + kManifest +
                      " (an incomplete save, or not a resume checkpoint)");
  }
  const nlohmann::json& files = (*manifest)["files"];
  for (const char* required : {kState, kMeta}) {
    if (!files.contains(required)) {
      throw ResumeError("resume checkpoint " + dir + ": manifest does not list " + required);
    }
  }
  for (const auto& [name, entry] : files.items()) {
    if (name.find('/') != std::string::npos || name == "..") {
      throw ResumeError("resume checkpoint " + dir + ": manifest names an invalid file '" + name + "'");
    }
    const fs::path path = d / name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) throw ResumeError("resume checkpoint " + dir + ": file " + name + " is missing");
    if (!entry.is_object() || !entry.contains("bytes") || !entry.contains("xxh64")) {
      throw ResumeError("resume checkpoint " + dir + ": manifest entry for " + name + " lacks bytes/xxh64");
    }
    uint64_t n = 0;
    const std::string h = hex64(xxh64_file(path.string(), &n));
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

  ResumeState out;
  try {
    out.meta = nlohmann::json::parse(read_text(d / kMeta));
  } catch (const nlohmann::json::exception& e) {
    throw ResumeError("resume checkpoint " + dir + ": " + kMeta + " is not valid JSON: " + e.what());
  }
  const SafetensorsFile f = SafetensorsFile::open((d / kState).string());
  std::vector<std::string> names;
  const auto it = f.metadata().find(kOrderKey);
  if (it != f.metadata().end()) {
    names = nlohmann::json::parse(it->second).get<std::vector<std::string>>();
  } else {
    for (const TensorInfo& ti : f.tensors()) names.push_back(ti.name);
  }
  for (const std::string& name : names) {
    // clone: owned, writable memory instead of a read-only view of the mapping.
    out.tensors.emplace_back(name, f.tensor(name).clone());
  }
  return out;
}

}  // namespace qlora::checkpoint
