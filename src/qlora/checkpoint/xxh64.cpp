#include "qlora/checkpoint/xxh64.h"

#include <fcntl.h>
#include <unistd.h>

#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

namespace qlora::checkpoint {

void Xxh64::Free::operator()(XXH64_state_s* s) const { XXH64_freeState(s); }

Xxh64::Xxh64(uint64_t seed) : state_(XXH64_createState()) {
  if (!state_) throw std::bad_alloc();
  XXH64_reset(state_.get(), seed);
}

void Xxh64::update(const void* data, size_t nbytes) {
  if (nbytes > 0) XXH64_update(state_.get(), data, nbytes);  // fails only on a null buffer
}

uint64_t Xxh64::digest() const { return XXH64_digest(state_.get()); }

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed) { return XXH64(data, nbytes, seed); }

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
