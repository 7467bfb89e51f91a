// A Hugging Face checkpoint as one flat set of named tensors: a single .safetensors file, a
// directory with model.safetensors, or a directory of shards listed by
// model.safetensors.index.json.
#pragma once

#include "qlora/io/safetensors.h"

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace qlora::io {

// The index file of a sharded checkpoint, as transformers names it.
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";

class CheckpointDir {
 public:
  // Reads every shard's header up front (mmap, no tensor data): a stale or inconsistent index
  // should fail here, not hours into a run. Errors are SafetensorsError naming the checkpoint.
  static CheckpointDir open(const std::string& path);

  const std::string& path() const { return path_; }
  bool is_sharded() const { return sharded_; }
  std::vector<std::string> tensor_names() const { return names_; }  // file order; files sorted
  std::vector<std::string> files() const;                            // shard paths, sorted
  const std::vector<SafetensorsFile>& shards() const { return files_; }  // same order as files()
  bool contains(std::string_view tensor) const { return owner_.count(tensor) != 0; }
  const SafetensorsFile& file_of(std::string_view tensor) const;     // throws if absent
  at::Tensor tensor(std::string_view name) const;                    // zero-copy, see SafetensorsFile

 private:
  std::string path_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> files_;
  std::vector<std::string> names_;
  std::map<std::string, size_t, std::less<>> owner_;  // tensor -> index into files_
};

// Atomically writes model.safetensors.index.json as transformers does (json.dumps with indent=2,
// sort_keys=True, ASCII escapes, trailing newline).
void write_safetensors_index(const std::string& path, const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size);

}  // namespace qlora::io
