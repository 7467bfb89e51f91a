#include "qlora/data/split.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "qlora/data/sampler.h"

namespace qlora::data {
namespace {
// Mixed into the seed so the held-out draw is not the permutation the sampler uses for epoch 0.
constexpr uint64_t kSplitStream = 0x76616c5f73706c74ULL;  // "val_splt"
}  // namespace

SplitIndices split_validation(int64_t n, double fraction, uint64_t seed) {
  if (!(fraction >= 0.0 && fraction < 1.0))
    throw std::invalid_argument("validation fraction " + std::to_string(fraction) + " is outside [0, 1)");
  SplitIndices out;
  if (fraction == 0.0) {
    for (int64_t i = 0; i < n; ++i) out.train.push_back(i);
    return out;
  }
  if (n < 2)
    throw std::invalid_argument("cannot hold out a validation fraction of " + std::to_string(n) +
                                " sample(s): at least 2 are needed (one to train, one to validate)");
  const auto val = std::clamp<int64_t>(std::llround(fraction * static_cast<double>(n)), 1, n - 1);
  const auto order = Sampler(SamplerOptions{.dataset_size = n, .batch_size = 1, .seed = seed ^ kSplitStream}).epoch_order(0);
  out.val.assign(order.begin(), order.begin() + val);
  out.train.assign(order.begin() + val, order.end());
  std::sort(out.val.begin(), out.val.end());
  std::sort(out.train.begin(), out.train.end());
  return out;
}

}  // namespace qlora::data
