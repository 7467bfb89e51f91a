// The chunked output projection + cross-entropy (models/output_head.h, DecoderModel::loss) equals the
// whole-logits loss it replaces, in value and in every gradient, and never allocates a [tokens,
// vocab] tensor.
//
// Tolerance (fp32): the logits are the same ops per vocab block; what differs is the order of fp32
// sums: the log-sum-exp and the gradient sums run over vocab blocks with an online max (rescaled
// partial sums), the loss and the gradients of A and B over token chunks, and a GEMM over fewer
// rows may block its inner products differently. All move results by a few fp32 ulps of the sums
// (~1e-7 relative); kRel = 1e-5 relative to the reference's largest magnitude
// leaves room for that and is far below what a wrong chunk boundary, a dropped or doubled chunk, a
// missing softcap derivative or a lost LoRA term cause (>= 1e-2 relative, checked by the ablation
// in ChunkedLossMatchesFullLogitsForEveryHead).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "bench/random_llama.h"  // random in-memory models of any family's shape
#include "fixtures.h"
#include "qlora/models/decoder.h"
#include "qlora/models/output_head.h"
#include "qlora/ops/nf4_ops.h"

using namespace qlora::models;
namespace modules = qlora::modules;

namespace {

constexpr double kRel = 1e-5;

at::Generator gen_of(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// max |got - want| <= kRel * max |want| (+ a floor for an all-zero reference).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = want.abs().max().item<double>();
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(err, kRel * scale + 1e-12) << what << ": max error " << err << " at scale " << scale;
}

// Labels over `vocab` for n tokens with ignored ones: every third token, and the run [4, 13) that
// covers whole chunks of sizes 1, 3 and 4 (all-ignored chunks).
at::Tensor labels_with_gaps(int64_t n, int64_t vocab, uint64_t seed) {
  at::Tensor l = at::randint(0, vocab, {n}, gen_of(seed));
  for (int64_t i = 0; i < n; i += 3) l[i] = -100;
  l.narrow(0, 4, std::min<int64_t>(9, n - 4)).fill_(-100);
  return l;
}

struct Grads {
  double loss = 0.0;
  at::Tensor h, x, a, b;
};

// Loss and gradients of `loss_fn` wrt h, x and the head's adapters, the loss scaled by 0.37 before
// backward (a recipe divides it by the token count) so backward's scaling is checked too.
template <typename Fn>
Grads run(const modules::LoraLinear& l, const at::Tensor& h, const at::Tensor& x, Fn loss_fn) {
  const at::Tensor hl = h.detach().requires_grad_(true), xl = x.detach().requires_grad_(true);
  modules::LoraLinear leaf = l;
  leaf.lora_a = l.lora_a.detach().requires_grad_(true);
  leaf.lora_b = l.lora_b.detach().requires_grad_(true);
  const at::Tensor loss = loss_fn(leaf, hl, xl);
  (loss * 0.37).backward();
  return {loss.item<double>(), hl.grad(), xl.grad(), leaf.lora_a.grad(), leaf.lora_b.grad()};
}

// A head of `vocab` x 64: base (fp32, bf16 storage widened 7 rows at a time, or NF4) + LoRA r 4
// with a nonzero B.
modules::LoraLinear make_head(const std::string& base, int64_t vocab) {
  const at::Tensor w = at::randn({vocab, 64}, gen_of(1)) * 0.2;
  modules::LoraLinear l = base == "nf4" ? modules::lora_linear_nf4(qlora::ops::nf4_quantize(w.to(at::kBFloat16)))
                                        : modules::lora_linear_dense(base == "bf16" ? w.to(at::kBFloat16) : w);
  modules::lora_linear_add_adapter(l, 4, 8.0, 0.0, gen_of(2), at::kCPU);
  at::NoGradGuard ng;
  l.lora_b.copy_(at::randn(l.lora_b.sizes(), gen_of(3)) * 0.1);
  return l;
}

}  // namespace

