// Tests for the model building blocks: RMSNorm, RoPE tables, attention, NF4 linear autograd,
// LoRA linear, activation checkpointing.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cmath>

#include "qlora/modules/activation_checkpointing.h"
#include "qlora/modules/attention.h"
#include "qlora/modules/blocked_attention.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/lora_linear.h"
#include "qlora/modules/nf4_linear.h"
#include "qlora/modules/rms_norm.h"
#include "qlora/modules/rope.h"
#include "qlora/ops/nf4_ops.h"
#include "fixtures.h"

using namespace qlora;
using namespace qlora::modules;

using qlora::models::test_fixtures::max_abs;
using qlora::models::test_fixtures::randn;
using qlora::models::test_fixtures::seeded;

TEST(RmsNorm, MatchesFormulaFp32) {
  at::Tensor x = randn({3, 5, 16}, 1);
  at::Tensor w = randn({16}, 2);
  at::Tensor y = rms_norm(x, w, 1e-5);
  at::Tensor xd = x.to(at::kDouble);
  at::Tensor ref = xd / (xd.pow(2).mean(-1, true) + 1e-5).sqrt() * w.to(at::kDouble);
  // fp32 vs a double reference: a few ulps of O(1) values.
  EXPECT_LT(max_abs(y.to(at::kDouble) - ref), 1e-5);
}

TEST(RmsNorm, Bf16CastsBeforeWeightMultiply) {
  at::Tensor x = randn({4, 32}, 3).to(at::kBFloat16);
  at::Tensor w = randn({32}, 4).to(at::kBFloat16);
  at::Tensor y = rms_norm(x, w, 1e-6);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  // HF order: normalise in fp32, round to bf16, then multiply by the bf16 weight.
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor normed = (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-6)).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(y, w * normed));
}

namespace {
// rms_norm / rms_norm_plus_one as they were before they became one autograd node (HF's LlamaRMSNorm
// and GemmaRMSNorm op chains): the reference for the node's values and, through autograd, its gradient.
at::Tensor rms_norm_chain(const at::Tensor& x, const at::Tensor& w, double eps, bool plus_one) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  if (plus_one) return (h * (w.to(at::kFloat) + 1.0)).to(x.scalar_type());
  return w * h.to(x.scalar_type());
}

struct NormRun {
  at::Tensor y, gx;  // the output and the gradient wrt x
};

// y = norm(x), then y.backward(g) (g = y itself when g is undefined), for the node or the chain.
NormRun norm_backward(bool chain, const at::Tensor& x, const at::Tensor& w, const at::Tensor& g, bool plus_one) {
  const double eps = 1e-6;
  const at::Tensor xa = x.detach().requires_grad_();
  const at::Tensor y = chain ? rms_norm_chain(xa, w, eps, plus_one)
                             : (plus_one ? rms_norm_plus_one(xa, w, eps) : rms_norm(xa, w, eps));
  y.backward(g.defined() ? g : y.detach());
  return {y.detach(), xa.grad()};
}

// [rows, dim] rows of scales 1e-3 .. 1e3: eps (1e-6) matters in the smallest, not in the largest.
at::Tensor rows_of_scales(int64_t rows, int64_t dim, uint64_t seed) {
  return randn({rows, dim}, seed) * at::pow(10.0, at::linspace(-3.0, 3.0, rows)).unsqueeze(-1);
}

// Per row, max |got - want| over max |scale|; the worst row.
double worst_row_error(const at::Tensor& got, const at::Tensor& want, const at::Tensor& scale) {
  const at::Tensor diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().amax(-1);
  return (diff / scale.to(at::kDouble).abs().amax(-1)).max().item<double>();
}
}  // namespace

// The node's values are the op chain's to fp32 rounding (on the CPU a kernel sums each row in its own
// order), and its gradient wrt x is autograd's through the chain, relative to the size of the terms it sums (rstd * g * w per row), for random gradients and
// for g = y with a unit scale: there the exact gradient of |y|^2 / 2 nearly vanishes, the mean term
// cancelling rstd * gw, so a backward without the mean term would be off by 100%.
TEST(RmsNorm, OneNodeMatchesTheOpChainFp32) {
  const at::Tensor x = rows_of_scales(12, 64, 50).view({3, 4, 64});
  for (const bool plus_one : {false, true}) {
    const at::Tensor unit = plus_one ? at::zeros({64}) : at::ones({64});
    for (const auto& [w, g] : {std::pair{randn({64}, 51), randn({3, 4, 64}, 52)}, std::pair{unit, at::Tensor()}}) {
      const NormRun got = norm_backward(false, x, w, g, plus_one), want = norm_backward(true, x, w, g, plus_one);
      EXPECT_LT(worst_row_error(got.y, want.y, want.y), 1e-6) << plus_one;
      const at::Tensor terms = (g.defined() ? g : want.y) * (plus_one ? w + 1.0 : w) *
                               at::rsqrt(x.pow(2).mean(-1, true) + 1e-6);
      EXPECT_LT(worst_row_error(got.gx, want.gx, terms), 1e-6) << plus_one << " " << g.defined();
      if (!g.defined()) {  // the cancellation, in the rows of scale >= 1 (eps keeps a gradient in the small ones)
        const at::Tensor big = at::arange(6, 12);
        EXPECT_LT(worst_row_error(got.gx.view({12, 64}).index_select(0, big), at::zeros({6, 64}),
                                  terms.view({12, 64}).index_select(0, big)), 1e-3);
      }
    }
  }
  // One node, straight to x's gradient accumulator.
  const at::Tensor xa = x.detach().requires_grad_();
  const at::Tensor y = rms_norm(xa, randn({64}, 53), 1e-6);
  ASSERT_EQ(y.grad_fn()->next_edges().size(), 2u);  // x, and the weight's empty edge
  EXPECT_EQ(y.grad_fn()->next_edges()[0].function.get(), torch::autograd::impl::grad_accumulator(xa).get());
}

