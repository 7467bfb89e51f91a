// Data set statistics (what `qlora data` prints and the recipe checks) and the validation split.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>

#include "qlora/data/batching.h"
#include "qlora/data/sampler.h"
#include "qlora/data/split.h"
#include "qlora/data/stats.h"

#include "fixtures.h"

namespace qlora::data {
namespace {

// n tokens, the first `prompt` masked.
Sample make_sample(size_t n, size_t prompt) {
  Sample s;
  for (size_t i = 0; i < n; ++i) {
    s.tokens.push_back(static_cast<int64_t>(10 + i));
    s.labels.push_back(i < prompt ? kIgnoreIndex : static_cast<int64_t>(10 + i));
  }
  return s;
}

TEST(DataStats, TrainedTokensAreCollatesLossTerms) {
  // Position 0's label is never a target after the shift, trained or not.
  EXPECT_EQ(trained_token_count(make_sample(5, 0)), 4);
  EXPECT_EQ(trained_token_count(make_sample(5, 2)), 3);
  EXPECT_EQ(trained_token_count(make_sample(5, 5)), 0);
  EXPECT_EQ(trained_token_count(make_sample(1, 0)), 0);
  const std::vector<Sample> samples = {make_sample(6, 2), make_sample(3, 1), make_sample(9, 9), make_sample(4, 0)};
  const auto st = dataset_stats(samples);
  EXPECT_EQ(st.trained_tokens, collate(samples, 0).num_label_tokens);
  EXPECT_EQ(st.samples, 4);
  EXPECT_EQ(st.tokens, 22);
  EXPECT_EQ(st.min_tokens, 3);
  EXPECT_EQ(st.max_tokens, 9);
  EXPECT_EQ(st.untrained, (std::vector<int64_t>{2}));
}

TEST(DataStats, SamplesEndingWithATrainedToken) {
  Sample ends = make_sample(4, 1), masked = make_sample(4, 4), other = make_sample(4, 1);
  ends.tokens.back() = ends.labels.back() = 2;     // a trained EOS closes it
  masked.tokens.back() = 2;                        // an EOS in a masked (prompt) part
  EXPECT_EQ(samples_ending_trained({ends, masked, other, ends}, 2), 2);
  EXPECT_EQ(samples_ending_trained({}, 2), 0);
}

TEST(DataStats, HistogramCoversEverySampleOnce) {
  std::vector<Sample> samples;
  for (size_t n : {3, 3, 4, 7, 12, 12, 12, 30}) samples.push_back(make_sample(n, 1));
  for (int64_t bins : {1, 3, 10, 28, 100}) {
    const auto st = dataset_stats(samples, 0, bins);
    ASSERT_FALSE(st.histogram.empty());
    EXPECT_LE(static_cast<int64_t>(st.histogram.size()), bins);
    EXPECT_EQ(st.histogram.front().lo, 3);
    EXPECT_GE(st.histogram.back().hi, 30);
    int64_t total = 0;
    for (size_t k = 0; k < st.histogram.size(); ++k) {
      const auto& b = st.histogram[k];
      total += b.count;
      if (k > 0) EXPECT_EQ(b.lo, st.histogram[k - 1].hi + 1);
      const auto in_bin = std::count_if(samples.begin(), samples.end(), [&](const Sample& s) {
        return static_cast<int64_t>(s.tokens.size()) >= b.lo && static_cast<int64_t>(s.tokens.size()) <= b.hi;
      });
      EXPECT_EQ(b.count, in_bin) << b.lo << "-" << b.hi;
    }
    EXPECT_EQ(total, 8) << bins;
  }
  EXPECT_TRUE(dataset_stats({}).histogram.empty());
  EXPECT_THROW(dataset_stats(samples, 0, 0), std::invalid_argument);
}

TEST(DataStats, PackingEfficiencyAsPackSamplesPacks) {
  const std::vector<Sample> samples = {make_sample(3, 1), make_sample(3, 1), make_sample(4, 1), make_sample(6, 1)};
  const auto st = dataset_stats(samples, 6);
  EXPECT_EQ(st.packed_rows, static_cast<int64_t>(pack_samples(samples, 6, 0).size()));
  EXPECT_EQ(st.packed_rows, 3);  // [3 3] [4] [6]
  EXPECT_DOUBLE_EQ(st.packing_efficiency, 16.0 / 18.0);
  EXPECT_EQ(dataset_stats(samples).packed_rows, 0);  // no packing asked
}

// Truncation is counted, and an answer it cuts away entirely leaves a sample with nothing to train.
TEST(DataStats, TruncatedAndUntrainedFromTheTokenizer) {
  const auto tok = test_fixtures::fixture_tokenizer();
  DatasetOptions o;
  const auto segs = render_instruct(TemplateKind::kAlpaca, {"Add the numbers.", "12 + 7", "19"});
  const auto full = tokenize_segments(segs, tok, o);
  EXPECT_FALSE(full.truncated);
  const auto prompt_len = static_cast<int64_t>(1 + tok.encode(segs[0].text).size());
  o.max_seq_len = prompt_len + 1;  // BOS + prompt + the (masked) EOS that ends a cut sample
  const auto cut = tokenize_segments(segs, tok, o);
  EXPECT_TRUE(cut.truncated);
  o.max_seq_len = static_cast<int64_t>(full.tokens.size());
  const auto fits = tokenize_segments(segs, tok, o);
  EXPECT_FALSE(fits.truncated);
  const auto st = dataset_stats({full, cut, fits});
  EXPECT_EQ(st.truncated, 1);
  EXPECT_EQ(st.untrained, (std::vector<int64_t>{1}));
  EXPECT_EQ(trained_token_count(full), static_cast<int64_t>(full.tokens.size()) - prompt_len);
}

TEST(DataSplit, SeededDisjointAndCoveringForAnyRankCount) {
  const auto a = split_validation(1000, 0.1, 42);
  EXPECT_EQ(a.val.size(), 100u);
  EXPECT_EQ(a.train.size(), 900u);
  EXPECT_TRUE(std::is_sorted(a.val.begin(), a.val.end()));
  EXPECT_TRUE(std::is_sorted(a.train.begin(), a.train.end()));
  std::vector<int64_t> all(a.train);
  all.insert(all.end(), a.val.begin(), a.val.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> want(1000);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(all, want);
  // Drawn from the whole file (a block of it, first or last, would span 99).
  EXPECT_GT(a.val.back() - a.val.front(), 800);
  // Same inputs, same split; another seed, another split.
  EXPECT_EQ(split_validation(1000, 0.1, 42).val, a.val);
  EXPECT_NE(split_validation(1000, 0.1, 43).val, a.val);
  // Not the sampler's epoch-0 order (its own stream).
  const auto order = Sampler(SamplerOptions{.dataset_size = 1000, .batch_size = 1, .seed = 42}).epoch_order(0);
  std::vector<int64_t> head(order.begin(), order.begin() + 100);
  std::sort(head.begin(), head.end());
  EXPECT_NE(head, a.val);
}

TEST(DataSplit, SizesAndErrors) {
  EXPECT_EQ(split_validation(10, 0.0, 1).train.size(), 10u);
  EXPECT_TRUE(split_validation(10, 0.0, 1).val.empty());
  EXPECT_EQ(split_validation(10, 0.01, 1).val.size(), 1u);   // at least one
  EXPECT_EQ(split_validation(10, 0.99, 1).val.size(), 9u);   // at least one left to train
  EXPECT_EQ(split_validation(10, 0.25, 1).val.size(), 3u);   // round(2.5) away from zero
  EXPECT_THROW(split_validation(10, 1.0, 1), std::invalid_argument);
  EXPECT_THROW(split_validation(10, -0.1, 1), std::invalid_argument);
  EXPECT_THROW(split_validation(1, 0.5, 1), std::invalid_argument);
}

}  // namespace
}  // namespace qlora::data
