// The GGUF container (version 3), streamed: metadata and every tensor's name, shape and type are
// declared first, so the header and the tensor table are written before any tensor data; the data
// then follows tensor by tensor, each at an offset aligned to general.alignment (32). Writes go to
// path + ".tmp"; commit() commits it onto path as every durable write does (io::commit_aside: fsync,
// rename, fsync the directory), so a crash never leaves a torn file.
//
// Layout (little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata count; each
// metadata entry: string key, u32 value type, value; each tensor: string name, u32 dims, u64 ne[dims]
// (innermost first: a [rows, cols] matrix is ne = {cols, rows}), u32 ggml type, u64 offset into
// the data section. A string is a u64 byte length and the bytes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "qlora/gguf/ggml_types.h"

namespace qlora::gguf {

// GGUF's metadata value types (the numbers are gguf_type).
enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9, U64 = 10,
  I64 = 11, F64 = 12
};

// One metadata value: a scalar, a string, or an array of one element type.
struct Value {
  ValueType type = ValueType::U32;
  ValueType element = ValueType::U32;  // arrays only
  std::vector<uint8_t> scalars;        // little-endian scalar bytes (scalars and scalar arrays)
  std::vector<std::string> strings;    // a string, or an array of strings
  uint64_t count = 0;                  // array length

  static Value u32(uint32_t v);
  static Value i32(int32_t v);
  static Value f32(float v);
  static Value boolean(bool v);
  static Value string(std::string v);
  static Value strings_array(std::vector<std::string> v);
  static Value i32_array(const std::vector<int32_t>& v);
  static Value f32_array(const std::vector<float>& v);
  static Value bool_array(const std::vector<bool>& v);
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // row-major, outermost first (as torch): written reversed
  GgmlType type = GgmlType::F32;
  uint64_t nbytes() const;     // whole rows of the innermost dimension
};

class Writer {
 public:
  static constexpr uint64_t kAlignment = 32;

  Writer(std::string path, std::vector<std::pair<std::string, Value>> metadata, std::vector<TensorSpec> tensors);
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  ~Writer();  // without commit(): closes and removes the .tmp file

  // The next tensor's bytes, in one or more calls; a tensor is complete when its nbytes() arrived.
  void write(const void* data, size_t nbytes);
  void commit();

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  size_t next_tensor() const { return next_; }

 private:
  void raw(const void* data, size_t nbytes);
  void pad_to_alignment();

  std::string path_, tmp_path_;
  std::vector<TensorSpec> tensors_;
  std::FILE* file_ = nullptr;
  uint64_t pos_ = 0, written_in_tensor_ = 0;
  size_t next_ = 0;
  bool committed_ = false;
};

}  // namespace qlora::gguf