// bf16 x and weight (the compute dtype on a GPU): values bit for bit; the gradient to bf16's precision
// (the node forms gw in fp32 where the chain rounded grad * w to bf16 first).
TEST(RmsNorm, OneNodeMatchesTheOpChainBf16) {
  const at::Tensor x = rows_of_scales(12, 64, 54).to(at::kBFloat16);
  const at::Tensor w = randn({64}, 55).to(at::kBFloat16), g = randn({12, 64}, 56).to(at::kBFloat16);
  for (const bool plus_one : {false, true}) {
    const NormRun got = norm_backward(false, x, w, g, plus_one), want = norm_backward(true, x, w, g, plus_one);
    EXPECT_TRUE(at::equal(got.y, want.y)) << plus_one;
    ASSERT_EQ(got.gx.scalar_type(), at::kBFloat16);
    EXPECT_LT(worst_row_error(got.gx, want.gx, want.gx), 2e-2) << plus_one;
  }
}

// A weight that requires grad (never the case in this toolkit) keeps autograd's op chain: both get gradients.
TEST(RmsNorm, TrainableWeightStillGetsItsGradient) {
  const at::Tensor x = randn({5, 16}, 57).requires_grad_(), x2 = x.detach().clone().requires_grad_();
  const at::Tensor w = randn({16}, 58).requires_grad_(), w2 = w.detach().clone().requires_grad_();
  const at::Tensor g = randn({5, 16}, 59);
  rms_norm_plus_one(x, w, 1e-6).backward(g);
  rms_norm_chain(x2, w2, 1e-6, true).backward(g);
  ASSERT_TRUE(w.grad().defined() && x.grad().defined());
  EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
  EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
}

TEST(Rope, PlainInvFreqMatchesFormula) {
  at::Tensor f = rope_inv_freq(16, 10000.0, std::nullopt);
  ASSERT_EQ(f.sizes(), at::IntArrayRef({8}));
  for (int i = 0; i < 8; ++i) {
    const double want = 1.0 / std::pow(10000.0, 2.0 * i / 16.0);
    EXPECT_NEAR(f[i].item<double>(), want, want * 1e-6) << i;
  }
}

TEST(Rope, Llama3ScalingHandComputed) {
  // head_dim 8, theta 5e5: inv_freq = 1, 5e5^-0.25, 5e5^-0.5, 5e5^-0.75 with wavelengths
  // 6.3, 167, 4443, 118148. With original context 8192, low/high factors 1/4: the band edges are
  // 8192 and 2048, so the first two are kept, the third interpolated, the fourth divided by 8.
  modules::Llama3RopeScaling s{8.0, 1.0, 4.0, 8192};
  at::Tensor f = rope_inv_freq(8, 500000.0, s);
  auto base = [](int i) { return 1.0 / std::pow(500000.0, 2.0 * i / 8.0); };
  EXPECT_NEAR(f[0].item<double>(), 1.0, 1e-7);
  EXPECT_NEAR(f[1].item<double>(), base(1), base(1) * 1e-6);
  const double wl2 = 2 * M_PI / base(2);
  const double smooth = (8192.0 / wl2 - 1.0) / (4.0 - 1.0);
  const double want2 = (1 - smooth) * base(2) / 8.0 + smooth * base(2);
  EXPECT_NEAR(f[2].item<double>(), want2, want2 * 1e-5);
  EXPECT_GT(smooth, 0.2);  // really in the interpolated band, not at an edge
  EXPECT_LT(smooth, 0.4);
  EXPECT_NEAR(f[3].item<double>(), base(3) / 8.0, base(3) / 8.0 * 1e-5);
}

