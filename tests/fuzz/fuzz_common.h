// What the fuzz targets share: the parsers under test read user files by path, so each input is
// written to one scratch file per process first. A parser may refuse any input by throwing (that
// is its job: a clear error naming the file); a crash, a sanitizer report, a hang or an escaped
// non-std exception is a bug.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace qlora::fuzz {

// The input as a file named `name` in a per-process scratch directory; returns its path.
inline std::string input_file(const uint8_t* data, size_t size, const std::string& name) {
  static const std::string dir = [] {
    std::string d = "/tmp/qlora_fuzz_" + std::to_string(::getpid());
    ::mkdir(d.c_str(), 0700);
    return d;
  }();
  const std::string path = dir + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("fuzz: cannot write " + path);
  if (size > 0) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return path;
}

}  // namespace qlora::fuzz
