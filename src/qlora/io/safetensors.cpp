#include "qlora/io/safetensors.h"

#include "qlora/io/durable_file.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

// The format is little-endian on disk and we copy the length prefix and tensor bytes verbatim.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace qlora::io {
namespace {

// The official library's cap; a larger claim is either corruption or an attempt to make us
// allocate or scan gigabytes before noticing.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr size_t kWriteBuffer = 1 << 20;
constexpr const char* kSupported = "F64, F32, F16, BF16, I8, U8, I32, I64";

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw SafetensorsError("safetensors file '" + path + "': " + what);
}
[[noreturn]] void fail(const std::string& path, std::string_view tensor, const std::string& what) {
  fail(path, "tensor '" + std::string(tensor) + "': " + what);
}
std::string sys_error() { return std::strerror(errno); }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// *out = element count * element size; false if either product overflows. Dims must be >= 0.
bool checked_nbytes(const std::vector<int64_t>& shape, int size, uint64_t* out) {
  uint64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  return !__builtin_mul_overflow(n, static_cast<uint64_t>(size), out);
}

bool lookup_dtype(std::string_view name, Dtype* out) {
  static constexpr Dtype kAll[] = {Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16,
                                   Dtype::I8,  Dtype::U8,  Dtype::I32, Dtype::I64};
  for (Dtype d : kAll)
    if (name == dtype_name(d)) return *out = d, true;
  return false;
}

}  // namespace

const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::F64: return "F64";
    case Dtype::F32: return "F32";
    case Dtype::F16: return "F16";
    case Dtype::BF16: return "BF16";
    case Dtype::I8: return "I8";
    case Dtype::U8: return "U8";
    case Dtype::I32: return "I32";
    case Dtype::I64: return "I64";
  }
  return "?";
}

int dtype_size(Dtype d) {
  switch (d) {
    case Dtype::I8: case Dtype::U8: return 1;
    case Dtype::F16: case Dtype::BF16: return 2;
    case Dtype::F32: case Dtype::I32: return 4;
    case Dtype::F64: case Dtype::I64: return 8;
  }
  return 0;
}

at::ScalarType to_scalar_type(Dtype d) {
  switch (d) {
    case Dtype::F64: return at::kDouble;
    case Dtype::F32: return at::kFloat;
    case Dtype::F16: return at::kHalf;
    case Dtype::BF16: return at::kBFloat16;
    case Dtype::I8: return at::kChar;
    case Dtype::U8: return at::kByte;
    case Dtype::I32: return at::kInt;
    case Dtype::I64: return at::kLong;
  }
  throw SafetensorsError("invalid Dtype value " + std::to_string(static_cast<int>(d)));
}

Dtype from_scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return Dtype::F64;
    case at::kFloat: return Dtype::F32;
    case at::kHalf: return Dtype::F16;
    case at::kBFloat16: return Dtype::BF16;
    case at::kChar: return Dtype::I8;
    case at::kByte: return Dtype::U8;
    case at::kInt: return Dtype::I32;
    case at::kLong: return Dtype::I64;
    default: break;
  }
  throw SafetensorsError(std::string("torch dtype ") + c10::toString(t) +
                         " has no safetensors dtype here; supported: " + kSupported);
}

Dtype parse_dtype(std::string_view name) {
  Dtype d;
  if (!lookup_dtype(name, &d))
    throw SafetensorsError("unknown safetensors dtype \"" + std::string(name) + "\"; supported: " + kSupported);
  return d;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded at parse/declare time
  return n;
}

// ---------------------------------------------------------------------------------------------
// Reader

struct SafetensorsFile::Mapping {
  void* addr = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (addr != MAP_FAILED) ::munmap(addr, size);
  }
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(addr); }
};

namespace {

// Maps `path` read-only after checking it is a regular file of at least the 8-byte length prefix;
// *size is its length. Never returns MAP_FAILED.
void* map_file(const std::string& path, uint64_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + sys_error());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a readable regular file");
  }
  *size = static_cast<uint64_t>(st.st_size);
  if (*size < 8) {
    ::close(fd);
    fail(path, "file is " + std::to_string(*size) + " bytes, shorter than the 8-byte header length");
  }
  void* addr = ::mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (addr == MAP_FAILED) fail(path, "mmap failed: " + sys_error());
  return addr;
}