// apply_rope (one autograd node) equals transformers' expression x * cos + rotate_half(x) * sin,
// in value and in the gradient, for shared [seq, d] and per-row [b, seq, d] tables.
TEST(Rope, FusedMatchesExpressionWithGradient) {
  const at::Tensor inv = rope_inv_freq(8, 10000.0, std::nullopt);
  const at::Tensor x = randn({2, 3, 5, 8}, 40), g = randn({2, 3, 5, 8}, 41);
  for (const at::Tensor& pos : {at::arange(5, at::kLong), at::arange(10, at::kLong).view({2, 5}) * 3}) {
    const RopeTables t = rope_tables(inv, pos, at::kFloat);
    const at::Tensor cos = t.cos.dim() == 3 ? t.cos.unsqueeze(1) : t.cos, sin = t.sin.dim() == 3 ? t.sin.unsqueeze(1) : t.sin;
    const at::Tensor xa = x.detach().requires_grad_(), xb = x.detach().requires_grad_();
    const at::Tensor got = apply_rope(xa.transpose(1, 2).transpose(1, 2), t);  // a strided view, as the layer passes
    const at::Tensor want = xb * cos + at::cat({-xb.narrow(-1, 4, 4), xb.narrow(-1, 0, 4)}, -1) * sin;
    got.backward(g);
    want.backward(g);
    EXPECT_LT(max_abs(got - want), 1e-6) << pos.dim();
    EXPECT_LT(max_abs(xa.grad() - xb.grad()), 1e-6) << pos.dim();
  }
}

TEST(Rope, TablesAndRotation) {
  at::Tensor inv = rope_inv_freq(4, 10000.0, std::nullopt);
  RopeTables t = rope_tables(inv, at::arange(3, at::kLong), at::kFloat);
  ASSERT_EQ(t.cos.sizes(), at::IntArrayRef({3, 4}));
  // position 2, frequency 1 (= 1/100): angle 0.02 in both halves.
  EXPECT_NEAR(t.cos[2][1].item<double>(), std::cos(0.02), 1e-6);
  EXPECT_NEAR(t.sin[2][3].item<double>(), std::sin(0.02), 1e-6);
  // Rotation preserves the norm of each (x_i, x_{i+d/2}) pair.
  at::Tensor x = randn({1, 2, 3, 4}, 5);
  at::Tensor y = apply_rope(x, t);
  at::Tensor nx = x.narrow(-1, 0, 2).pow(2) + x.narrow(-1, 2, 2).pow(2);
  at::Tensor ny = y.narrow(-1, 0, 2).pow(2) + y.narrow(-1, 2, 2).pow(2);
  EXPECT_LT(max_abs(nx - ny), 1e-5);
}

TEST(Attention, GqaShapesAndReference) {
  at::Tensor q = randn({2, 4, 5, 8}, 6), k = randn({2, 2, 5, 8}, 7), v = randn({2, 2, 5, 8}, 8);
  at::Tensor out = causal_attention(q, k, v);
  ASSERT_EQ(out.sizes(), at::IntArrayRef({2, 4, 5, 8}));
  // Query heads 0,1 share kv head 0; heads 2,3 share kv head 1.
  at::Tensor kk = k.repeat_interleave(2, 1), vv = v.repeat_interleave(2, 1);
  at::Tensor scores = at::matmul(q, kk.transpose(-1, -2)) / std::sqrt(8.0);
  at::Tensor mask = at::ones({5, 5}, at::kBool).triu(1);
  at::Tensor ref = at::matmul(at::softmax(scores.masked_fill(mask, -INFINITY), -1), vv);
  EXPECT_LT(max_abs(out - ref), 1e-5);  // fp32, different op order
  // Queries that continue a cache: the last 2 queries against all 5 keys.
  at::Tensor part = causal_attention(q.narrow(2, 3, 2), k, v);
  EXPECT_LT(max_abs(part - ref.narrow(2, 3, 2)), 1e-5);
  EXPECT_THROW(causal_attention(q, randn({2, 3, 5, 8}, 9), randn({2, 3, 5, 8}, 9)), std::invalid_argument);
}

// The blocked causal attention (training's fp32 CPU path) equals SDPA's causal attention in value
// and in the gradients of q, k and v, for blocks that divide the sequence and that do not, a block
// of one row and a block longer than the sequence; causal_attention takes it, GQA included.
namespace {
// The output of attention(q, k, v) and, for the output gradient g, the gradients of q, k and v.
template <class Fn>
std::array<at::Tensor, 4> with_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                     Fn attention) {
  const at::Tensor ql = q.detach().requires_grad_(), kl = k.detach().requires_grad_(), vl = v.detach().requires_grad_();
  const at::Tensor out = attention(ql, kl, vl);
  out.backward(g);
  return {out.detach(), ql.grad(), kl.grad(), vl.grad()};
}
}  // namespace

