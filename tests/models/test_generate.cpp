// Tests for models/generate: the KV-cache decode loop against a no-cache recomputation, top-p
// edge cases, seeded reproducibility and stop ids, on tests/data/tiny_llama.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <set>

#include "qlora/models/generate.h"
#include "qlora/models/decoder.h"

using namespace qlora::models;

namespace {

std::string tiny_llama() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/tiny_llama";
}

const DecoderModel& model() {
  static const DecoderModel m = load_decoder(tiny_llama(), DecoderLoadOptions{});
  return m;
}

const std::vector<int64_t> kPrompt = {1, 17, 200, 3, 45};

// Greedy decoding the slow way: the whole sequence through forward() (no cache) at every step.
std::vector<int64_t> greedy_reference(const DecoderModel& m, std::vector<int64_t> seq, int64_t n) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor logits = m.forward(at::tensor(seq, at::kLong).view({1, -1}));  // [1, s, V]
    const int64_t next = logits[0][-1].argmax().item<int64_t>();
    out.push_back(next);
    seq.push_back(next);
  }
  return out;
}

}  // namespace

TEST(Generate, GreedyMatchesNoCacheRecomputation) {
  GenerateOptions o;
  o.max_new_tokens = 24;
  const std::vector<int64_t> got = generate(model(), kPrompt, o);
  ASSERT_EQ(got.size(), 24u);
  // A constant continuation would make the comparison (and the stop test below) vacuous.
  EXPECT_GT(std::set<int64_t>(got.begin(), got.end()).size(), 3u);
  EXPECT_EQ(got, greedy_reference(model(), kPrompt, 24));
}

TEST(Generate, GreedyIgnoresTrainingModeAndNf4BaseStillDecodes) {
  DecoderModel m = model();
  m.training = true;  // generate must switch dropout off on its own
  GenerateOptions o;
  o.max_new_tokens = 8;
  EXPECT_EQ(generate(m, kPrompt, o), generate(model(), kPrompt, o));

  DecoderLoadOptions lo;
  lo.base_in_nf4 = true;
  const DecoderModel q = load_decoder(tiny_llama(), lo);
  EXPECT_EQ(generate(q, kPrompt, o), greedy_reference(q, kPrompt, 8));
}

TEST(Generate, TinyTopPIsGreedy) {
  GenerateOptions greedy;
  greedy.max_new_tokens = 16;
  GenerateOptions nucleus = greedy;
  nucleus.temperature = 1.0;
  nucleus.top_p = 1e-9;  // only the most likely token survives the cut
  nucleus.seed = 1234;
  EXPECT_EQ(generate(model(), kPrompt, nucleus), generate(model(), kPrompt, greedy));
}

TEST(Generate, SameSeedSameSampleOtherSeedDiffers) {
  GenerateOptions o;
  o.max_new_tokens = 32;
  o.temperature = 1.5;  // flatten the distribution so draws clearly depend on the seed
  o.top_p = 0.95;
  o.seed = 7;
  const auto a = generate(model(), kPrompt, o);
  EXPECT_EQ(a, generate(model(), kPrompt, o));
  o.seed = 8;
  EXPECT_NE(a, generate(model(), kPrompt, o));
  EXPECT_NE(a, greedy_reference(model(), kPrompt, 32));
}

TEST(Generate, StopsAtStopIdAndKeepsIt) {
  GenerateOptions o;
  o.max_new_tokens = 24;
  const auto full = generate(model(), kPrompt, o);
  const int64_t stop = full[5];
  const size_t first = std::find(full.begin(), full.end(), stop) - full.begin();  // <= 5
  o.stop_ids = {999999, stop};  // ids that never occur are harmless
  const auto got = generate(model(), kPrompt, o);
  ASSERT_EQ(got.size(), first + 1);
  EXPECT_EQ(got.back(), stop);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), full.begin()));
}

TEST(Generate, StopsAtContextLimitAndRejectsBadInput) {
  GenerateOptions o;
  o.max_new_tokens = 1000;
  const int64_t max_pos = model().config.max_position_embeddings;  // 256 for tiny_llama
  std::vector<int64_t> prompt(max_pos - 3, 5);
  EXPECT_EQ(generate(model(), prompt, o).size(), 3u);
  EXPECT_THROW(generate(model(), {}, o), std::invalid_argument);
  EXPECT_THROW(generate(model(), {1, 256}, o), std::invalid_argument);  // vocab is 256
  o.top_p = 0.0;
  EXPECT_THROW(generate(model(), kPrompt, o), std::invalid_argument);
  o.top_p = 1.0;
  o.max_new_tokens = 0;
  EXPECT_TRUE(generate(model(), kPrompt, o).empty());
}

