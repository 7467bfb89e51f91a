#include "qlora/checkpoint/xxh64.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace qlora::checkpoint {

namespace {

constexpr uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL, P3 = 1609587929392839161ULL,
                   P4 = 9650029242287828579ULL, P5 = 2870177450012600261ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // x86/arm64 little-endian hosts only, as the rest of the safetensors code assumes
}
inline uint32_t read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t round64(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
inline uint64_t merge64(uint64_t h, uint64_t v) { return (h ^ round64(0, v)) * P1 + P4; }

}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed), v_{seed + P1 + P2, seed + P2, seed, seed - P1} {}

void Xxh64::update(const void* data, size_t n) {
  auto p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buffered_ > 0) {
    const size_t take = std::min(n, 32 - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take, p += take, n -= take;
    if (buffered_ < 32) return;
    stripe(buf_);
    buffered_ = 0;
  }
  for (; n >= 32; p += 32, n -= 32) stripe(p);
  std::memcpy(buf_, p, n);
  buffered_ = n;
}

void Xxh64::stripe(const uint8_t* p) {
  for (int i = 0; i < 4; ++i) v_[i] = round64(v_[i], read64(p + 8 * i));
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (uint64_t v : v_) h = merge64(h, v);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const uint8_t* p = buf_;
  size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ round64(0, read64(p)), 27) * P1 + P4;
  if (n >= 4) {
    h = rotl(h ^ (uint64_t{read32(p)} * P1), 23) * P2 + P3;
    p += 4, n -= 4;
  }
  for (; n > 0; ++p, --n) h = rotl(h ^ (uint64_t{*p} * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed) {
  Xxh64 h(seed);
  h.update(data, nbytes);
  return h.digest();
}

uint64_t xxh64_file(const std::string& path, uint64_t* nbytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  // Sequential hint: the kernel reads ahead further, so a multi-GB file hashes at disk speed.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  // Fixed memory whatever the file size; 1 MiB keeps syscalls few.
  std::vector<uint8_t> buf(1 << 20);
  Xxh64 h(0);
  uint64_t total = 0;
  for (;;) {
    const ssize_t got = ::read(fd, buf.data(), buf.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error("read error in " + path + ": " + std::strerror(err));
    }
    if (got == 0) break;
    h.update(buf.data(), static_cast<size_t>(got));
    total += static_cast<uint64_t>(got);
  }
  ::close(fd);
  if (nbytes) *nbytes = total;
  return h.digest();
}

std::string xxh64_hex(uint64_t digest) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(digest));
  return s;
}

}  // namespace qlora::checkpoint