// The JSON header of the mapped file `bytes` of `size` bytes: its length bounded, no key repeated
// within an object, a JSON object. *data_offset is where the data section begins.
nlohmann::json parse_header(const std::string& path, const uint8_t* bytes, uint64_t size, uint64_t* data_offset) {
  uint64_t header_len;
  std::memcpy(&header_len, bytes, 8);
  if (header_len > kMaxHeaderBytes)
    fail(path, "header length " + std::to_string(header_len) + " exceeds the 100 MiB limit");
  if (header_len > size - 8)
    fail(path, "header length " + std::to_string(header_len) + " exceeds the " + std::to_string(size - 8) +
                   " bytes after the length prefix (truncated file?)");
  *data_offset = 8 + header_len;

  // nlohmann keeps the last of duplicate keys silently; a duplicate tensor name is ambiguous, so
  // track the keys of every open object and reject repeats.
  std::vector<std::set<std::string>> open_objects;
  auto on_event = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) open_objects.emplace_back();
    if (ev == E::object_end) open_objects.pop_back();
    if (ev == E::key && !open_objects.back().insert(parsed.get<std::string>()).second) {
      if (open_objects.size() == 1) fail(path, parsed.get<std::string>(), "appears twice in the header");
      fail(path, "header repeats the key '" + parsed.get<std::string>() + "' inside one object");
    }
    return true;
  };
  nlohmann::json header;
  try {
    const char* h = reinterpret_cast<const char*>(bytes + 8);
    header = nlohmann::json::parse(h, h + header_len, on_event);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header must be a JSON object, got " + std::string(header.type_name()));
  return header;
}

void parse_metadata(const std::string& path, const nlohmann::json& entry, std::map<std::string, std::string>& out) {
  if (!entry.is_object()) fail(path, "__metadata__ must be an object of strings");
  for (const auto& [k, v] : entry.items()) {
    if (!v.is_string()) fail(path, "__metadata__ value for '" + k + "' must be a string, got " + v.type_name());
    out[k] = v.get<std::string>();
  }
}

// The dtype and shape of one tensor entry (dims bounded to int64).
void parse_dtype_and_shape(const std::string& path, const nlohmann::json& entry, TensorInfo& ti) {
  const std::string& name = ti.name;
  auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string()) fail(path, name, "missing string \"dtype\"");
  if (!lookup_dtype(dt->get<std::string>(), &ti.dtype))
    fail(path, name, "unknown dtype \"" + dt->get<std::string>() + "\"; supported: " + kSupported);
  auto sh = entry.find("shape");
  if (sh == entry.end() || !sh->is_array()) fail(path, name, "missing array \"shape\"");
  for (const auto& d : *sh) {
    // nlohmann stores non-negative integer literals as unsigned: anything else is a float,
    // a negative number or not a number at all.
    if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      fail(path, name, "shape dims must be non-negative integers, got " + sh->dump());
    ti.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
}

// One tensor entry, checked on its own: a known dtype, a shape whose bytes fit the data section of
// `data_size` bytes, and data_offsets inside it spanning exactly those bytes.
TensorInfo parse_entry(const std::string& path, const std::string& name, const nlohmann::json& entry,
                       uint64_t data_size) {
  if (!entry.is_object()) fail(path, name, "entry must be an object with dtype, shape, data_offsets");
  TensorInfo ti;
  ti.name = name;
  parse_dtype_and_shape(path, entry, ti);
  auto off = entry.find("data_offsets");
  if (off == entry.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned())
    fail(path, name, "\"data_offsets\" must be two non-negative integers [begin, end]");
  ti.begin = (*off)[0].get<uint64_t>();
  ti.end = (*off)[1].get<uint64_t>();
  uint64_t nbytes;
  if (!checked_nbytes(ti.shape, dtype_size(ti.dtype), &nbytes))
    fail(path, name, "shape " + shape_str(ti.shape) + " overflows the element count");
  if (nbytes > data_size)
    fail(path, name, "shape " + shape_str(ti.shape) + " needs " + std::to_string(nbytes) +
                         " bytes but the data section has only " + std::to_string(data_size));
  if (ti.begin > ti.end || ti.end > data_size)
    fail(path, name, "data_offsets [" + std::to_string(ti.begin) + ", " + std::to_string(ti.end) +
                         "] must satisfy begin <= end <= data section size " + std::to_string(data_size));
  if (ti.end - ti.begin != nbytes)
    fail(path, name, "data_offsets span " + std::to_string(ti.end - ti.begin) + " bytes but " +
                         dtype_name(ti.dtype) + " " + shape_str(ti.shape) + " needs " + std::to_string(nbytes));
  return ti;
}