TEST(SampleNextToken, NucleusKeepsOnlyTheTopMass) {
  // probs 0.6, 0.3, 0.1 (log-space logits): top_p 0.7 keeps {0, 1}; top_p 0.5 keeps {0}.
  const at::Tensor logits = at::tensor({0.6f, 0.3f, 0.1f}).log();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::set<int64_t> seen;
  for (int i = 0; i < 400; ++i) seen.insert(sample_next_token(logits, 1.0, 0.7, 0, gen));
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1}));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_next_token(logits, 1.0, 0.5, 0, gen), 0);
  seen.clear();
  for (int i = 0; i < 400; ++i) seen.insert(sample_next_token(logits, 1.0, 1.0, 0, gen));
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1, 2}));
  // Greedy picks the first of tied maxima, as argmax does.
  EXPECT_EQ(sample_next_token(at::tensor({1.0f, 3.0f, 3.0f}), 0.0, 1.0, 0, gen), 1);
}

// The draws follow the distribution: 40000 draws from probs 0.1, 0.2, 0.3, 0.4 (every token
// kept: the unsorted path), then with top_k 3 (the sorted path: 0.2, 0.3, 0.4 renormalized), at
// temperature 2 (probs as the softmax of logits / 2). Each count within 5 standard deviations of
// its expectation; a zero-probability token is never drawn; NaN logits are refused.
TEST(SampleNextToken, DrawsFollowTheDistribution) {
  const at::Tensor logits = at::tensor({0.1f, 0.2f, 0.3f, 0.4f, 0.0f}).log();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto check = [&](double temperature, int64_t top_k, std::vector<double> want) {
    const int n = 40000;
    std::vector<int> count(5, 0);
    for (int i = 0; i < n; ++i) ++count[static_cast<size_t>(sample_next_token(logits, temperature, 1.0, top_k, gen))];
    for (size_t t = 0; t < 5; ++t) {
      const double sd = std::sqrt(n * want[t] * (1 - want[t]));
      EXPECT_LE(std::abs(count[t] - n * want[t]), 5 * sd + 1e-9)
          << "token " << t << " temperature " << temperature << " top_k " << top_k << ": " << count[t] << " of " << n;
    }
  };
  check(1.0, 0, {0.1, 0.2, 0.3, 0.4, 0.0});
  check(1.0, 3, {0.0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9, 0.0});
  std::vector<double> t2{std::sqrt(0.1), std::sqrt(0.2), std::sqrt(0.3), std::sqrt(0.4), 0.0};
  const double z = t2[0] + t2[1] + t2[2] + t2[3];
  for (double& v : t2) v /= z;
  check(2.0, 0, t2);
  EXPECT_THROW(sample_next_token(at::tensor({0.0f, NAN}), 1.0, 1.0, 0, gen), std::invalid_argument);
}

TEST(SampleNextToken, TopKKeepsOnlyTheKMostLikelyBeforeTopP) {
  // probs 0.5, 0.3, 0.2: top_k 2 keeps {0, 1}; top_k 1 is greedy; top_k 2 then top_p 0.6 keeps
  // {0} (0.5 / 0.8 = 0.625 of the kept mass already reaches 0.6, though 0.5 alone would not).
  const at::Tensor logits = at::tensor({0.5f, 0.3f, 0.2f}).log();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::set<int64_t> seen;
  for (int i = 0; i < 400; ++i) seen.insert(sample_next_token(logits, 1.0, 1.0, 2, gen));
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1}));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_next_token(logits, 1.0, 1.0, 1, gen), 0);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_next_token(logits, 1.0, 0.6, 2, gen), 0);
  seen.clear();
  for (int i = 0; i < 400; ++i) seen.insert(sample_next_token(logits, 1.0, 1.0, 3, gen));  // k = vocab: all
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1, 2}));
  EXPECT_THROW(sample_next_token(logits, 1.0, 1.0, -1, gen), std::invalid_argument);
}