TEST(Attention, BlockedCausalMatchesSdpaWithGradients) {
  const at::Tensor q = randn({2, 4, 37, 8}, 30), k = randn({2, 4, 37, 8}, 31), v = randn({2, 4, 37, 8}, 32);
  const at::Tensor g = randn({2, 4, 37, 8}, 33);
  auto run = [&](auto attention) { return with_grads(q, k, v, g, attention); };
  const auto want = run([](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return at::scaled_dot_product_attention(a, b, c, std::nullopt, 0.0, /*is_causal=*/true, 0.3);
  });
  // Probabilities kept for backward or recomputed there (seq 37 <= 8 d keeps them by default).
  for (const std::optional<bool> keep : {std::optional<bool>(), std::optional<bool>(false), std::optional<bool>(true)}) {
    for (const int64_t block : {int64_t{1}, int64_t{5}, int64_t{16}, int64_t{37}, int64_t{64}}) {
      const auto got = run([block, keep](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
        return blocked_causal_attention(a, b, c, 0.3, block, keep);
      });
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_LT(max_abs(got[i] - want[i]), 1e-5) << "block " << block << " keep " << keep.value_or(-1) << " #" << i;
    }
  }
  // Through causal_attention with 2 kv heads: the gradients of k and v sum over their query heads.
  const at::Tensor k2 = k.narrow(1, 0, 2).detach().requires_grad_(), v2 = v.narrow(1, 0, 2).detach().requires_grad_();
  const at::Tensor out = causal_attention(q, k2, v2);
  const at::Tensor ref = at::scaled_dot_product_attention(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1),
                                                          std::nullopt, 0.0, true);
  EXPECT_LT(max_abs(out - ref), 1e-5);
  EXPECT_THROW(blocked_causal_attention(q, k2, v2, 0.3), std::invalid_argument);
}

// Under a mask that hides more than the future (packed rows' block-causal mask, a sliding window),
// the blocked attention equals SDPA under the same mask in value and gradients, with its
// probabilities kept or recomputed, a mask per batch row or one for all; masked_attention and a
// windowed causal_attention take it.
TEST(Attention, BlockedMaskedMatchesSdpaWithGradients) {
  const int64_t s = 37;
  const at::Tensor q = randn({2, 4, s, 8}, 34), k = randn({2, 4, s, 8}, 35), v = randn({2, 4, s, 8}, 36);
  const at::Tensor g = randn({2, 4, s, 8}, 37);
  const at::Tensor causal = at::ones({s, s}, at::kBool).tril();
  // Row 0 packs samples [0, 12), [12, 30), [30, 37); row 1 is one sample under a window of 5.
  at::Tensor packed = at::zeros({2, s, s}, at::kBool);
  for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 12}, {12, 30}, {30, s}})
    packed[0].narrow(0, a, b - a).narrow(1, a, b - a).fill_(true);
  packed[1].fill_(true);
  packed[1].logical_and_(at::ones({s, s}, at::kBool).triu(-4));
  packed.logical_and_(causal);
  const at::Tensor window = causal.logical_and(at::ones({s, s}, at::kBool).triu(-6)).unsqueeze(0);  // [1, s, s]
  for (const at::Tensor& allowed : {packed, window}) {
    const at::Tensor m4 = allowed.unsqueeze(1);  // [b or 1, 1, s, s]
    const auto want = with_grads(q, k, v, g, [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
      return at::scaled_dot_product_attention(a, b, c, m4, 0.0, false, 0.3);
    });
    for (const bool keep : {false, true})
      for (const int64_t block : {int64_t{1}, int64_t{16}, int64_t{64}}) {
        const auto got = with_grads(q, k, v, g, [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          return blocked_causal_attention(a, b, c, 0.3, block, keep, allowed);
        });
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_LT(max_abs(got[i] - want[i]), 1e-5) << "mask " << allowed.size(0) << " block " << block << " #" << i;
      }
  }
  const AttentionOptions opt{0.3};
  const at::Tensor sdpa_packed = at::scaled_dot_product_attention(q, k, v, packed.unsqueeze(1), 0.0, false, 0.3);
  EXPECT_LT(max_abs(masked_attention(q, k, v, packed, opt) - sdpa_packed), 1e-5);
  AttentionOptions windowed = opt;
  windowed.window = 7;
  const at::Tensor sdpa_window = at::scaled_dot_product_attention(q, k, v, window.unsqueeze(1), 0.0, false, 0.3);
  EXPECT_LT(max_abs(causal_attention(q, k, v, windowed) - sdpa_window), 1e-5);
}

