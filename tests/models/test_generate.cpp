// Tests for models/generate: the KV-cache decode loop against a no-cache recomputation, top-p
// edge cases, seeded reproducibility and stop ids, on tests/data/tiny_llama.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>

#include "qlora/models/generate.h"
#include "qlora/models/llama.h"

using namespace qlora::models;

namespace {

std::string tiny_llama() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/tiny_llama";
}

const LlamaModel& model() {
  static const LlamaModel m = load_llama(tiny_llama(), LlamaLoadOptions{});
  return m;
}

const std::vector<int64_t> kPrompt = {1, 17, 200, 3, 45};

// Greedy decoding the slow way: the whole sequence through forward() (no cache) at every step.
std::vector<int64_t> greedy_reference(const LlamaModel& m, std::vector<int64_t> seq, int64_t n) {
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
  LlamaModel m = model();
  m.training = true;  // generate must switch dropout off on its own
  GenerateOptions o;
  o.max_new_tokens = 8;
  EXPECT_EQ(generate(m, kPrompt, o), generate(model(), kPrompt, o));

  LlamaLoadOptions lo;
  lo.base_in_nf4 = true;
  const LlamaModel q = load_llama(tiny_llama(), lo);
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
  for (int i = 0; i < 400; ++i) seen.insert(sample_next_token(logits, 1.0, 0.7, gen));
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1}));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_next_token(logits, 1.0, 0.5, gen), 0);
  seen.clear();
  for (int i = 0; i < 400; ++i) seen.insert(sample_next_token(logits, 1.0, 1.0, gen));
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1, 2}));
  // Greedy picks the first of tied maxima, as argmax does.
  EXPECT_EQ(sample_next_token(at::tensor({1.0f, 3.0f, 3.0f}), 0.0, 1.0, gen), 1);
}