// Every base (fp32, bf16 widened by rows, NF4), with and without Gemma's soft-cap, for chunk sizes
// that divide the 23 tokens and that do not, 1 (every ignored token its own chunk) and more than
// the tokens.
TEST(OutputHead, ChunkedLossMatchesFullLogitsForEveryHead) {
  constexpr int64_t kTokens = 23, kVocab = 300;
  const at::Tensor h = at::randn({kTokens, 64}, gen_of(4)), x = at::randn({kTokens, 64}, gen_of(5));
  const at::Tensor labels = labels_with_gaps(kTokens, kVocab, 6);
  for (const std::string base : {"fp32", "bf16", "nf4"}) {
    for (const double cap : {0.0, 2.0}) {
      const modules::LoraLinear l = make_head(base, kVocab);
      const OutputHead head{&l, 7, cap};
      auto with = [&head](const modules::LoraLinear& leaf) { return OutputHead{&leaf, head.widen_rows, head.softcap}; };
      const Grads want = run(l, h, x, [&](const modules::LoraLinear& leaf, const at::Tensor& hl, const at::Tensor& xl) {
        return full_token_loss(with(leaf), hl, xl, labels);
      });
      for (const int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{23}, int64_t{64}}) {
        const std::string what = base + " cap " + std::to_string(cap) + " chunk " + std::to_string(chunk);
        const Grads got =
            run(l, h, x, [&](const modules::LoraLinear& leaf, const at::Tensor& hl, const at::Tensor& xl) {
              return chunked_token_loss(with(leaf), hl, xl, labels, chunk);
            });
        EXPECT_NEAR(got.loss, want.loss, kRel * std::abs(want.loss)) << what;
        expect_close(got.h, want.h, what + " dL/dh");
        expect_close(got.x, want.x, what + " dL/d(lora x)");
        expect_close(got.a, want.a, what + " dL/dA");
        expect_close(got.b, want.b, what + " dL/dB");
        // Ignored tokens get exactly no gradient, as from the whole logits.
        EXPECT_EQ(got.h.index({labels == -100}).abs().max().item<double>(), 0.0) << what;
      }
      // The comparison can fail: the soft-cap (or its absence) moves the loss far beyond kRel.
      const OutputHead other{&l, 7, cap == 0.0 ? 2.0 : 0.0};
      at::NoGradGuard ng;
      EXPECT_GT(std::abs(chunked_token_loss(other, h, x, labels, 5).item<double>() - want.loss), 1e-2 * want.loss);
    }
  }
}

// Per-segment sums (the sequence log-probabilities of preference losses): each segment's loss and,
// through a backward that weighs the segments differently (signs included, as a DPO loss does),
// every gradient equal the whole-logits per-token losses summed per segment, for every base and
// chunk size; and the segments add up to the scalar loss.
TEST(OutputHead, SegmentLossesMatchFullLogitsUnderWeightedBackward) {
  constexpr int64_t kTokens = 23, kVocab = 300, kSegments = 3;
  const at::Tensor h = at::randn({kTokens, 64}, gen_of(4)), x = at::randn({kTokens, 64}, gen_of(5));
  const at::Tensor labels = labels_with_gaps(kTokens, kVocab, 6);
  const at::Tensor seg = at::tensor({0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2}, at::kLong);
  const at::Tensor weights = at::tensor({0.3, -1.2, 0.7}, at::kFloat);  // [segments]
  for (const std::string base : {"fp32", "nf4"}) {
    const modules::LoraLinear l = make_head(base, kVocab);
    auto head = [](const modules::LoraLinear& leaf) { return OutputHead{&leaf, 7, 2.0}; };
    at::Tensor want_losses;
    const Grads want = run(l, h, x, [&](const modules::LoraLinear& leaf, const at::Tensor& hl, const at::Tensor& xl) {
      want_losses = full_segment_loss(head(leaf), hl, xl, labels, seg, kSegments);
      return (want_losses * weights).sum();
    });
    ASSERT_EQ(want_losses.sizes(), at::IntArrayRef({kSegments}));
    for (const int64_t chunk : {int64_t{1}, int64_t{4}, int64_t{23}}) {
      const std::string what = base + " chunk " + std::to_string(chunk);
      at::Tensor got_losses;
      const Grads got = run(l, h, x, [&](const modules::LoraLinear& leaf, const at::Tensor& hl, const at::Tensor& xl) {
        got_losses = chunked_segment_loss(head(leaf), hl, xl, labels, seg, kSegments, chunk);
        return (got_losses * weights).sum();
      });
      expect_close(got_losses.detach(), want_losses.detach(), what + " losses");
      expect_close(got.h, want.h, what + " dL/dh");
      expect_close(got.x, want.x, what + " dL/d(lora x)");
      expect_close(got.a, want.a, what + " dL/dA");
      expect_close(got.b, want.b, what + " dL/dB");
      at::NoGradGuard ng;
      EXPECT_NEAR(got_losses.sum().item<double>(), chunked_token_loss(head(l), h, x, labels, chunk).item<double>(),
                  kRel * got_losses.sum().item<double>())
          << what;
    }
  }
}