// gpt-oss's attention sinks: one more logit per head in every row's softmax, attending to nothing.
// The blocked attention (probabilities kept or recomputed, causal or under a packed mask) and
// causal_attention's eager path for a decode step equal the definition written plainly (the sink a
// last column of the scores, dropped after the softmax), in value and in the gradients of q, k, v.
TEST(Attention, SinksMatchTheirDefinitionWithGradients) {
  const int64_t s = 29;
  const at::Tensor q = randn({2, 4, s, 8}, 50), k = randn({2, 4, s, 8}, 51), v = randn({2, 4, s, 8}, 52);
  const at::Tensor g = randn({2, 4, s, 8}, 53), sinks = randn({4}, 54).mul_(2.0);
  at::Tensor packed = at::zeros({2, s, s}, at::kBool);  // row 0: samples [0, 11), [11, s); row 1: one sample
  packed[0].narrow(0, 0, 11).narrow(1, 0, 11).fill_(true);
  packed[0].narrow(0, 11, s - 11).narrow(1, 11, s - 11).fill_(true);
  packed[1].fill_(true);
  packed.logical_and_(at::ones({s, s}, at::kBool).tril());
  for (const at::Tensor& allowed : {at::Tensor(), packed}) {
    const at::Tensor visible = allowed.defined() ? allowed.unsqueeze(1) : at::ones({s, s}, at::kBool).tril();
    const auto want = with_grads(q, k, v, g, [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
      const at::Tensor scores = (at::matmul(a, b.transpose(-1, -2)) * 0.3).masked_fill(visible.logical_not(), -INFINITY);
      const at::Tensor sink = sinks.view({1, 4, 1, 1}).expand({2, 4, s, 1});
      return at::matmul(at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, s), c);
    });
    for (const bool keep : {false, true})
      for (const int64_t block : {int64_t{1}, int64_t{16}, int64_t{64}}) {
        const auto got = with_grads(q, k, v, g, [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          return blocked_causal_attention(a, b, c, 0.3, block, keep, allowed, sinks);
        });
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_LT(max_abs(got[i] - want[i]), 1e-5) << "mask " << allowed.defined() << " block " << block << " #" << i;
      }
    if (allowed.defined()) continue;
    // A decode step: the last query against every key (causal_attention's eager path), in inference mode.
    AttentionOptions opt{0.3};
    opt.sinks = sinks;
    const c10::InferenceMode inference;
    const at::Tensor step = causal_attention(q.narrow(2, s - 1, 1), k, v, opt);
    EXPECT_LT(max_abs(step - want[0].narrow(2, s - 1, 1)), 1e-5);
  }
  EXPECT_THROW(blocked_causal_attention(q, k, v, 0.3, 64, std::nullopt, {}, randn({3}, 55)), std::invalid_argument);
}

// In bf16 (a bf16 run's CPU path) causal attention is the fp32 blocked attention of the widened
// inputs, rounded once: its value and gradients equal that exactly, and are closer to fp64 than
// transformers' eager bf16 attention (bf16 scores and probabilities).
TEST(Attention, CausalBf16IsFp32BlockedRoundedOnce) {
  const at::Tensor q = randn({1, 4, 70, 16}, 40), k = randn({1, 4, 70, 16}, 41), v = randn({1, 4, 70, 16}, 42);
  const at::Tensor g = randn({1, 4, 70, 16}, 43).to(at::kBFloat16);
  auto run = [&](at::ScalarType dt, auto attention) {
    const at::Tensor qb = q.to(at::kBFloat16), kb = k.to(at::kBFloat16), vb = v.to(at::kBFloat16);
    const at::Tensor ql = qb.to(dt).requires_grad_(), kl = kb.to(dt).requires_grad_(), vl = vb.to(dt).requires_grad_();
    attention(ql, kl, vl).backward(g.to(dt));
    return std::array<at::Tensor, 4>{attention(ql, kl, vl).detach(), ql.grad(), kl.grad(), vl.grad()};
  };
  const auto got = run(at::kBFloat16, [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return causal_attention(a, b, c, AttentionOptions{0.25});
  });
  const auto want = run(at::kFloat, [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return causal_attention(a, b, c, AttentionOptions{0.25});
  });
  const auto exact = run(at::kDouble, [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return causal_attention(a, b, c, AttentionOptions{0.25});
  });
  const auto eager = run(at::kBFloat16, [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    const at::Tensor mask = at::ones({70, 70}, at::kBool).triu(1);
    const at::Tensor s = (at::matmul(a, b.transpose(-1, -2)) * 0.25).masked_fill(mask, -INFINITY);
    return at::matmul(at::softmax(s, -1, at::kFloat).to(at::kBFloat16), c);
  });
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), at::kBFloat16) << i;
    EXPECT_TRUE(at::equal(got[i], want[i].to(at::kBFloat16))) << "#" << i;
    EXPECT_LT(max_abs(got[i].to(at::kDouble) - exact[i]), max_abs(eager[i].to(at::kDouble) - exact[i])) << "#" << i;
  }
}

TEST(Nf4Linear, ForwardBackwardMatchDequantizedLinear) {
  at::Tensor w = randn({48, 40}, 10, 0.1);
  Nf4Tensor q = ops::nf4_quantize(w, "w");
  at::Tensor wd = ops::nf4_dequantize(q, at::kFloat);
  at::Tensor x = randn({3, 7, 40}, 11).requires_grad_(true);
  at::Tensor y = nf4_linear(x, q);
  at::Tensor x2 = x.detach().clone().requires_grad_(true);
  at::Tensor ref = at::linear(x2, wd);
  EXPECT_TRUE(at::equal(y, ref));  // the same at::linear on the same dequantized fp32 weight
  at::Tensor g = randn({3, 7, 48}, 12);
  y.backward(g);
  ref.backward(g);
  // matmul(g, W) is the GEMM linear's own backward issues for grad_input: identical in fp32.
  EXPECT_TRUE(at::equal(x.grad(), x2.grad())) << max_abs(x.grad() - x2.grad());
}