// Sorts the tensors by data offset and checks, like the official reader, that they tile the data
// section from 0 to its end: no byte is shared and none is unaccounted for.
void sort_and_check_tiling(const std::string& path, std::vector<TensorInfo>& tensors, uint64_t data_size) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = tensors[i];
    if (t.begin < expected)
      fail(path, t.name, "data_offsets overlap tensor '" + tensors[i - 1].name + "' (begins at " +
                             std::to_string(t.begin) + ", expected " + std::to_string(expected) + ")");
    if (t.begin > expected)
      fail(path, t.name, "hole of " + std::to_string(t.begin - expected) + " bytes before this tensor (begins at " +
                             std::to_string(t.begin) + ", expected " + std::to_string(expected) + ")");
    expected = t.end;
  }
  if (expected != data_size)
    fail(path, "tensors cover " + std::to_string(expected) + " bytes but the data section has " +
                   std::to_string(data_size) + " (trailing bytes)");
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  auto mapping = std::make_shared<Mapping>();
  mapping->addr = map_file(path, &mapping->size);
  f.mapping_ = mapping;
  const nlohmann::json header = parse_header(path, mapping->bytes(), mapping->size, &f.data_offset_);
  const uint64_t data_size = mapping->size - f.data_offset_;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__")
      parse_metadata(path, entry, f.metadata_);
    else
      f.tensors_.push_back(parse_entry(path, name, entry, data_size));
  }
  sort_and_check_tiling(path, f.tensors_, data_size);
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

uint64_t SafetensorsFile::file_size() const { return mapping_->size; }

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  if (const TensorInfo* t = find(name)) return *t;
  fail(path_, name, "not present in this file");
}

const uint8_t* SafetensorsFile::data(std::string_view name) const {
  return mapping_->bytes() + data_offset_ + info(name).begin;
}

at::Tensor SafetensorsFile::tensor(std::string_view name) const {
  const TensorInfo& ti = info(name);
  auto options = at::TensorOptions().dtype(to_scalar_type(ti.dtype));
  auto* p = const_cast<uint8_t*>(data(name));
  if (ti.end > ti.begin && reinterpret_cast<uintptr_t>(p) % dtype_size(ti.dtype) != 0) {
    at::Tensor copy = at::empty(ti.shape, options);
    std::memcpy(copy.data_ptr(), p, ti.end - ti.begin);
    return copy;
  }
  std::shared_ptr<const Mapping> keep = mapping_;
  return at::from_blob(p, ti.shape, [keep](void*) {}, options);
}

void SafetensorsFile::release(std::string_view name) const {
  const TensorInfo& ti = info(name);
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t base = reinterpret_cast<uintptr_t>(mapping_->bytes() + data_offset_);
  // Inward rounding: pages shared with a neighbouring tensor may still be in use.
  const uintptr_t lo = (base + ti.begin + page - 1) / page * page;
  const uintptr_t hi = (base + ti.end) / page * page;
  if (lo < hi) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advisory: errors ignored
}

// ---------------------------------------------------------------------------------------------
// Writer