// Each token's entropy (OutputHead::entropy, GRPO's metric) from the vocabulary blocks' running
// sums equals -sum p log p of the whole logits in float64, for the soft-cap and a temperature,
// every chunk size; unscored tokens get 0; the loss itself is unchanged by asking for it.
TEST(OutputHead, EntropyByChunksEqualsTheWholeLogitsOnes) {
  constexpr int64_t kTokens = 23, kVocab = 300;
  const at::Tensor h = at::randn({kTokens, 64}, gen_of(4)), x = at::randn({kTokens, 64}, gen_of(5));
  const at::Tensor labels = labels_with_gaps(kTokens, kVocab, 6);
  const modules::LoraLinear l = make_head("nf4", kVocab);
  at::NoGradGuard ng;
  for (const double cap : {0.0, 2.0}) {
    for (const double temperature : {1.0, 0.7}) {
      OutputHead head{&l, 7, cap, temperature};
      const at::Tensor logp = at::log_softmax(output_logits(head, h, x).to(at::kDouble), -1);
      const at::Tensor want = (-(logp.exp() * logp).sum(-1)).masked_fill(labels == -100, 0.0);
      const double loss = chunked_token_loss(head, h, x, labels, 5).item<double>();
      for (const int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{64}}) {
        const std::string what = "cap " + std::to_string(cap) + " T " + std::to_string(temperature) + " chunk " +
                                 std::to_string(chunk);
        at::Tensor got;
        head.entropy = &got;
        EXPECT_EQ(chunked_token_loss(head, h, x, labels, chunk).item<double>(),
                  chunk == 5 ? loss : chunked_token_loss(OutputHead{&l, 7, cap, temperature}, h, x, labels, chunk)
                                          .item<double>())
            << what;
        expect_close(got, want, what);
        EXPECT_TRUE(at::equal(got.index({labels == -100}), at::zeros({(labels == -100).sum().item<int64_t>()})))
            << what;
        at::Tensor full;
        head.entropy = &full;
        full_token_loss(head, h, x, labels);
        expect_close(full, want, what + " whole logits");
        head.entropy = nullptr;
      }
      EXPECT_GT(want.max().item<double>(), 1.0);  // far from one-hot: a wrong sum would show
    }
  }
}

TEST(OutputHead, AllIgnoredLabelsGiveZeroLossAndZeroGradients) {
  const modules::LoraLinear l = make_head("fp32", 50);
  const at::Tensor h = at::randn({9, 64}, gen_of(7)), x = at::randn({9, 64}, gen_of(8));
  const at::Tensor labels = at::full({9}, -100, at::kLong);
  const Grads g = run(l, h, x, [&](const modules::LoraLinear& leaf, const at::Tensor& hl, const at::Tensor& xl) {
    return chunked_token_loss(OutputHead{&leaf, 4096, 0.0}, hl, xl, labels, 4);
  });
  EXPECT_EQ(g.loss, 0.0);
  for (const at::Tensor& t : {g.h, g.x, g.a, g.b}) {
    ASSERT_TRUE(t.defined());  // every adapter still gets its (zero) gradient: the engine counts them
    EXPECT_EQ(t.abs().max().item<double>(), 0.0);
  }
}

TEST(OutputHead, BadArgumentsAreRefused) {
  const modules::LoraLinear l = make_head("fp32", 50);
  const OutputHead head{&l, 4096, 0.0};
  const at::Tensor h = at::randn({9, 64}), labels = at::zeros({9}, at::kLong);
  EXPECT_THROW(chunked_token_loss(head, h, h, labels, 0), std::invalid_argument);
  for (const int64_t bad : {int64_t{-1}, head.proj->out_features})  // a scored label outside the vocabulary
    EXPECT_THROW(chunked_token_loss(head, h, h, labels.clone().fill_(bad), 4), std::invalid_argument);
  EXPECT_THROW(chunked_token_loss(head, h, at::Tensor(), labels, 4), std::invalid_argument);  // adapter, no input
  EXPECT_THROW(chunked_token_loss(head, h, h, at::zeros({8}, at::kLong), 4), std::invalid_argument);
  EXPECT_THROW(chunked_token_loss(head, h.view({3, 3, 64}), h, labels, 4), std::invalid_argument);
}