TEST(Nf4Linear, LargeWeightGoesByRowChunksAndMatches) {
  // 1525 x 11008 is over the 16M elements that nf4_linear dequantizes at once: rows go in chunks
  // of whole scaler groups (1472 rows, then 53 that end in the padded group).
  Nf4Tensor q = ops::nf4_quantize(randn({1525, 11008}, 15, 0.02), "w");
  at::Tensor wd = ops::nf4_dequantize(q, at::kFloat);
  at::Tensor x = randn({2, 11008}, 16).requires_grad_(true);
  at::Tensor y = nf4_linear(x, q);
  at::Tensor x2 = x.detach().clone().requires_grad_(true);
  at::Tensor ref = at::linear(x2, wd);
  EXPECT_TRUE(at::allclose(y, ref, 1e-5, 1e-5)) << max_abs(y - ref);
  at::Tensor g = randn({2, 1525}, 17);
  y.backward(g);
  ref.backward(g);
  EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-4, 1e-5)) << max_abs(x.grad() - x2.grad());
}

TEST(Nf4Linear, KeepsNoDequantizedWeightForBackward) {
  Nf4Tensor q = ops::nf4_quantize(randn({64, 32}, 13), "w");
  at::Tensor x = randn({2, 32}, 14).requires_grad_(true);
  at::Tensor y = nf4_linear(x, q);
  auto* node = dynamic_cast<torch::autograd::CppNode<Nf4LinearFunction>*>(y.grad_fn().get());
  ASSERT_NE(node, nullptr);
  EXPECT_TRUE(node->ctx_.get_saved_variables().empty());  // not even x: grad_input needs only W
  int64_t saved_bytes = 0;
  for (const auto& kv : node->ctx_.saved_data) {
    if (!kv.second.isTensor()) continue;
    const at::Tensor t = kv.second.toTensor();
    EXPECT_NE(t.numel(), 64 * 32) << kv.first << " looks like a dequantized weight";
    saved_bytes += t.nbytes();
  }
  EXPECT_EQ(saved_bytes, q.nbytes());  // exactly the NF4 buffers
}

TEST(Nf4Linear, Bf16AndShapeErrors) {
  Nf4Tensor q = ops::nf4_quantize(randn({16, 32}, 15).to(at::kBFloat16), "w");
  at::Tensor x = randn({4, 32}, 16).to(at::kBFloat16);
  at::Tensor y = nf4_linear(x, q);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, at::linear(x, ops::nf4_dequantize(q, at::kBFloat16))));
  EXPECT_THROW(nf4_linear(randn({4, 31}, 17), q), std::invalid_argument);
}

TEST(LoraLinear, InitFollowsPeft) {
  LoraLinear l = lora_linear_dense(randn({24, 100}, 18));
  lora_linear_add_adapter(l, 8, 16.0, 0.0, seeded(42), at::kCPU);
  EXPECT_EQ(l.lora_a.sizes(), at::IntArrayRef({8, 100}));
  EXPECT_EQ(l.lora_b.sizes(), at::IntArrayRef({24, 8}));
  EXPECT_EQ(l.lora_a.scalar_type(), at::kFloat);
  EXPECT_TRUE(l.lora_a.requires_grad() && l.lora_b.requires_grad());
  EXPECT_FALSE(l.base_dense.requires_grad());
  EXPECT_DOUBLE_EQ(l.scale, 2.0);
  EXPECT_LE(max_abs(l.lora_a), 0.1);  // kaiming_uniform(a=sqrt(5)) bound = 1/sqrt(fan_in)
  EXPECT_GT(max_abs(l.lora_a), 0.09);
  EXPECT_EQ(max_abs(l.lora_b), 0.0);
  LoraLinear m = lora_linear_dense(randn({24, 100}, 18));
  lora_linear_add_adapter(m, 8, 16.0, 0.0, seeded(42), at::kCPU);
  EXPECT_TRUE(at::equal(l.lora_a, m.lora_a));  // seeded: reproducible
  lora_linear_add_adapter(m, 8, 16.0, 0.0, seeded(43), at::kCPU);
  EXPECT_FALSE(at::equal(l.lora_a, m.lora_a));
}

TEST(LoraLinear, ZeroBEqualsBase) {
  at::Tensor w = randn({32, 64}, 19, 0.1);
  at::Tensor x = randn({2, 5, 64}, 20);
  LoraLinear dense = lora_linear_dense(w);
  lora_linear_add_adapter(dense, 4, 8.0, 0.1, seeded(1), at::kCPU);
  EXPECT_TRUE(at::equal(lora_linear_forward(dense, x, false), at::linear(x, w)));
  LoraLinear nf4 = lora_linear_nf4(ops::nf4_quantize(w, "w"));
  lora_linear_add_adapter(nf4, 4, 8.0, 0.0, seeded(1), at::kCPU);
  EXPECT_TRUE(at::equal(lora_linear_forward(nf4, x, false), nf4_linear(x, nf4.base_nf4)));
}

