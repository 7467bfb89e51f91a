// GRPO's completions through the model (train/grpo_batch.h): per-token log-probs in the completion
// frame equal log_softmax of the whole logits of each row alone, chunked or not; the reference has
// the adapters off, the old policy no graph; the gradient equals the whole-logits one; TRL's
// truncation rule. On the tiny Llama ctest points QLORA_TEST_DATA at, fp32, adapters moved off zero.
#include "qlora/train/grpo_batch.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/modules/lora_linear.h"
#include "tests/tools/adapted_model.h"

using namespace qlora::train;

namespace {

// fp32 forward of 2 layers, the same sums in another order (chunked log-sum-exp vs log_softmax).
constexpr double kLogpTol = 2e-5;
// Gradients: the same, through backward; relative to the largest entry.
constexpr double kGradRtol = 1e-4;

std::string tiny_llama() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/tiny_llama";
}

// Unequal prompt and completion lengths, so the rows are padded and the frames differ.
std::vector<Completion> completions() {
  return {{{5, 17, 200}, {3, 45, 99, 2}, false}, {{7}, {8, 9}, true}, {{10, 11, 12, 13, 14}, {15}, false}};
}

// [B, C]: each row alone through forward(), log_softmax of its logits at its completion's tokens.
at::Tensor whole_logits_logps(const qlora::models::DecoderModel& m, const std::vector<Completion>& cs, int64_t width) {
  std::vector<at::Tensor> rows;
  for (const Completion& c : cs) {
    std::vector<int64_t> ids = c.prompt;
    ids.insert(ids.end(), c.completion.begin(), c.completion.end());
    const at::Tensor logits = m.forward(at::tensor(ids, at::kLong).unsqueeze(0))[0];  // [S, V]
    const auto p = static_cast<int64_t>(c.prompt.size()), n = static_cast<int64_t>(c.completion.size());
    const at::Tensor target = at::tensor(c.completion, at::kLong).unsqueeze(1);
    const at::Tensor lp = at::log_softmax(logits.narrow(0, p - 1, n), -1).gather(1, target).squeeze(1);
    rows.push_back(at::constant_pad_nd(lp, {0, width - n}));
  }
  return at::stack(rows);
}

double rel_err(const at::Tensor& a, const at::Tensor& ref) {
  return (a - ref).abs().max().item<double>() / std::max(ref.abs().max().item<double>(), 1e-30);
}

// Each adapter's gradient of sum(weights · logps), then cleared.
std::vector<at::Tensor> adapter_grads(const qlora::models::DecoderModel& m, const at::Tensor& logps, const at::Tensor& w) {
  (logps * w).sum().backward();
  std::vector<at::Tensor> g;
  for (auto& [name, p] : m.lora_parameters()) {
    g.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }
  return g;
}

class GrpoBatch : public ::testing::Test {
 protected:
  qlora::models::DecoderModel m = qlora::test_tools::adapted_model(tiny_llama(), {}, 7, false, false);
  CompletionBatch b = completion_batch(completions(), /*pad_id=*/0);
};

}  // namespace

TEST_F(GrpoBatch, FrameAndMask) {
  EXPECT_TRUE(at::equal(b.completion_mask, at::tensor({1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0.0f}).view({3, 4})));
  EXPECT_TRUE(at::equal(b.prompt_lengths, at::tensor({3, 1, 5}, at::kLong)));
  EXPECT_TRUE(at::equal(b.truncated, at::tensor({0, 1, 0}).to(at::kBool)));
}

TEST_F(GrpoBatch, PolicyLogpsEqualWholeLogitsChunkedOrNot) {
  const at::Tensor want = whole_logits_logps(m, completions(), 4).detach();
  for (bool chunked : {true, false}) {
    m.chunked_loss = chunked;
    const at::Tensor got = completion_logps(m, b, at::kCPU, LogpsOf::kPolicy);
    EXPECT_TRUE(got.requires_grad());
    EXPECT_LE((got - want).abs().max().item<double>(), kLogpTol) << "chunked " << chunked;
    EXPECT_TRUE(at::equal(got.detach() * (1 - b.completion_mask), at::zeros_like(got))) << "padding is 0";
  }
}

TEST_F(GrpoBatch, ReferenceHasTheAdaptersOffAndOldNoGraph) {
  const at::Tensor policy = completion_logps(m, b, at::kCPU, LogpsOf::kPolicy).detach();
  const at::Tensor old = completion_logps(m, b, at::kCPU, LogpsOf::kOld);
  EXPECT_FALSE(old.requires_grad());
  EXPECT_TRUE(at::equal(old, policy));
  const at::Tensor ref = completion_logps(m, b, at::kCPU, LogpsOf::kReference);
  EXPECT_FALSE(ref.requires_grad());
  at::Tensor want;
  {
    const qlora::modules::AdaptersDisabled off;
    const at::NoGradGuard no_grad;
    want = whole_logits_logps(m, completions(), 4);
  }
  EXPECT_LE((ref - want).abs().max().item<double>(), kLogpTol);
  EXPECT_GT((ref - policy).abs().max().item<double>(), 1e-3) << "the adapters move the log-probs";
}

TEST_F(GrpoBatch, GradientEqualsTheWholeLogitsOne) {
  const at::Tensor w = at::randn({3, 4}, at::make_generator<at::CPUGeneratorImpl>(3)) * b.completion_mask;
  const std::vector<at::Tensor> got = adapter_grads(m, completion_logps(m, b, at::kCPU, LogpsOf::kPolicy), w);
  const std::vector<at::Tensor> want = adapter_grads(m, whole_logits_logps(m, completions(), 4), w);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LE(rel_err(got[i], want[i]), kGradRtol) << "adapter tensor " << i;
}

TEST(GrpoBatchRules, TruncatedIsNoStopTokenAtTheEnd) {
  const std::vector<int64_t> stops = {1, 0};
  EXPECT_FALSE(ends_truncated({5, 6, 1}, stops));
  EXPECT_FALSE(ends_truncated({5, 0}, stops));
  EXPECT_TRUE(ends_truncated({5, 6}, stops));
  EXPECT_FALSE(ends_truncated({}, stops));
}

TEST(GrpoBatchRules, EmptyPromptIsRefused) {
  try {
    completion_batch({{{1}, {2}, false}, {{}, {3}, false}}, 0);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("completion 1"), std::string::npos) << e.what();
  }
}