namespace {

// The CPU allocator, recording the largest single allocation while installed.
struct LargestAllocation : c10::Allocator {
  c10::Allocator* inner = c10::GetCPUAllocator();
  std::atomic<size_t> largest{0};
  LargestAllocation() { c10::SetCPUAllocator(this, /*priority=*/100); }
  ~LargestAllocation() override { c10::SetCPUAllocator(inner, /*priority=*/100); }
  c10::DataPtr allocate(size_t n) override {
    size_t seen = largest.load();
    while (n > seen && !largest.compare_exchange_weak(seen, n)) {
    }
    return inner->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

}  // namespace

// 2048 tokens x vocab 4096: whole fp32 logits are 32 MiB, one 64-token chunk's 1 MiB, and nothing
// else in the step is over 0.5 MiB (h and its gradient [2048, 64] fp32, the head [4096, 64]). The
// largest allocation of the chunked forward + backward stays under 4 MiB; the whole-logits loss's
// is at least 32 MiB, so the bound is a real one.
TEST(OutputHead, ChunkedLossNeverAllocatesTheWholeLogits) {
  constexpr int64_t kTokens = 2048, kVocab = 4096;
  const modules::LoraLinear l = make_head("bf16", kVocab);
  const at::Tensor h = at::randn({kTokens, 64}, gen_of(9)), x = at::randn({kTokens, 64}, gen_of(10));
  const at::Tensor labels = at::randint(0, kVocab, {kTokens}, gen_of(11));
  const size_t whole = size_t{kTokens} * kVocab * sizeof(float);
  auto largest = [&](bool chunked) {
    LargestAllocation rec;
    run(l, h, x, [&](const modules::LoraLinear& leaf, const at::Tensor& hl, const at::Tensor& xl) {
      const OutputHead head{&leaf, 4096, 2.0};
      return chunked ? chunked_token_loss(head, hl, xl, labels, 64) : full_token_loss(head, hl, xl, labels);
    });
    return rec.largest.load();
  };
  EXPECT_LT(largest(true), whole / 8);
  EXPECT_GE(largest(false), whole);
}

namespace {

using qlora::models::test_fixtures::tiny_llama;

// Tiny configs of the families whose head differs: Gemma 2 (tied, (1 + w) final norm, soft-cap 3)
// and Qwen2 (tied here, q/k/v biases). Vocab 512, hidden 64, 2 layers.
const char* kTinyGemma2 = R"({"model_type":"gemma2","hidden_size":64,"intermediate_size":128,"num_attention_heads":4,
  "num_key_value_heads":2,"head_dim":16,"num_hidden_layers":2,"vocab_size":512,"rms_norm_eps":1e-6,
  "query_pre_attn_scalar":16,"sliding_window":4,"attn_logit_softcapping":50.0,"final_logit_softcapping":3.0,
  "hidden_activation":"gelu_pytorch_tanh","max_position_embeddings":64})";
const char* kTinyQwen2 = R"({"model_type":"qwen2","hidden_size":64,"intermediate_size":128,"num_attention_heads":4,
  "num_key_value_heads":2,"num_hidden_layers":2,"vocab_size":512,"rms_norm_eps":1e-6,"rope_theta":10000.0,
  "tie_word_embeddings":true,"max_position_embeddings":64})";

// A model with LoRA on every projection and the output head (dropout 0.1 on the head; "llama
// layers only": none on the head), B nonzero.
DecoderModel tiny(const std::string& family) {
  DecoderModel m;
  if (family.rfind("llama", 0) == 0) {
    DecoderLoadOptions o;
    o.base_in_nf4 = true;
    o.frozen_dtype = at::kBFloat16;  // the head widened by rows
    o.lora_targets = {"q", "k", "v", "o", "gate", "up", "down"};
    if (family == "llama") o.lora_targets.push_back("output");
    m = load_decoder(tiny_llama(), o);
  } else {
    m = qlora::bench::random_model(parse_decoder_config(family == "gemma2" ? kTinyGemma2 : kTinyQwen2, family), 4,
                                   8.0, false);
    modules::lora_linear_add_adapter(m.lm_head, 4, 8.0, 0.0, gen_of(12), at::kCPU);
  }
  m.lm_head.dropout = 0.1;
  m.lm_head_chunk_rows = 100;
  m.training = true;
  at::NoGradGuard ng;
  uint64_t s = 20;
  for (auto& [name, t] : m.lora_parameters())
    if (name.find("lora_B") != std::string::npos) t.copy_(at::randn(t.sizes(), gen_of(s++)) * 0.05);
  return m;
}