TEST(LoraLinear, GradientsMatchDoubleReference) {
  for (bool use_nf4 : {false, true}) {
    at::Tensor w = randn({32, 64}, 21, 0.1);
    LoraLinear l = use_nf4 ? lora_linear_nf4(ops::nf4_quantize(w, "w")) : lora_linear_dense(w);
    lora_linear_add_adapter(l, 4, 8.0, 0.0, seeded(2), at::kCPU);
    {
      at::NoGradGuard ng;
      l.lora_b.copy_(randn({32, 4}, 22, 0.1));  // nonzero B so every gradient is nontrivial
    }
    at::Tensor x = randn({3, 64}, 23).requires_grad_(true);
    at::Tensor g = randn({3, 32}, 24);
    at::Tensor y = lora_linear_forward(l, x, true);
    y.backward(g);
    const at::Tensor wd = (use_nf4 ? ops::nf4_dequantize(l.base_nf4, at::kFloat) : w).to(at::kDouble);
    const at::Tensor xd = x.detach().to(at::kDouble), gd = g.to(at::kDouble);
    const at::Tensor A = l.lora_a.detach().to(at::kDouble), B = l.lora_b.detach().to(at::kDouble);
    const double s = l.scale;
    // y = x W^T + s x A^T B^T
    at::Tensor yref = xd.matmul(wd.t()) + s * xd.matmul(A.t()).matmul(B.t());
    EXPECT_LT(max_abs(y.detach().to(at::kDouble) - yref), 1e-5);
    at::Tensor gB = s * gd.t().matmul(xd.matmul(A.t()));        // [out, r]
    at::Tensor gA = s * gd.matmul(B).t().matmul(xd);            // [r, in]
    at::Tensor gx = gd.matmul(wd) + s * gd.matmul(B).matmul(A); // [batch, in]
    // fp32 accumulations of ~64 O(1) terms vs double.
    EXPECT_LT(max_abs(l.lora_b.grad().to(at::kDouble) - gB), 1e-4) << use_nf4;
    EXPECT_LT(max_abs(l.lora_a.grad().to(at::kDouble) - gA), 1e-4) << use_nf4;
    EXPECT_LT(max_abs(x.grad().to(at::kDouble) - gx), 1e-4) << use_nf4;
  }
}

TEST(LoraLinear, DropoutOnlyWhenTraining) {
  LoraLinear l = lora_linear_dense(randn({16, 32}, 25));
  lora_linear_add_adapter(l, 4, 4.0, 0.5, seeded(3), at::kCPU);
  {
    at::NoGradGuard ng;
    l.lora_b.copy_(randn({16, 4}, 26));
  }
  at::Tensor x = randn({8, 32}, 27);
  at::Tensor e1 = lora_linear_forward(l, x, false), e2 = lora_linear_forward(l, x, false);
  EXPECT_TRUE(at::equal(e1, e2));
  LoraLinear nodrop = l;
  nodrop.dropout = 0.0;
  EXPECT_TRUE(at::equal(e1, lora_linear_forward(nodrop, x, true)));
  EXPECT_FALSE(at::equal(e1, lora_linear_forward(l, x, true)));
  // Dropout touches the LoRA path only: with B = 0 training output equals the base.
  at::NoGradGuard ng;
  l.lora_b.zero_();
  EXPECT_TRUE(at::equal(lora_linear_forward(l, x, true), at::linear(x, l.base_dense)));
}

namespace {
DecoderLayer random_layer(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t inter, bool nf4, double dropout) {
  const int64_t d = hidden / heads;
  uint64_t seed = 100;
  auto proj = [&](int64_t out, int64_t in) {
    at::Tensor w = randn({out, in}, seed++, 1.0 / std::sqrt(static_cast<double>(in)));
    LoraLinear l = nf4 ? lora_linear_nf4(ops::nf4_quantize(w, "w")) : lora_linear_dense(w);
    lora_linear_add_adapter(l, 4, 8.0, dropout, seeded(seed++), at::kCPU);
    at::NoGradGuard ng;
    l.lora_b.copy_(randn({out, 4}, seed++, 0.1));
    return l;
  };
  DecoderLayer L;
  L.input_layernorm = 1.0 + randn({hidden}, seed++, 0.1);
  L.post_attention_layernorm = 1.0 + randn({hidden}, seed++, 0.1);
  L.q_proj = proj(heads * d, hidden);
  L.k_proj = proj(kv_heads * d, hidden);
  L.v_proj = proj(kv_heads * d, hidden);
  L.o_proj = proj(hidden, heads * d);
  L.gate_proj = proj(inter, hidden);
  L.up_proj = proj(inter, hidden);
  L.down_proj = proj(hidden, inter);
  return L;
}
}  // namespace

