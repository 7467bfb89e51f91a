// XXH64 (the published algorithm, seed 0 unless given; libxxhash computes it): the checksum of
// resume checkpoints and the hash behind input fingerprints. It runs at memory speed and catches
// torn, bit-rotten or edited files; it is not a defence against tampering (not cryptographic).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

struct XXH64_state_s;  // xxhash.h's, kept out of this header

namespace qlora::checkpoint {

// Streaming state: feeding a buffer in any number of pieces gives the digest of the whole.
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t nbytes);
  uint64_t digest() const;  // does not finish the state: more update() calls may follow

 private:
  struct Free {
    void operator()(XXH64_state_s* s) const;
  };
  std::unique_ptr<XXH64_state_s, Free> state_;
};

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed = 0);
// Streams the whole file (sequential reads, fixed memory); *nbytes gets its length. Throws
// std::runtime_error naming the file when it cannot be opened or read.
uint64_t xxh64_file(const std::string& path, uint64_t* nbytes = nullptr);
std::string xxh64_hex(uint64_t digest);  // 16 lowercase hex digits

}  // namespace qlora::checkpoint
