// What a tokenized data set looks like: sizes, how much of it is trained, what truncation cut and
// how well it packs. `qlora data` prints it; the recipe checks it before training (a sample with
// no trained token trains on nothing, and a data set of only such samples trains with loss 0).
#pragma once

#include <cstdint>
#include <vector>

#include "qlora/data/dataset.h"

namespace qlora::data {

// Sample lengths in [lo, hi] (tokens, after truncation): `count` samples.
struct LengthBin {
  int64_t lo = 0, hi = 0, count = 0;
};

struct DatasetStats {
  int64_t samples = 0;
  int64_t tokens = 0;          // after truncation
  int64_t trained_tokens = 0;  // loss terms, as collate counts them (num_label_tokens)
  int64_t truncated = 0;       // samples longer than max_seq_len, cut to it
  // Samples without a trained token (e.g. truncation cut the whole answer): in file order.
  std::vector<int64_t> untrained;
  int64_t min_tokens = 0, max_tokens = 0;
  // With packing (pack_seq_len > 0): rows of pack_seq_len that pack_samples makes, and the share
  // of their positions that hold real tokens rather than padding.
  int64_t packed_rows = 0;
  double packing_efficiency = 0.0;
  std::vector<LengthBin> histogram;  // equal-width bins from min_tokens to max_tokens
};

// Targets of a sample after collate's shift: labels[1:] that are not kIgnoreIndex.
int64_t trained_token_count(const Sample& sample);

// pack_seq_len > 0: also the packing figures (rows of that length, as pack_samples packs them;
// every sample must fit, i.e. be truncated to it). histogram_bins >= 1.
// How many samples end with `token` as a trained token (e.g. the EOS closing each answer; where the
// tokenizer's pad token is its EOS, padding is never trained but this EOS must be).
int64_t samples_ending_trained(const std::vector<Sample>& samples, int64_t token);

DatasetStats dataset_stats(const std::vector<Sample>& samples, int64_t pack_seq_len = 0,
                           int64_t histogram_bins = 10);

}  // namespace qlora::data
