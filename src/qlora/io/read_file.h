// Reading a whole (small) file: configs, manifests, data sets, tokenizer files. Every concern
// throws its own error naming the file when it cannot be opened, so this only reports whether it
// could; what no concern can make sense of (a pipe, a device, a file larger than the bound) is
// refused here, naming the file.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <fstream>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace qlora::io {

// A model directory is someone else's file: its config.json or tokenizer.json may be a FIFO (open
// blocks), /dev/zero (never ends) or many GB (taking the machine's memory once parsed: nlohmann::json
// holds a small-valued array in ~10x its text). The bound is far above any real one: the largest
// tokenizer.json files on the Hub are tens of MB (Gemma 3's 33 MB), configs and templates a few KB.
inline constexpr uint64_t kMaxModelFileBytes = uint64_t{256} << 20;
// Data sets and the run's own files (metrics, events) are bounded by their regularity only.
inline constexpr uint64_t kNoSizeBound = UINT64_MAX;

// Throws std::invalid_argument naming `path` unless it is (a link to) a regular file of at most
// `max_bytes`; returns false when it does not exist or cannot be looked at (errno tells why).
inline bool check_file_to_read(const std::string& path, uint64_t max_bytes = kMaxModelFileBytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  if (!S_ISREG(st.st_mode))
    throw std::invalid_argument(path + ": not a regular file (a directory, pipe or device cannot be read as one)");
  if (static_cast<uint64_t>(st.st_size) > max_bytes)
    throw std::invalid_argument(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                                std::to_string(max_bytes >> 20) + " MiB such a file may have");
  return true;
}

// The file's bytes, or nullopt when it cannot be opened or read (errno tells why); what
// check_file_to_read refuses throws.
inline std::optional<std::string> read_file(const std::string& path, uint64_t max_bytes = kMaxModelFileBytes) {
  if (!check_file_to_read(path, max_bytes)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return std::nullopt;
  std::string out = ss.str();
  if (out.size() > max_bytes)  // grew while read
    throw std::invalid_argument(path + ": more than the " + std::to_string(max_bytes >> 20) + " MiB such a file may have");
  return out;
}

// Runs `load`, the reading of `path`, so that every error names the file: one that does not (a
// library's own message, such as a JSON type error or std::bad_alloc) is rethrown as
// std::invalid_argument "path: message". Loaders of users' and model directories' files wrap
// their whole reading in it.
template <class Load>
auto naming_file(const std::string& path, Load&& load) -> decltype(std::forward<Load>(load)()) {
  try {
    return std::forward<Load>(load)();
  } catch (const std::bad_alloc&) {
    throw std::invalid_argument(path + ": asks for more memory than this machine has");
  } catch (const std::exception& e) {
    if (std::string_view(e.what()).find(path) != std::string_view::npos) throw;
    throw std::invalid_argument(path + ": " + e.what());
  }
}

}  // namespace qlora::io
