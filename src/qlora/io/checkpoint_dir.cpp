#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/durable_file.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <set>

// Plain POSIX here. Note for std::filesystem users: the PyPI libtorch.so exports its own,
// partly broken copies of the std::filesystem free functions (remove_all segfaults); the
// CMakeLists makes libstdc++ the first library every binary loads so that ours win.
namespace qlora::io {
namespace {

constexpr const char* kSingleName = "model.safetensors";
constexpr uintmax_t kMaxIndexBytes = 100ull << 20;  // an index is a few hundred KiB at most

[[noreturn]] void fail_dir(const std::string& path, const std::string& what) {
  throw SafetensorsError("checkpoint '" + path + "': " + what);
}

// 'r' regular file, 'd' directory (symlinks followed, as HF's cache uses them), 0 otherwise.
char file_kind(const std::string& path, struct stat* st_out = nullptr) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  if (st_out) *st_out = st;
  return S_ISREG(st.st_mode) ? 'r' : S_ISDIR(st.st_mode) ? 'd' : 0;
}

std::string join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string basename_of(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

// Shard names come from an untrusted index and are joined to the directory: only bare file names.
void check_shard_name(const std::string& where, const std::string& tensor, const std::string& shard) {
  if (shard.empty() || shard.find_first_of(std::string("/\\\0", 3)) != std::string::npos ||
      shard.find("..") != std::string::npos)
    fail_dir(where, "weight_map entry '" + tensor + "' names shard '" + shard +
                    "'; expected a bare file name (no '/', '\\' or '..')");
}

std::map<std::string, std::string> read_weight_map(const std::string& index_path) {
  struct stat st {};
  if (file_kind(index_path, &st) != 'r') fail_dir(index_path, "not a readable regular file");
  const uintmax_t size = static_cast<uintmax_t>(st.st_size);
  if (size > kMaxIndexBytes) fail_dir(index_path, "index is " + std::to_string(size) + " bytes, over the 100 MiB limit");
  std::ifstream in(index_path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in) fail_dir(index_path, "cannot read");
  nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded()) fail_dir(index_path, "not valid JSON");
  auto wm = index.is_object() ? index.find("weight_map") : index.end();
  if (wm == index.end() || !wm->is_object()) fail_dir(index_path, "expected an object with a \"weight_map\" object");
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : wm->items()) {
    if (!shard.is_string()) fail_dir(index_path, "weight_map entry '" + tensor + "' must be a shard file name string");
    check_shard_name(index_path, tensor, shard.get<std::string>());
    weight_map[tensor] = shard.get<std::string>();
  }
  if (weight_map.empty()) fail_dir(index_path, "weight_map is empty");
  return weight_map;
}

}  // namespace

CheckpointDir CheckpointDir::open(const std::string& path) {
  CheckpointDir ckpt;
  ckpt.path_ = path;
  const char kind = file_kind(path);
  std::map<std::string, std::string> weight_map;  // empty unless sharded
  std::vector<std::string> file_paths;
  if (kind == 'r') {
    file_paths.push_back(path);
  } else if (kind == 'd') {
    struct stat st {};
    if (::stat(join(path, kSafetensorsIndexName).c_str(), &st) == 0) {
      ckpt.sharded_ = true;
      weight_map = read_weight_map(join(path, kSafetensorsIndexName));
      std::set<std::string> shards;
      for (const auto& [tensor, shard] : weight_map) shards.insert(shard);
      for (const std::string& shard : shards) {
        const std::string shard_path = join(path, shard);
        if (file_kind(shard_path) != 'r')
          fail_dir(path, std::string(kSafetensorsIndexName) + " names shard '" + shard + "', which is not a file in the directory");
        file_paths.push_back(shard_path);
      }
    } else if (file_kind(join(path, kSingleName)) == 'r') {
      file_paths.push_back(join(path, kSingleName));
    } else {
      fail_dir(path, std::string("directory holds neither ") + kSafetensorsIndexName + " nor " + kSingleName);
    }
  } else {
    fail_dir(path, "no such file or directory");
  }

  for (const std::string& fp : file_paths) {
    ckpt.files_.push_back(SafetensorsFile::open(fp));
    const size_t i = ckpt.files_.size() - 1;
    for (const TensorInfo& t : ckpt.files_[i].tensors()) {
      auto [it, fresh] = ckpt.owner_.emplace(t.name, i);
      if (!fresh)
        fail_dir(path, "tensor '" + t.name + "' is present in two shards: '" + ckpt.files_[it->second].path() +
                       "' and '" + fp + "'");
      ckpt.names_.push_back(t.name);
    }
  }
  if (!ckpt.sharded_) return ckpt;

  // The index and the shard headers must agree exactly; a mismatch means a stale index or a
  // directory mixing two checkpoints, and guessing which side is right would load wrong weights.
  for (const auto& [tensor, shard] : weight_map) {
    auto it = ckpt.owner_.find(tensor);
    if (it == ckpt.owner_.end())
      fail_dir(path, "tensor '" + tensor + "' is listed in the index for shard '" + shard + "' but absent from it");
    const std::string actual = basename_of(ckpt.files_[it->second].path());
    if (actual != shard)
      fail_dir(path, "tensor '" + tensor + "' is listed in the index for shard '" + shard + "' but stored in '" +
                     actual + "'");
  }
  for (const auto& [tensor, i] : ckpt.owner_)
    if (!weight_map.count(tensor))
      fail_dir(path, "tensor '" + tensor + "' in shard '" + ckpt.files_[i].path() + "' is not listed in the index");
  return ckpt;
}

std::vector<std::string> CheckpointDir::files() const {
  std::vector<std::string> out;
  for (const SafetensorsFile& f : files_) out.push_back(f.path());
  return out;
}

const SafetensorsFile& CheckpointDir::file_of(std::string_view tensor) const {
  auto it = owner_.find(tensor);
  if (it == owner_.end()) fail_dir(path_, "no tensor named '" + std::string(tensor) + "'");
  return files_[it->second];
}

at::Tensor CheckpointDir::tensor(std::string_view name) const { return file_of(name).tensor(name); }

void write_safetensors_index(const std::string& path, const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size) {
  for (const auto& [tensor, shard] : weight_map) check_shard_name(path, tensor, shard);
  nlohmann::json index;
  index["metadata"]["total_size"] = total_size;
  index["weight_map"] = weight_map;
  write_file_atomic(path, index.dump(2, ' ', /*ensure_ascii=*/true) + "\n");
}

}  // namespace qlora::io
