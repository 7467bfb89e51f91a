#include "qlora/checkpoint/fingerprint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "qlora/data/data_files.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/checkpoint/resume.h"
#include "qlora/checkpoint/xxh64.h"

namespace qlora::checkpoint {

namespace {

constexpr uint64_t kWindow = 4096;  // one page: a sampled window costs one small read

// Every field goes in length-prefixed, so that two different sequences of fields never feed the
// hash the same byte stream (a name ending where a header begins, say).
void add_field(Xxh64& h, std::string_view bytes) {
  const uint64_t n = bytes.size();
  h.update(&n, sizeof n);
  h.update(bytes.data(), bytes.size());
}

void add_u64(Xxh64& h, uint64_t v) { h.update(&v, sizeof v); }

std::string basename_of(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// A read-only descriptor that closes itself; every error names the file.
class ReadFile {
 public:
  explicit ReadFile(std::string path) : path_(std::move(path)), fd_(::open(path_.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0) throw std::runtime_error("cannot open " + path_ + ": " + std::strerror(errno));
  }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  ~ReadFile() { ::close(fd_); }

  std::string read_at(uint64_t offset, uint64_t n) const {
    std::string out(n, '\0');
    for (uint64_t done = 0; done < n;) {
      const ssize_t got = ::pread(fd_, out.data() + done, n - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw std::runtime_error("cannot read " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                                 " of " + path_ + ": " + (got < 0 ? std::strerror(errno) : "file is shorter"));
      done += static_cast<uint64_t>(got);
    }
    return out;
  }

 private:
  std::string path_;
  int fd_;
};

std::string read_whole(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  return ReadFile(path).read_at(0, static_cast<uint64_t>(st.st_size));
}

void add_weight_file(Xxh64& h, const io::SafetensorsFile& f) {
  const uint64_t size = f.file_size(), data0 = f.data_offset(), data_size = size - data0;
  const ReadFile file(f.path());
  add_field(h, basename_of(f.path()));
  add_u64(h, size);
  add_field(h, file.read_at(8, data0 - 8));  // the JSON header: names, dtypes, shapes, offsets

  // Window starts within the data section; each is min(kWindow, span) long.
  std::vector<std::pair<uint64_t, uint64_t>> windows;
  auto centered = [&](uint64_t begin, uint64_t span) {
    const uint64_t w = std::min(kWindow, span);
    windows.emplace_back(begin + (span - w) / 2, w);
  };
  const uint64_t w = std::min(kWindow, data_size);
  windows.emplace_back(0, w);
  centered(0, data_size);
  windows.emplace_back(data_size - w, w);
  for (const io::TensorInfo& t : f.tensors()) centered(t.begin, t.end - t.begin);
  for (const auto& [begin, len] : windows) {
    add_u64(h, begin);
    add_field(h, file.read_at(data0 + begin, len));
  }
}

}  // namespace

std::string fingerprint_file(const std::string& path) { return xxh64_hex(xxh64_file(path)); }

std::string fingerprint_data(const std::string& path) {
  const std::vector<std::string> files = data::expand_data_path(path);
  if (files.size() == 1) return fingerprint_file(files.front());
  Xxh64 h(0);
  for (const std::string& f : files) {
    add_field(h, basename_of(f));
    add_field(h, fingerprint_file(f));
  }
  return xxh64_hex(h.digest());
}

std::string fingerprint_checkpoint_dir(const std::string& dir) {
  const std::string sep = !dir.empty() && dir.back() == '/' ? "" : "/";
  const std::string config = dir + sep + "config.json";
  if (!is_regular_file(config)) throw std::runtime_error("checkpoint '" + dir + "': " + config + " is missing");
  const io::CheckpointDir ckpt = io::CheckpointDir::open(dir);  // its errors name the missing weight files

  Xxh64 h(0);
  add_field(h, read_whole(config));
  // An absent tokenizer.model hashes as an empty one, which no usable tokenizer is.
  const std::string tokenizer = dir + sep + "tokenizer.model";
  add_field(h, is_regular_file(tokenizer) ? read_whole(tokenizer) : std::string());
  for (const io::SafetensorsFile& f : ckpt.shards()) add_weight_file(h, f);
  return xxh64_hex(h.digest());
}

nlohmann::json input_fingerprints(const std::string& data_path, const std::string& base_dir,
                                  const std::string& tokenizer_path) {
  return {{"data_path", data_path},
          {"data_fingerprint", fingerprint_data(data_path)},
          {"base_dir", base_dir},
          {"base_fingerprint", fingerprint_checkpoint_dir(base_dir)},
          {"tokenizer_path", tokenizer_path},
          {"tokenizer_fingerprint", fingerprint_file(tokenizer_path)}};
}

std::optional<std::string> check_input_fingerprints(const nlohmann::json& saved_meta, const nlohmann::json& current,
                                                    const std::string& checkpoint) {
  struct Input {
    const char* what;
    const char* path_key;
    const char* fingerprint_key;
  };
  static constexpr Input kInputs[] = {{"data file", "data_path", "data_fingerprint"},
                                      {"base checkpoint", "base_dir", "base_fingerprint"},
                                      {"tokenizer", "tokenizer_path", "tokenizer_fingerprint"}};
  std::string changed, unrecorded;
  for (const Input& in : kInputs) {
    const auto saved = saved_meta.find(in.fingerprint_key);
    if (saved == saved_meta.end()) {
      unrecorded += std::string(unrecorded.empty() ? "" : " and ") + "the " + in.what;
      continue;
    }
    if (!saved->is_string())
      throw ResumeError("cannot resume " + checkpoint + ": its meta.json has a non-string " + in.fingerprint_key);
    const std::string now = current.at(in.fingerprint_key).get<std::string>();
    if (*saved == now) continue;
    const auto old_path = saved_meta.find(in.path_key);
    changed += std::string(changed.empty() ? "" : "; ") + "the " + in.what + " changed: " +
               (old_path != saved_meta.end() && old_path->is_string() ? old_path->get<std::string>() : "?") +
               " (fingerprint " + saved->get<std::string>() + ") -> " +
               current.at(in.path_key).get<std::string>() + " (fingerprint " + now + ")";
  }
  if (!changed.empty())
    throw ResumeError("cannot resume " + checkpoint + ": " + changed +
                      ". The steps already taken trained on the old content, so continuing would not be the "
                      "same run. Restore the original content (any path will do: inputs are matched by content), "
                      "or start a new output_dir to train on the new inputs from scratch");
  if (unrecorded.empty()) return std::nullopt;
  return checkpoint + " records no fingerprint of " + unrecorded +
         " (written before fingerprints were kept): resuming without checking that they are unchanged";
}

}  // namespace qlora::checkpoint