// The loss of m on (tokens, labels) and every adapter's gradient, dropout drawn from seed 7.
std::pair<double, std::vector<at::Tensor>> loss_and_grads(DecoderModel& m, const at::Tensor& tokens,
                                                          const at::Tensor& labels) {
  std::vector<at::Tensor> grads;
  for (auto& [name, t] : m.lora_parameters()) t.mutable_grad() = at::Tensor();
  at::manual_seed(7);
  const at::Tensor loss = m.loss(tokens, labels);
  loss.backward();
  for (auto& [name, t] : m.lora_parameters()) grads.push_back(t.grad());
  return {loss.item<double>(), grads};
}

}  // namespace

// End to end: DecoderModel::loss by chunks equals the whole-logits loss (which equals
// cross_entropy(forward())) in the loss and every adapter's gradient, for Llama (NF4 base, bf16
// head widened by rows; LoRA on the head or not), Gemma 2 (tied, soft-capped) and Qwen2 (tied),
// with dropout on the head's LoRA input.
TEST(OutputHead, ModelLossByChunksEqualsWholeLogitsForEachFamily) {
  for (const std::string family : {"llama", "llama layers only", "gemma2", "qwen2"}) {
    DecoderModel m = tiny(family);
    const int64_t vocab = m.config.vocab_size;
    const at::Tensor tokens = at::randint(0, vocab, {2, 11}, gen_of(13));
    const at::Tensor labels = labels_with_gaps(22, vocab, 14).view({2, 11});
    m.chunked_loss = false;
    const auto [want, want_grads] = loss_and_grads(m, tokens, labels);
    {
      at::NoGradGuard ng;
      at::manual_seed(7);
      const at::Tensor logits = m.forward(tokens);
      EXPECT_EQ(at::cross_entropy_loss(logits.view({-1, vocab}), labels.view({-1}), {}, at::Reduction::Sum, -100)
                    .item<double>(),
                want)
          << family << ": the reference is today's loss";
    }
    m.chunked_loss = true;
    for (const int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{8}}) {
      m.loss_chunk_tokens = chunk;
      const auto [got, grads] = loss_and_grads(m, tokens, labels);
      const std::string what = family + " chunk " + std::to_string(chunk);
      EXPECT_NEAR(got, want, kRel * want) << what;
      const auto names = m.lora_parameters();
      ASSERT_EQ(grads.size(), want_grads.size());
      for (size_t i = 0; i < grads.size(); ++i) expect_close(grads[i], want_grads[i], what + " " + names[i].first);
    }
  }
}

// The unit hooks see loss() as they see forward(): the same events, in the same order, forward and
// backward, with and without activation checkpointing.
TEST(OutputHead, LossFiresTheUnitHooksAsForwardDoes) {
  const at::Tensor tokens = at::randint(0, 256, {2, 7}, gen_of(15)), labels = at::randint(0, 256, {2, 7}, gen_of(16));
  for (const bool ckpt : {false, true}) {
    DecoderModel m = tiny("llama");
    m.activation_checkpointing = ckpt;
    auto rec = std::make_shared<test_fixtures::HookRecorder>();
    m.hooks = rec;
    m.forward(tokens).sum().backward();
    const std::vector<std::string> want = rec->events;
    rec->events.clear();
    m.loss(tokens, labels).backward();
    EXPECT_EQ(rec->events, want) << "activation checkpointing " << ckpt;
    EXPECT_GT(want.size(), 10u);
  }
}

TEST(OutputHead, ModelLossRefusesBadLabels) {
  DecoderModel m = tiny("llama");
  const at::Tensor tokens = at::randint(0, 256, {2, 7}, gen_of(17));
  EXPECT_THROW(m.loss(tokens, at::zeros({2, 6}, at::kLong)), std::invalid_argument);
  EXPECT_THROW(m.loss(tokens, at::zeros({2, 7}, at::kInt)), std::invalid_argument);
}
