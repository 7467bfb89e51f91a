#include "qlora/gguf/writer.h"

#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "qlora/io/durable_file.h"

namespace qlora::gguf {
namespace {

template <typename T>
void append(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

void append_string(std::vector<uint8_t>& out, const std::string& s) {
  append<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

Value scalar(ValueType type, const void* p, size_t n) {
  Value v;
  v.type = type;
  v.scalars.assign(static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  return v;
}

template <typename T>
Value scalar_array(ValueType element, const std::vector<T>& values) {
  Value v;
  v.type = ValueType::ARRAY;
  v.element = element;
  v.count = values.size();
  for (const T& x : values) append(v.scalars, x);
  return v;
}

void append_value(std::vector<uint8_t>& out, const Value& v) {
  append<uint32_t>(out, static_cast<uint32_t>(v.type));
  if (v.type == ValueType::STRING) return append_string(out, v.strings.at(0));
  if (v.type != ValueType::ARRAY) return out.insert(out.end(), v.scalars.begin(), v.scalars.end()), void();
  append<uint32_t>(out, static_cast<uint32_t>(v.element));
  append<uint64_t>(out, v.count);
  if (v.element == ValueType::STRING)
    for (const auto& s : v.strings) append_string(out, s);
  else
    out.insert(out.end(), v.scalars.begin(), v.scalars.end());
}

uint64_t aligned(uint64_t n) { return (n + Writer::kAlignment - 1) / Writer::kAlignment * Writer::kAlignment; }

}  // namespace

Value Value::u32(uint32_t v) { return scalar(ValueType::U32, &v, 4); }
Value Value::i32(int32_t v) { return scalar(ValueType::I32, &v, 4); }
Value Value::f32(float v) { return scalar(ValueType::F32, &v, 4); }
Value Value::boolean(bool v) {
  const uint8_t b = v ? 1 : 0;
  return scalar(ValueType::BOOL, &b, 1);
}
Value Value::string(std::string v) {
  Value out;
  out.type = ValueType::STRING;
  out.strings.push_back(std::move(v));
  return out;
}
Value Value::strings_array(std::vector<std::string> v) {
  Value out;
  out.type = ValueType::ARRAY;
  out.element = ValueType::STRING;
  out.count = v.size();
  out.strings = std::move(v);
  return out;
}
Value Value::i32_array(const std::vector<int32_t>& v) { return scalar_array(ValueType::I32, v); }
Value Value::f32_array(const std::vector<float>& v) { return scalar_array(ValueType::F32, v); }
Value Value::bool_array(const std::vector<bool>& v) {
  std::vector<uint8_t> bytes(v.begin(), v.end());  // one byte each, 0 or 1
  return scalar_array(ValueType::BOOL, bytes);
}

uint64_t TensorSpec::nbytes() const {
  if (shape.empty()) throw std::invalid_argument("GGUF tensor " + name + " has no dimensions");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return static_cast<uint64_t>(rows) * row_bytes(type, shape.back());
}

Writer::Writer(std::string path, std::vector<std::pair<std::string, Value>> metadata, std::vector<TensorSpec> tensors)
    : path_(std::move(path)), tmp_path_(io::aside_path(path_)), tensors_(std::move(tensors)) {
  std::vector<uint8_t> head;
  head.insert(head.end(), {'G', 'G', 'U', 'F'});
  append<uint32_t>(head, 3);
  append<uint64_t>(head, tensors_.size());
  append<uint64_t>(head, metadata.size());
  for (const auto& [key, value] : metadata) {
    append_string(head, key);
    append_value(head, value);
  }
  uint64_t offset = 0;
  for (const TensorSpec& t : tensors_) {
    append_string(head, t.name);
    append<uint32_t>(head, static_cast<uint32_t>(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) append<uint64_t>(head, static_cast<uint64_t>(*d));
    append<uint32_t>(head, static_cast<uint32_t>(t.type));
    append<uint64_t>(head, offset);
    offset = aligned(offset + t.nbytes());
  }
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  if (!file_) throw std::runtime_error("GGUF file '" + tmp_path_ + "': cannot open for writing: " + std::strerror(errno));
  raw(head.data(), head.size());
  pad_to_alignment();
}

Writer::~Writer() {
  if (file_) std::fclose(file_);
  if (!committed_) std::filesystem::remove(tmp_path_);
}

void Writer::raw(const void* data, size_t nbytes) {
  if (nbytes && std::fwrite(data, 1, nbytes, file_) != nbytes)
    throw std::runtime_error("GGUF file '" + tmp_path_ + "': write failed: " + std::strerror(errno));
  pos_ += nbytes;
}

void Writer::pad_to_alignment() {
  static const uint8_t zeros[kAlignment] = {};
  raw(zeros, aligned(pos_) - pos_);
}

void Writer::write(const void* data, size_t nbytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (nbytes > 0) {
    if (next_ >= tensors_.size()) throw std::logic_error("GGUF " + path_ + ": more data than the tensors declared");
    const uint64_t room = tensors_[next_].nbytes() - written_in_tensor_;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(room, nbytes));
    raw(p, n);
    p += n;
    nbytes -= n;
    written_in_tensor_ += n;
    if (written_in_tensor_ == tensors_[next_].nbytes()) {
      pad_to_alignment();
      written_in_tensor_ = 0;
      ++next_;
    }
  }
}

void Writer::commit() {
  if (next_ != tensors_.size())
    throw std::logic_error("GGUF " + path_ + ": " + std::to_string(tensors_.size() - next_) + " tensors not written");
  // fclose flushes stdio's buffer; it fails where that write or the close itself fails.
  const bool closed = std::fclose(std::exchange(file_, nullptr)) == 0;
  if (!closed) throw std::runtime_error("GGUF file '" + tmp_path_ + "': cannot flush: " + std::strerror(errno));
  io::commit_aside(tmp_path_, path_);  // fsync, rename, fsync the directory; on failure the .tmp is gone
  committed_ = true;
}

}  // namespace qlora::gguf