namespace {

// GRPO's shape: 3 prompts of different lengths x 2 completions, greedy and sampled ones mixed
// (temperature, top-k, top-p), each seeded from (run seed, global index) as a rank would.
const std::vector<std::vector<int64_t>> kPrompts = {{1, 17, 200, 3, 45}, {9, 8, 7}, {4, 5, 6, 7, 8, 9, 10, 11, 12}};

std::vector<BatchSequence> rollout_sequences(int64_t max_new) {
  std::vector<BatchSequence> seqs;
  for (int64_t i = 0; i < 6; ++i) {
    BatchSequence s;
    s.prompt = i / 2;
    s.options.max_new_tokens = max_new;
    if (i % 2 == 1 || i == 4) {  // the rest greedy
      s.options.temperature = 1.3;
      s.options.top_p = 0.9;
      s.options.top_k = i == 4 ? 20 : 0;
    }
    s.options.seed = sequence_seed(42, i);
    seqs.push_back(s);
  }
  return seqs;
}

}  // namespace

TEST(GenerateBatch, EachSequenceEqualsItAloneAndSplitsAnyWay) {
  const std::vector<BatchSequence> seqs = rollout_sequences(12);
  const std::vector<Completion> all = generate_batch(model(), kPrompts, seqs);
  ASSERT_EQ(all.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(all[i].ids, generate(model(), kPrompts[static_cast<size_t>(seqs[i].prompt)], seqs[i].options));
    EXPECT_EQ(all[i].ids.size(), 12u);
    EXPECT_FALSE(all[i].stopped);
  }
  // The sampled completions of one prompt differ from its greedy one (the draws are not vacuous).
  EXPECT_NE(all[0].ids, all[1].ids);
  // Two "ranks", each with its share of the sequences (rank 1 also in another order).
  const std::vector<BatchSequence> first(seqs.begin(), seqs.begin() + 3);
  const std::vector<BatchSequence> second = {seqs[5], seqs[3], seqs[4]};
  const std::vector<Completion> a = generate_batch(model(), kPrompts, first);
  const std::vector<Completion> b = generate_batch(model(), kPrompts, second);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a[i].ids, all[i].ids) << i;
  EXPECT_EQ(b[0].ids, all[5].ids);
  EXPECT_EQ(b[1].ids, all[3].ids);
  EXPECT_EQ(b[2].ids, all[4].ids);
}

TEST(GenerateBatch, FinishedSequencesLeaveWithoutChangingTheOthers) {
  std::vector<BatchSequence> seqs = rollout_sequences(12);
  const std::vector<Completion> free_run = generate_batch(model(), kPrompts, seqs);
  // Sequence 2 (prompt 1, greedy) stops at its 4th token; sequence 4 ends after 3 tokens;
  // sequence 5 has nothing to generate.
  seqs[2].options.stop_ids = {free_run[2].ids[3]};
  seqs[4].options.max_new_tokens = 3;
  seqs[5].options.max_new_tokens = 0;
  const std::vector<Completion> got = generate_batch(model(), kPrompts, seqs);
  const auto first = std::find(free_run[2].ids.begin(), free_run[2].ids.end(), free_run[2].ids[3]);
  EXPECT_EQ(got[2].ids, std::vector<int64_t>(free_run[2].ids.begin(), first + 1));
  EXPECT_TRUE(got[2].stopped);
  EXPECT_EQ(got[4].ids, std::vector<int64_t>(free_run[4].ids.begin(), free_run[4].ids.begin() + 3));
  EXPECT_FALSE(got[4].stopped);
  EXPECT_TRUE(got[5].ids.empty());
  for (const size_t i : {0u, 1u, 3u}) EXPECT_EQ(got[i].ids, free_run[i].ids) << i;
}

TEST(GenerateBatch, RejectsBadSequencesAndSeedsDependOnBothParts) {
  std::vector<BatchSequence> seqs = rollout_sequences(4);
  seqs[3].prompt = 3;
  EXPECT_THROW(generate_batch(model(), kPrompts, seqs), std::invalid_argument);
  seqs[3].prompt = 1;
  seqs[3].options.top_k = -1;
  EXPECT_THROW(generate_batch(model(), kPrompts, seqs), std::invalid_argument);
  EXPECT_TRUE(generate_batch(model(), kPrompts, {}).empty());
  EXPECT_NE(sequence_seed(1, 0), sequence_seed(0, 1));
  EXPECT_NE(sequence_seed(0, 0), sequence_seed(0, 1));
  EXPECT_EQ(sequence_seed(3, 7), sequence_seed(3, 7));
}