TEST(ActivationCheckpointing, SameGradientsAsPlainBackward) {
  for (bool nf4 : {false, true}) {
    const DecoderLayer L = random_layer(32, 4, 2, 48, nf4, /*dropout=*/0.1);
    const LayerDims dims{4, 2, 8, 1e-5};
    const RopeTables rope = rope_tables(rope_inv_freq(8, 10000.0, std::nullopt), at::arange(6, at::kLong), at::kFloat);
    const std::vector<at::Tensor> params = L.trainable();
    ASSERT_EQ(params.size(), 14u);
    auto run = [&](bool ckpt) {
      for (const at::Tensor& p : params) {
        if (p.grad().defined()) p.mutable_grad().zero_();
      }
      at::Tensor h = randn({2, 6, 32}, 200).requires_grad_(true);
      at::manual_seed(7);  // same dropout masks in both runs
      auto fn = [&](const at::Tensor& x) { return decoder_layer_forward(L, dims, x, rope, /*training=*/true); };
      at::Tensor out = ckpt ? checkpointed(fn, h, params) : fn(h);
      // A second layer call after the checkpointed one: its dropout draws must not be disturbed
      // by the replay in backward either.
      (out * randn({2, 6, 32}, 201)).sum().backward();
      std::vector<at::Tensor> grads{h.grad().clone()};
      for (const at::Tensor& p : params) grads.push_back(p.grad().clone());
      return std::make_pair(out.detach(), grads);
    };
    auto [out_plain, g_plain] = run(false);
    auto [out_ckpt, g_ckpt] = run(true);
    EXPECT_TRUE(at::equal(out_plain, out_ckpt)) << nf4;
    ASSERT_EQ(g_plain.size(), g_ckpt.size());
    for (size_t i = 0; i < g_plain.size(); ++i) {
      // The replay runs the same ops on the same inputs and masks: bit-identical on CPU.
      EXPECT_TRUE(at::equal(g_plain[i], g_ckpt[i])) << "nf4=" << nf4 << " grad " << i;
    }
  }
}

TEST(ActivationCheckpointing, ForwardKeepsNoGraph) {
  const DecoderLayer L = random_layer(32, 4, 4, 48, false, 0.0);
  const LayerDims dims{4, 4, 8, 1e-5};
  const RopeTables rope = rope_tables(rope_inv_freq(8, 10000.0, std::nullopt), at::arange(3, at::kLong), at::kFloat);
  at::Tensor h = randn({1, 3, 32}, 300).requires_grad_(true);
  at::Tensor out = checkpointed([&](const at::Tensor& x) { return decoder_layer_forward(L, dims, x, rope, false); }, h,
                                L.trainable());
  // Output hangs directly off the checkpoint node: its only saved variable is the input.
  ASSERT_TRUE(out.grad_fn());
  EXPECT_EQ(out.grad_fn()->name().find("CheckpointFunction") != std::string::npos, true) << out.grad_fn()->name();
  EXPECT_EQ(out.grad_fn()->num_inputs(), 1u);
}

TEST(Rope, PerRowPositionsMatchSharedTables) {
  at::Tensor inv = rope_inv_freq(8, 10000.0, std::nullopt);
  at::Tensor pos = at::tensor({0, 1, 2, 0, 1, 4, 0, 1}, at::kLong).view({2, 4});  // [b, s]
  RopeTables batched = rope_tables(inv, pos, at::kFloat);
  ASSERT_EQ(batched.cos.sizes(), at::IntArrayRef({2, 4, 8}));
  at::Tensor x = randn({2, 3, 4, 8}, 12);  // [b, heads, s, d]
  at::Tensor y = apply_rope(x, batched);
  for (int64_t r = 0; r < 2; ++r) {
    RopeTables one = rope_tables(inv, pos[r], at::kFloat);  // [s, d]
    EXPECT_TRUE(at::equal(y[r], apply_rope(x.narrow(0, r, 1), one)[0])) << r;
  }
}

TEST(Attention, MaskedAttentionMatchesReference) {
  at::Tensor q = randn({2, 4, 5, 8}, 13), k = randn({2, 2, 5, 8}, 14), v = randn({2, 2, 5, 8}, 15);
  // Row 0: plain causal (must equal causal_attention); row 1: two blocks, [0,2) and [2,5).
  at::Tensor mask = at::ones({2, 5, 5}, at::kBool).tril();
  mask[1].narrow(0, 2, 3).narrow(1, 0, 2).fill_(false);
  at::Tensor out = masked_attention(q, k, v, mask);
  ASSERT_EQ(out.sizes(), at::IntArrayRef({2, 4, 5, 8}));
  EXPECT_LT(max_abs(out[0] - causal_attention(q.narrow(0, 0, 1), k.narrow(0, 0, 1), v.narrow(0, 0, 1))[0]), 1e-5);
  at::Tensor kk = k.repeat_interleave(2, 1), vv = v.repeat_interleave(2, 1);
  at::Tensor scores = at::matmul(q, kk.transpose(-1, -2)) / std::sqrt(8.0);
  at::Tensor ref = at::matmul(at::softmax(scores.masked_fill(mask.logical_not().unsqueeze(1), -INFINITY), -1), vv);
  EXPECT_LT(max_abs(out - ref), 1e-5);  // fp32, different op order
  EXPECT_THROW(masked_attention(q, k, v, mask.to(at::kFloat)), std::invalid_argument);
  EXPECT_THROW(masked_attention(q, k, v, mask.narrow(1, 0, 4)), std::invalid_argument);
}
