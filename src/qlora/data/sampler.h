// Deterministic, resumable, rank-sharded batch sampler.
//
// The order depends only on (seed, epoch): a splitmix64 stream drives a Fisher-Yates shuffle,
// so it never depends on ATen's generator, the thread count or the platform. The permutation is
// cut into global batches of batch_size; rank r takes global batches r, r + W, r + 2W, ...
// (strided, so every rank sees the whole epoch's spread of data). Together the ranks' p-th batches
// are the permutation's W x batch_size indices from p x W x batch_size on, rank r's the r-th
// batch_size of them: the rows one process draws with batch_size x W, split between the ranks (how
// every recipe gives each rank its rows of a step). With drop_last the number of
// global batches is rounded down to a multiple of W and the partial tail batch is dropped, so all
// ranks run the same number of steps. Without drop_last every index is used exactly once, the
// last batch may be short and ranks may get one batch more than others: use drop_last for W > 1.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qlora::data {

struct SamplerOptions {
  int64_t dataset_size = 0;
  int64_t batch_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;
  int64_t world_size = 1;
  int64_t rank = 0;
};

// Where iteration stands: `position` batches of `epoch` have been handed out on this rank.
struct SamplerState {
  int64_t epoch = 0;
  int64_t position = 0;
  bool operator==(const SamplerState& o) const { return epoch == o.epoch && position == o.position; }
};

class Sampler {
 public:
  // Throws std::invalid_argument on sizes <= 0 or rank outside [0, world_size).
  explicit Sampler(SamplerOptions options);

  // The next batch of dataset indices for this rank; at the end of an epoch it moves on to the
  // next epoch and returns its first batch (never empty unless the epoch has no batches).
  std::vector<int64_t> next();
  // Batches this rank gets per epoch.
  int64_t batches_per_epoch() const;
  // The full permutation of an epoch (identity when shuffle is off).
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  // Batch `b` of this rank in `epoch`.
  std::vector<int64_t> batch(int64_t epoch, int64_t b) const;

  SamplerState state() const { return state_; }
  void set_state(const SamplerState& state);

  // Small JSON with the state and the options it belongs to; loading checks the options match
  // (resuming with another seed or dataset size would silently change the order) and names the
  // file and key when not. The state is the same on every rank (with drop_last), so any rank's, of
  // a run on any number of ranks with the same batch_size x world_size, continues the same order.
  std::string state_json() const;
  void load_state_json(const std::string& text, const std::string& origin = "<sampler state>");
  void save_state(const std::string& path) const;
  void load_state(const std::string& path);

  const SamplerOptions& options() const { return options_; }

 private:
  int64_t global_batches() const;
  SamplerOptions options_;
  SamplerState state_;
  // Cache of epoch_order(cached_epoch_) so next() does not reshuffle per batch.
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

// splitmix64 (Steele, Lea, Flood 2014): tiny, fully specified, good enough for shuffling.
uint64_t splitmix64_next(uint64_t& state);

}  // namespace qlora::data
