// safetensors reading (memory-mapped, zero-copy, hardened against untrusted files) and streaming,
// atomic writing. Format: u64 little-endian header length N, N bytes of JSON, then the data section.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace qlora::io {

enum class Dtype { F32, F16, BF16, I8, U8, I32, I64, F64 };

const char* dtype_name(Dtype dtype);  // "F32", "F16", ... as spelled in safetensors headers
int dtype_size(Dtype dtype);          // bytes per element
at::ScalarType to_scalar_type(Dtype dtype);
Dtype from_scalar_type(at::ScalarType type);  // throws SafetensorsError for types safetensors here lacks
Dtype parse_dtype(std::string_view name);     // throws SafetensorsError listing the supported names

// Every message names the file, the tensor where one is involved, and what was expected.
struct SafetensorsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the start of the data section
  int64_t numel() const;
};

// Read-only view of one file. The mapping is shared with every tensor handed out, so tensors stay
// valid after the SafetensorsFile is destroyed or moved.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in order of data offset
  const TensorInfo* find(std::string_view name) const;                // nullptr if absent
  const TensorInfo& info(std::string_view name) const;                // throws if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t data_offset() const { return data_offset_; }  // 8 + header length: where data begins
  uint64_t file_size() const;

  const uint8_t* data(std::string_view name) const;  // points into the mapping
  // Zero-copy CPU tensor over the mapping; the pages are PROT_READ, so writing to it faults.
  // Foreign files may place a tensor at an offset not aligned to its element size: that one is
  // copied instead, because ATen's vectorized kernels may assume natural alignment.
  at::Tensor tensor(std::string_view name) const;
  // Drops the resident pages of a tensor (page-aligned inward) so a streaming reader's RSS stays
  // flat; a later access reads them back from the file.
  void release(std::string_view name) const;

 private:
  struct Mapping;
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  uint64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

struct EntrySpec {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
};

// A file's header as SafetensorsWriter writes it: the 8-byte length, the JSON (entries in the
// given order, 8-byte aligned) and each entry's end offset in the data section.
struct SafetensorsHeader {
  std::string bytes;
  std::vector<uint64_t> ends;
  uint64_t data_size = 0;
};
SafetensorsHeader safetensors_header(const std::string& path, const std::vector<EntrySpec>& entries,
                                     const std::map<std::string, std::string>& metadata = {});

// Positional writing, for files several processes fill at once (a parallel export): one creates
// the file with its header at its final size, then each writes (pwrite, fsync) the entries it
// owns, then fsyncs (io::fsync_path, durable_file.h) each file it wrote into, once. Not atomic on its own: write into
// a directory that is committed afterwards.
void create_safetensors_file(const std::string& path, const SafetensorsHeader& header);
void write_safetensors_entry(const std::string& path, const SafetensorsHeader& header, size_t entry,
                             const at::Tensor& t);

// Streaming writer: the header goes first, so every entry is declared up front; data then follows
// in declared order, in as many write() calls as convenient (a call may span entries). Writes go
// to path + ".tmp"; only commit() makes the file appear at path (io::commit_aside, durable_file.h).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<EntrySpec> entries,
                    std::map<std::string, std::string> metadata = {});
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();  // without commit(): closes and removes the .tmp file

  void write(const void* data, size_t nbytes);
  void write_tensor(const at::Tensor& t);  // must match the next entry's dtype and shape exactly
  void commit();

  const std::string& path() const { return path_; }
  uint64_t data_size() const { return total_; }  // bytes of the data section
  uint64_t file_size() const { return header_size_ + total_; }

 private:
  void flush_buffer();
  void raw_write(const void* data, size_t nbytes);
  uint64_t entry_begin(size_t i) const;
  void check_writable() const;

  std::string path_, tmp_path_;
  std::vector<EntrySpec> entries_;
  std::vector<uint64_t> ends_;  // cumulative end offset of each entry
  uint64_t header_size_ = 0, total_ = 0, pos_ = 0;
  size_t next_ = 0;  // first entry not yet completely written
  std::vector<char> buffer_;  // coalesces small writes into few syscalls
  int fd_ = -1;
  bool committed_ = false;
};

// Atomic save: entries are stored with wider dtypes first (stable otherwise), as the official
// library does, so every tensor is naturally aligned and later zero-copy reads never copy.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace qlora::io