SafetensorsHeader safetensors_header(const std::string& path, const std::vector<EntrySpec>& entries,
                                     const std::map<std::string, std::string>& metadata) {
  // Built by hand rather than as an ordered_json, whose key lookup is linear (a quantized
  // checkpoint declares thousands of entries). Compact JSON with __metadata__ first, as the
  // official writer emits; entries stay in declaration order.
  SafetensorsHeader h;
  std::string json = "{";
  std::set<std::string_view> seen;
  uint64_t total = 0;
  try {
    if (!metadata.empty()) json += "\"__metadata__\":" + nlohmann::json(metadata).dump() + ",";
    for (const EntrySpec& e : entries) {
      if (e.name == "__metadata__" || !seen.insert(e.name).second)
        fail(path, e.name, "name is reserved or declared twice");
      for (int64_t d : e.shape)
        if (d < 0) fail(path, e.name, "negative dim in shape " + shape_str(e.shape));
      uint64_t nbytes;
      if (!checked_nbytes(e.shape, dtype_size(e.dtype), &nbytes) || nbytes > UINT64_MAX - total)
        fail(path, e.name, "shape " + shape_str(e.shape) + " overflows");
      json += nlohmann::json(e.name).dump() + ":{\"dtype\":\"" + dtype_name(e.dtype) + "\",\"shape\":" +
              nlohmann::json(e.shape).dump() + ",\"data_offsets\":[" + std::to_string(total) + "," +
              std::to_string(total + nbytes) + "]},";
      total += nbytes;
      h.ends.push_back(total);
    }
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("tensor names and metadata must be valid UTF-8: ") + e.what());
  }
  if (json.size() > 1) json.pop_back();  // trailing comma
  json += "}";
  // Padding the JSON with spaces puts the data section on an 8-byte boundary.
  json.append((8 - json.size() % 8) % 8, ' ');
  const uint64_t n = json.size();
  h.bytes.assign(reinterpret_cast<const char*>(&n), 8);
  h.bytes += json;
  h.data_size = total;
  return h;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<EntrySpec> entries,
                                     std::map<std::string, std::string> metadata)
    : path_(std::move(path)), tmp_path_(aside_path(path_)), entries_(std::move(entries)) {
  SafetensorsHeader h = safetensors_header(path_, entries_, metadata);
  ends_ = std::move(h.ends);
  total_ = h.data_size;
  header_size_ = h.bytes.size();
  buffer_.reserve(kWriteBuffer);
  fd_ = open_aside(path_);
  try {
    raw_write(h.bytes.data(), h.bytes.size());
  } catch (...) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
    throw;
  }
}

