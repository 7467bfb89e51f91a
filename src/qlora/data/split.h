// The validation split of a data set held out by data.val_fraction.
#pragma once

#include <cstdint>
#include <vector>

namespace qlora::data {

struct SplitIndices {
  std::vector<int64_t> train, val;  // ascending (file order); together 0..n-1 once each
};

// Holds out round(fraction * n) of n samples (at least 1 and at most n - 1 when fraction > 0) for
// validation, drawn by a seeded shuffle (the sampler's splitmix64 Fisher-Yates, on a stream of its
// own so that it is not the training order of epoch 0). The split depends on (n, fraction, seed)
// only: every rank, and every number of ranks, computes the same one. fraction 0: no validation.
// Throws std::invalid_argument for a fraction outside [0, 1) or fewer than 2 samples to split.
SplitIndices split_validation(int64_t n, double fraction, uint64_t seed);

}  // namespace qlora::data
