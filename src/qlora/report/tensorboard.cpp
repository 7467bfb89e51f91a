#include "qlora/report/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "qlora/io/read_file.h"
#include "qlora/io/durable_file.h"

namespace qlora::report {
namespace fs = std::filesystem;
namespace {

constexpr const char* kPrefix = "events.out.tfevents.";

uint32_t masked_crc(const std::string& s) {
  const uint32_t c = crc32c(s.data(), s.size());
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// ---- protobuf encoding of the few fields an Event needs

void varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7f) | 0x80);
  out += static_cast<char>(v);
}

template <class T>
void fixed(std::string& out, T v) {  // little-endian, as x86 and protobuf both are
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

void bytes_field(std::string& out, int field, const std::string& payload) {
  varint(out, static_cast<uint64_t>(field) << 3 | 2);
  varint(out, payload.size());
  out += payload;
}

std::string event_head(double wall_time, int64_t step) {
  std::string e;
  varint(e, 1 << 3 | 1);
  fixed(e, wall_time);
  varint(e, 2 << 3 | 0);
  varint(e, static_cast<uint64_t>(step));
  return e;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// ---- reading back our own files, to drop steps past a resume point

// The step of an encoded Event (0 when it has none, as the file_version event).
int64_t event_step(const std::string& e) {
  size_t at = 0;
  auto read_varint = [&](uint64_t& v) {
    v = 0;
    for (int shift = 0; at < e.size() && shift < 64; shift += 7) {
      const auto byte = static_cast<uint8_t>(e[at++]);
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return true;
    }
    return false;
  };
  uint64_t key = 0, v = 0;
  while (at < e.size() && read_varint(key)) {
    const int wire = static_cast<int>(key & 7);
    if (wire == 0) {
      if (!read_varint(v)) break;
      if (key >> 3 == 2) return static_cast<int64_t>(v);
    } else if (wire == 1) at += 8;
    else if (wire == 5) at += 4;
    else if (wire == 2 && read_varint(v)) at += v;
    else break;
  }
  return 0;
}

// The framed records of `bytes` whose event is at most `resume_step`; stops at a torn or corrupt record.
std::string records_up_to(const std::string& bytes, int64_t resume_step) {
  std::string kept;
  for (size_t at = 0; at + 12 <= bytes.size();) {
    uint64_t n = 0;
    std::memcpy(&n, bytes.data() + at, 8);
    if (n > bytes.size() - at - 16) break;
    const std::string len(bytes.data() + at, 8), data(bytes.data() + at + 12, n);
    uint32_t len_crc = 0, data_crc = 0;
    std::memcpy(&len_crc, bytes.data() + at + 8, 4);
    std::memcpy(&data_crc, bytes.data() + at + 12 + n, 4);
    if (len_crc != masked_crc(len) || data_crc != masked_crc(data)) break;
    if (event_step(data) <= resume_step) kept.append(bytes, at, 16 + n);
    at += 16 + n;
  }
  return kept;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

TensorBoardLog::TensorBoardLog(const std::string& dir, int64_t resume_step) {
  fs::create_directories(dir);
  int64_t stamp = static_cast<int64_t>(now_s());
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kPrefix, 0) != 0 || !entry.is_regular_file()) continue;
    // TensorBoard reads a directory's files in name order and takes a step going back for a
    // restart (it drops what follows): the new file's name sorts after every earlier one.
    const std::string time = name.substr(std::strlen(kPrefix), name.find('.', std::strlen(kPrefix)) - std::strlen(kPrefix));
    if (!time.empty() && time.size() < 19 && time.find_first_not_of("0123456789") == std::string::npos)
      stamp = std::max<int64_t>(stamp, std::stoll(time) + 1);
    const auto bytes = io::read_file(entry.path().string(), io::kNoSizeBound);
    const std::string kept = resume_step > 0 && bytes ? records_up_to(*bytes, resume_step) : "";
    if (kept.empty()) fs::remove(entry.path());
    else if (kept.size() != bytes->size()) io::write_file_atomic(entry.path().string(), kept);
  }
  char host[256] = "host";
  ::gethostname(host, sizeof host - 1);
  path_ = dir + "/" + kPrefix + std::to_string(stamp) + "." + host + "." +
          std::to_string(::getpid()) + ".qlora";
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw std::runtime_error("cannot open " + path_ + " for writing (logging.tensorboard)");
  std::string first = event_head(now_s(), 0);
  bytes_field(first, 3, "brain.Event:2");
  write_event(first);
}

TensorBoardLog::~TensorBoardLog() {
  if (file_) std::fclose(file_);
}

void TensorBoardLog::write_event(const std::string& event) {
  std::string len;
  fixed(len, static_cast<uint64_t>(event.size()));
  std::string rec = len;
  fixed(rec, masked_crc(len));
  rec += event;
  fixed(rec, masked_crc(event));
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0)
    throw std::runtime_error("cannot write " + path_);
}

void TensorBoardLog::add_row(const nlohmann::json& row) {
  std::string summary;
  for (const auto& [key, v] : row.items()) {
    if (key == "step" || key == "epoch" || !v.is_number() || !std::isfinite(v.get<double>())) continue;
    std::string value;
    bytes_field(value, 1, key);
    varint(value, 2 << 3 | 5);
    fixed(value, static_cast<float>(v.get<double>()));
    bytes_field(summary, 1, value);
  }
  if (summary.empty()) return;
  std::string e = event_head(now_s(), row.at("step").get<int64_t>());
  bytes_field(e, 5, summary);
  write_event(e);
}

}  // namespace qlora::report