void create_safetensors_file(const std::string& path, const SafetensorsHeader& header) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, std::string("cannot create: ") + std::strerror(errno));
  try {
    write_all(fd, header.bytes.data(), header.bytes.size(), path);
    if (::ftruncate(fd, static_cast<off_t>(header.bytes.size() + header.data_size)) != 0)
      fail(path, std::string("cannot size the file: ") + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

void write_safetensors_entry(const std::string& path, const SafetensorsHeader& header, size_t entry,
                             const at::Tensor& t) {
  const at::Tensor c = t.cpu().contiguous();
  const uint64_t begin = entry == 0 ? 0 : header.ends.at(entry - 1);
  const uint64_t nbytes = static_cast<uint64_t>(c.numel()) * c.element_size();
  if (begin + nbytes != header.ends.at(entry))
    fail(path, "entry " + std::to_string(entry) + " is " + std::to_string(header.ends[entry] - begin) +
                   " bytes, the tensor written there " + std::to_string(nbytes));
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open for writing: ") + std::strerror(errno));
  const char* p = static_cast<const char*>(c.data_ptr());
  uint64_t off = header.bytes.size() + begin, left = nbytes;
  while (left > 0) {
    const ssize_t w = ::pwrite(fd, p, left, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      fail(path, "write failed: " + err);
    }
    p += w;
    off += static_cast<uint64_t>(w);
    left -= static_cast<uint64_t>(w);
  }
  ::close(fd);
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void SafetensorsWriter::flush_buffer() {
  if (buffer_.empty()) return;
  write_all(fd_, buffer_.data(), buffer_.size(), tmp_path_);
  buffer_.clear();
}

void SafetensorsWriter::raw_write(const void* data, size_t nbytes) {
  if (buffer_.size() + nbytes > kWriteBuffer) flush_buffer();
  if (nbytes >= kWriteBuffer) return write_all(fd_, data, nbytes, tmp_path_);
  auto* p = static_cast<const char*>(data);
  buffer_.insert(buffer_.end(), p, p + nbytes);
}

uint64_t SafetensorsWriter::entry_begin(size_t i) const { return i == 0 ? 0 : ends_[i - 1]; }

void SafetensorsWriter::check_writable() const {
  if (committed_) fail(path_, "writer already committed");
  if (fd_ < 0) fail(path_, "writer unusable after an earlier failed write");
}

void SafetensorsWriter::write(const void* data, size_t nbytes) {
  check_writable();
  if (nbytes > total_ - pos_) {
    std::string last = entries_.empty() ? "(none declared)" : entries_.back().name;
    fail(path_, last, "write of " + std::to_string(nbytes) + " bytes at data offset " + std::to_string(pos_) +
                          " overflows the declared " + std::to_string(total_) + " bytes, which end with this tensor");
  }
  try {
    raw_write(data, nbytes);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  pos_ += nbytes;
  // An empty entry counts as written only once bytes flow past it, so write_tensor() on it still
  // finds it next.
  while (next_ < entries_.size() &&
         (ends_[next_] < pos_ || (ends_[next_] == pos_ && entry_begin(next_) < pos_)))
    ++next_;
}

void SafetensorsWriter::write_tensor(const at::Tensor& t) {
  check_writable();
  if (!t.defined()) fail(path_, "write_tensor given an undefined tensor");
  size_t i = next_;
  // A non-empty tensor implicitly completes any empty entries still pending.
  if (t.numel() != 0)
    while (i < entries_.size() && entry_begin(i) == ends_[i]) ++i;
  if (i == entries_.size()) fail(path_, "write_tensor called after every declared entry was written");
  const EntrySpec& e = entries_[i];
  if (pos_ != entry_begin(i))
    fail(path_, e.name, "write_tensor at data offset " + std::to_string(pos_) + " but the entry begins at " +
                            std::to_string(entry_begin(i)) + " (previous entry partly written?)");
  if (t.scalar_type() != to_scalar_type(e.dtype) || t.sizes().vec() != e.shape)
    fail(path_, e.name, std::string("expected ") + dtype_name(e.dtype) + " " + shape_str(e.shape) + ", got " +
                            c10::toString(t.scalar_type()) + " " + shape_str(t.sizes().vec()));
  at::Tensor c = t.cpu().contiguous();
  write(c.data_ptr(), c.numel() * c.element_size());
  next_ = std::max(next_, i + 1);
}

void SafetensorsWriter::commit() {
  check_writable();
  if (pos_ != total_) {
    size_t i = std::upper_bound(ends_.begin(), ends_.end(), pos_) - ends_.begin();
    fail(path_, entries_[i].name, "commit with " + std::to_string(pos_) + " of " + std::to_string(total_) +
                            " data bytes written; this entry is incomplete");
  }
  try {
    flush_buffer();
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  // close() is where some filesystems (NFS) report a failed write-back.
  if (::close(std::exchange(fd_, -1)) != 0) fail(tmp_path_, "close failed: " + sys_error());
  commit_aside(tmp_path_, path_);  // on failure the destructor unlinks the .tmp
  committed_ = true;
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<const std::pair<std::string, at::Tensor>*> order;
  for (const auto& p : tensors) {
    if (!p.second.defined()) fail(path, p.first, "tensor is undefined");
    order.push_back(&p);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](auto* a, auto* b) { return a->second.element_size() > b->second.element_size(); });
  std::vector<EntrySpec> entries;
  for (auto* p : order) {
    try {
      entries.push_back({p->first, from_scalar_type(p->second.scalar_type()), p->second.sizes().vec()});
    } catch (const SafetensorsError& e) {
      fail(path, p->first, e.what());
    }
  }
  SafetensorsWriter writer(path, std::move(entries), metadata);
  for (auto* p : order) writer.write_tensor(p->second);
  writer.commit();
}

}  // namespace qlora::io
