// Tests for grouped_experts (modules/experts.h): a Mixture-of-Experts layer's routed experts as one
// autograd node, against a float64 reference written plainly here (per token, per slot: the expert's
// dense weights = its NF4 weights dequantized, in fp64, its adapters in fp64, silu (or gelu-tanh:
// ExpertActivation), the weighted sum; every gradient by autograd on that reference graph).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <utility>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/modules/experts.h"
#include "qlora/modules/lora_linear.h"
#include "qlora/modules/moe.h"
#include "qlora/ops/nf4_ops.h"
#include "fixtures.h"

using namespace qlora;
using namespace qlora::modules;
using qlora::models::test_fixtures::randn;
using qlora::models::test_fixtures::rel_err;
using qlora::models::test_fixtures::seeded;

namespace {

struct Shape {
  int64_t experts = 5, hidden = 64, inter = 32, r = 4;
  bool nf4 = true, lora = true;
  at::ScalarType dtype = at::kFloat;  // x's, the dense weights' and the NF4 weights'
  ExpertActivation activation = ExpertActivation::kSwiglu;
  // gpt-oss's experts: the clamped SwiGLU (a limit of 0.5 clamps about half the gate and up values of
  // these weights) and per-expert biases.
  bool gpt_oss = false;
  double limit = 0.5;
};

// Experts with random weights; adapters with B set to random values, so that every LoRA path
// (forward and backward) carries a term of about a fifth of the base's size.
Experts make_experts(const Shape& s, uint64_t seed = 10) {
  std::vector<at::Tensor> gu, down;
  for (int64_t e = 0; e < s.experts; ++e) {
    gu.push_back(randn({2 * s.inter, s.hidden}, seed + 2 * e, 1.0 / std::sqrt(double(s.hidden))).to(s.dtype));
    down.push_back(randn({s.hidden, s.inter}, seed + 2 * e + 1, 1.0 / std::sqrt(double(s.inter))).to(s.dtype));
  }
  Experts ex;
  if (s.nf4) {
    std::vector<Nf4Tensor> gq, dq;
    for (size_t e = 0; e < gu.size(); ++e) {
      gq.push_back(ops::nf4_quantize(gu[e], "gu"));
      dq.push_back(ops::nf4_quantize(down[e], "down"));
    }
    ex = experts_nf4(std::move(gq), std::move(dq));
  } else {
    ex = experts_dense(gu, down);
  }
  ex.activation = s.activation;
  if (s.gpt_oss) {
    ex.activation = ExpertActivation::kClampedSwiglu;
    ex.alpha = 1.702;
    ex.limit = s.limit;
    ex.gate_up_bias = randn({s.experts, 2 * s.inter}, seed + 200, 0.3).to(s.dtype);
    ex.down_bias = randn({s.experts, s.hidden}, seed + 201, 0.3).to(s.dtype);
  }
  if (s.lora) {
    experts_add_adapters(ex, s.r, 2.0, seeded(seed + 100), at::kCPU);
    at::NoGradGuard ng;
    ex.gate_up_b.copy_(randn(ex.gate_up_b.sizes(), seed + 101, 0.1));
    ex.down_b.copy_(randn(ex.down_b.sizes(), seed + 102, 0.1));
  }
  return ex;
}

// Expert e's frozen weight of a projection in fp64: the NF4 one dequantized (exactly, in its dtype).
at::Tensor base64(const Experts& ex, int64_t e, bool gate_up) {
  if (ex.nf4()) return ops::nf4_dequantize(gate_up ? ex.gate_up_nf4[e] : ex.down_nf4[e], at::kFloat).to(at::kDouble);
  return (gate_up ? ex.gate_up_dense[e] : ex.down_dense[e]).to(at::kDouble);
}

// The output and every gradient of one run (the adapters' gradients zero-filled when absent).
struct Grads {
  at::Tensor y, dx, dw, gu_a, gu_b, down_a, down_b;
};

at::Tensor grad_or_zeros(const at::Tensor& t) {
  return t.grad().defined() ? t.grad().to(at::kDouble) : at::zeros(t.sizes(), at::kDouble);
}

// Expert e's A [r, in] and B [out, r] in peft's stacking (target_parameters): A's rows e*r .. e*r + r
// (expert-major), B's columns j*E + e (expert-minor).
at::Tensor a_of(const at::Tensor& a, int64_t experts, int64_t e) {
  const int64_t r = a.size(0) / experts;
  return a.narrow(0, e * r, r);
}
at::Tensor b_of(const at::Tensor& b, int64_t experts, int64_t e) {
  std::vector<at::Tensor> cols;
  for (int64_t j = 0; j < b.size(1) / experts; ++j) cols.push_back(b.select(1, j * experts + e));
  return at::stack(cols, 1);
}

// The experts' activation `act` on fp64 gate and up, as transformers writes it (clamped:
// GptOssExperts._apply_gate; its constants the experts').
at::Tensor reference_act(const Experts& ex, ExpertActivation act, const at::Tensor& gate, const at::Tensor& up) {
  if (act == ExpertActivation::kSwiglu) return at::silu(gate) * up;
  if (act == ExpertActivation::kGeluTanh) return at::gelu(gate, "tanh") * up;
  const at::Tensor g = gate.clamp_max(ex.limit), u = up.clamp(-ex.limit, ex.limit);
  return (u + 1) * (g * at::sigmoid(g * ex.alpha));
}

// The fp64 reference, token by token and slot by slot, differentiated by autograd, with the experts'
// activation (or `act` where given).
Grads reference(const Experts& ex, const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                const at::Tensor& grad, std::optional<ExpertActivation> act = std::nullopt) {
  const ExpertActivation activation = act.value_or(ex.activation);
  const at::Tensor x64 = x.to(at::kDouble).requires_grad_(true), w64 = weights.to(at::kDouble).requires_grad_(true);
  std::vector<at::Tensor> ad;  // gate_up's A, B, down's A, B in fp64, leaves
  for (const at::Tensor& t : ex.trainable()) ad.push_back(t.detach().to(at::kDouble).requires_grad_(true));
  const int64_t inter = ex.inter;
  std::vector<at::Tensor> ys;
  for (int64_t t = 0; t < x.size(0); ++t) {
    at::Tensor yt = at::zeros({ex.hidden}, at::kDouble);
    for (int64_t j = 0; j < index.size(1); ++j) {
      const int64_t e = index[t][j].item<int64_t>();
      const at::Tensor xt = x64[t];
      at::Tensor gu = at::mv(base64(ex, e, true), xt);
      const int64_t E = ex.num_experts;
      if (!ad.empty()) gu = gu + at::mv(b_of(ad[1], E, e), at::mv(a_of(ad[0], E, e), xt)) * ex.scale;
      if (ex.gate_up_bias.defined()) gu = gu + ex.gate_up_bias[e].to(at::kDouble);
      const at::Tensor act = reference_act(ex, activation, gu.narrow(0, 0, inter), gu.narrow(0, inter, inter));
      at::Tensor out = at::mv(base64(ex, e, false), act);
      if (!ad.empty()) out = out + at::mv(b_of(ad[3], E, e), at::mv(a_of(ad[2], E, e), act)) * ex.scale;
      if (ex.down_bias.defined()) out = out + ex.down_bias[e].to(at::kDouble);
      yt = yt + w64[t][j] * out;
    }
    ys.push_back(yt);
  }
  const at::Tensor y = at::stack(ys);
  (y * grad.to(at::kDouble)).sum().backward();
  Grads g{y.detach(), x64.grad(), w64.grad()};
  if (!ad.empty()) {
    g.gu_a = ad[0].grad(), g.gu_b = ad[1].grad(), g.down_a = ad[2].grad(), g.down_b = ad[3].grad();
  }
  return g;
}

// grouped_experts on copies of x and weights that require grad; y.backward(grad).
Grads run(const Experts& ex, const at::Tensor& x0, const at::Tensor& index, const at::Tensor& w0,
          const at::Tensor& grad, bool x_grad = true) {
  for (at::Tensor t : ex.trainable()) t.mutable_grad() = at::Tensor();  // a handle to the adapter itself
  const at::Tensor x = x0.clone().requires_grad_(x_grad), w = w0.clone().requires_grad_(true);
  const at::Tensor y = grouped_experts(ex, x, index, w);
  EXPECT_EQ(y.scalar_type(), x0.scalar_type());
  y.backward(grad);
  EXPECT_EQ(w.grad().scalar_type(), w0.scalar_type());
  Grads g{y.detach(), x_grad ? x.grad() : at::Tensor(), w.grad()};
  if (ex.has_lora()) {
    g.gu_a = grad_or_zeros(ex.gate_up_a), g.gu_b = grad_or_zeros(ex.gate_up_b);
    g.down_a = grad_or_zeros(ex.down_a), g.down_b = grad_or_zeros(ex.down_b);
  }
  return g;
}

// Top-k routing of T tokens: k distinct experts per token (a random permutation's first k).
at::Tensor random_index(int64_t tokens, int64_t k, int64_t experts, uint64_t seed) {
  at::Generator gen = seeded(seed);
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < tokens; ++t) rows.push_back(at::randperm(experts, gen, at::kLong).narrow(0, 0, k));
  return at::stack(rows);
}

// Routing weights as a router gives them: a softmax over the k slots.
at::Tensor random_weights(int64_t tokens, int64_t k, uint64_t seed, at::ScalarType dtype) {
  return at::softmax(randn({tokens, k}, seed), 1).to(dtype);
}

void expect_all_close(const Grads& got, const Grads& ref, double tol_y, double tol_grad) {
  EXPECT_LT(rel_err(got.y, ref.y), tol_y);
  if (got.dx.defined()) {
    EXPECT_LT(rel_err(got.dx, ref.dx), tol_grad) << "dx";
  }
  EXPECT_LT(rel_err(got.dw, ref.dw), tol_grad) << "d weights";
  if (ref.gu_a.defined()) {
    EXPECT_LT(rel_err(got.gu_a, ref.gu_a), tol_grad) << "gate_up A";
    EXPECT_LT(rel_err(got.gu_b, ref.gu_b), tol_grad) << "gate_up B";
    EXPECT_LT(rel_err(got.down_a, ref.down_a), tol_grad) << "down A";
    EXPECT_LT(rel_err(got.down_b, ref.down_b), tol_grad) << "down B";
  }
}

// One routing against the reference: `index` [T, k], random x, weights and output gradient.
void expect_matches_reference(const Shape& s, const at::Tensor& index, at::ScalarType w_dtype, double tol_y,
                              double tol_grad) {
  const Experts ex = make_experts(s);
  const int64_t tokens = index.size(0), k = index.size(1);
  const at::Tensor x = randn({tokens, s.hidden}, 20).to(s.dtype);
  const at::Tensor w = random_weights(tokens, k, 21, w_dtype);
  const at::Tensor grad = randn({tokens, s.hidden}, 22).to(s.dtype);
  const Grads got = run(ex, x, index, w, grad);
  expect_all_close(got, reference(ex, x, index, w, grad), tol_y, tol_grad);
  // Deterministic: a second run gives the same bits.
  const Grads again = run(ex, x, index, w, grad);
  EXPECT_TRUE(at::equal(got.y, again.y));
  EXPECT_TRUE(at::equal(got.dx, again.dx));
  EXPECT_TRUE(at::equal(got.dw, again.dw));
}

// 12 tokens, k = 2 over 5 experts, expert 3 receiving none, expert 0 most.
at::Tensor uneven_index() {
  return at::tensor({0, 1, 0, 2, 4, 0, 0, 1, 2, 0, 0, 4, 1, 0, 0, 2, 4, 1, 2, 0, 0, 1, 1, 4}, at::kLong).view({12, 2});
}

// fp32: sums of at most 64 products per GEMM and a few roundings per value leave at most 6e-7 of
// the largest value (measured, every output and gradient); 5e-6 still catches a missing LoRA term
// (~20% of the output), an unweighted adapter gradient or a wrong weight by orders of magnitude.
constexpr double kFp32Tol = 5e-6;
// bf16: x, gate/up, act, y, the weighted slots and the sum are each rounded to 8 bits (2^-9
// relative), and the adapters run on bf16 copies of A and B: a few 2^-9 of the largest value,
// measured up to 0.55% in y and 1.3% in a gradient (down's B); 2e-2 / 3e-2 pass those, not a
// dropped or unweighted term (~10% and more).
constexpr double kBf16TolY = 2e-2, kBf16TolGrad = 3e-2;

}  // namespace

TEST(Experts, Nf4Fp32MatchesFp64Reference) {
  expect_matches_reference({}, uneven_index(), at::kFloat, kFp32Tol, kFp32Tol);
}

TEST(Experts, DenseFp32MatchesFp64Reference) {
  Shape s;
  s.nf4 = false;
  expect_matches_reference(s, uneven_index(), at::kFloat, kFp32Tol, kFp32Tol);
}

// inter 64: every product (gate_up's and down's, forward and backward) in the grouped NF4 kernel,
// which the default shape's inter 32 (rows of half a 64-column tile) leaves to the per-expert path.
TEST(Experts, Nf4Bf16MatchesFp64Reference) {
  Shape s;
  s.dtype = at::kBFloat16;
  s.inter = 64;
  expect_matches_reference(s, uneven_index(), at::kBFloat16, kBf16TolY, kBf16TolGrad);
}

TEST(Experts, DenseBf16WithFp32RoutingWeightsMatchesFp64Reference) {
  Shape s;
  s.dtype = at::kBFloat16;
  s.nf4 = false;
  expect_matches_reference(s, uneven_index(), at::kFloat, kBf16TolY, kBf16TolGrad);
}

// Gemma 4's experts: gelu-tanh(gate) * up, forward and backward (the activation's gradient through
// both halves), NF4 in fp32 and dense in bf16; a SiLU reference is far off (the activation is used).
TEST(Experts, GeluTanhNf4Fp32MatchesFp64Reference) {
  Shape s;
  s.activation = ExpertActivation::kGeluTanh;
  expect_matches_reference(s, uneven_index(), at::kFloat, kFp32Tol, kFp32Tol);
  const Experts ex = make_experts(s);
  const at::Tensor index = uneven_index(), x = randn({12, s.hidden}, 20), w = random_weights(12, 2, 21, at::kFloat);
  const at::Tensor grad = randn({12, s.hidden}, 22);
  const Grads got = run(ex, x, index, w, grad), silu = reference(ex, x, index, w, grad, ExpertActivation::kSwiglu);
  EXPECT_GT(rel_err(got.y, silu.y), 1e-2);
  EXPECT_GT(rel_err(got.dx, silu.dx), 1e-2);
}

TEST(Experts, GeluTanhDenseBf16WithFp32RoutingWeightsMatchesFp64Reference) {
  Shape s;
  s.activation = ExpertActivation::kGeluTanh;
  s.dtype = at::kBFloat16;
  s.nf4 = false;
  expect_matches_reference(s, uneven_index(), at::kFloat, kBf16TolY, kBf16TolGrad);
}

TEST(Experts, WithoutAdaptersMatchesFp64Reference) {
  Shape s;
  s.lora = false;
  expect_matches_reference(s, uneven_index(), at::kFloat, kFp32Tol, kFp32Tol);
}

TEST(Experts, ClampedSwigluWithBiasesMatchesFp64Reference) {  // gpt-oss's experts
  for (bool nf4 : {true, false}) {
    SCOPED_TRACE(nf4);
    Shape s;
    s.gpt_oss = true;
    s.nf4 = nf4;
    expect_matches_reference(s, uneven_index(), at::kFloat, kFp32Tol, kFp32Tol);
    // bf16 at gpt-oss's own limit (7), which these activations never reach: at 0.5 a gate or up that
    // rounds to the other side of the limit than its fp64 value gets the other gradient (0 or all of
    // it), one element of which moves the max-norm error past any bf16 tolerance (measured 7.7% in dx).
    s.dtype = at::kBFloat16;
    s.limit = 7.0;
    expect_matches_reference(s, uneven_index(), at::kBFloat16, kBf16TolY, kBf16TolGrad);
  }
}

TEST(Experts, OneExpertTakesAllTokensWithK1) {
  expect_matches_reference({}, at::full({9, 1}, 2, at::kLong), at::kFloat, kFp32Tol, kFp32Tol);
}

TEST(Experts, RandomTopKRoutingsMatchFp64Reference) {
  for (int64_t k : {1, 3, 5}) {  // k = E: every expert takes every token
    SCOPED_TRACE(k);
    expect_matches_reference({}, random_index(7, k, 5, 30 + k), at::kFloat, kFp32Tol, kFp32Tol);
  }
}

TEST(Experts, FrozenInputStillTrainsTheAdapters) {
  const Experts ex = make_experts({});
  const at::Tensor index = uneven_index(), x = randn({12, 64}, 40), w = random_weights(12, 2, 41, at::kFloat);
  const at::Tensor grad = randn({12, 64}, 42);
  const Grads got = run(ex, x, index, w, grad, /*x_grad=*/false);
  EXPECT_FALSE(got.dx.defined());
  expect_all_close(got, reference(ex, x, index, w, grad), kFp32Tol, kFp32Tol);
}

// The routing weight's gradient is <g_t, y_tj>, whatever the weight: a slot of weight 0 still gets it
// (a backward that divided the weighted gradient by the weight would give NaN there).
TEST(Experts, ZeroWeightSlotGetsItsGradient) {
  const Experts ex = make_experts({});
  const at::Tensor index = uneven_index(), x = randn({12, 64}, 50), grad = randn({12, 64}, 52);
  at::Tensor w = random_weights(12, 2, 51, at::kFloat);
  w.index_put_({at::indexing::Slice(0, 12, 3), 1}, 0.0);  // every third token's second slot
  w[5][0].fill_(0.0);
  const Grads got = run(ex, x, index, w, grad), ref = reference(ex, x, index, w, grad);
  expect_all_close(got, ref, kFp32Tol, kFp32Tol);
  EXPECT_TRUE(at::isfinite(got.dw).all().item<bool>());
  for (const at::Tensor& z : {got.dw.index({at::indexing::Slice(0, 12, 3), 1}), got.dw[5][0].unsqueeze(0)}) {
    EXPECT_GT(z.abs().min().item<double>(), 1e-3);  // nonzero, as <g, y> is
  }
  EXPECT_LT(rel_err(got.dw[5][0], ref.dw[5][0]), 1e-4);
}

// An expert that receives no token is never touched: with its NF4 buffers broken (which any
// dequantize rejects), forward and backward run and give the same bits as with them whole.
TEST(Experts, ExpertsWithoutTokensAreNeverDequantized) {
  const Experts whole = make_experts({});
  Experts broken = make_experts({});
  for (std::vector<Nf4Tensor>* ws : {&broken.gate_up_nf4, &broken.down_nf4})
    (*ws)[3].codes = at::empty({0}, at::kByte);  // expert 3: no token in uneven_index()
  const at::Tensor index = uneven_index(), x = randn({12, 64}, 60), w = random_weights(12, 2, 61, at::kFloat);
  const at::Tensor grad = randn({12, 64}, 62);
  const Grads a = run(whole, x, index, w, grad), b = run(broken, x, index, w, grad);
  using Pair = std::pair<at::Tensor, at::Tensor>;
  for (const Pair& p : std::initializer_list<Pair>{{a.y, b.y}, {a.dx, b.dx}, {a.dw, b.dw}, {a.gu_a, b.gu_a},
                                                  {a.gu_b, b.gu_b}, {a.down_a, b.down_a}, {a.down_b, b.down_b}})
    EXPECT_TRUE(at::equal(p.first, p.second));
  const at::Tensor expert3 = a_of(b.gu_a, Shape{}.experts, 3);
  EXPECT_TRUE(at::equal(expert3, at::zeros_like(expert3)));  // no token, no gradient
  // The check can fail: a token sent to expert 3 does reach its broken weights.
  at::Tensor to3 = index.clone();
  to3[4][1] = 3;
  EXPECT_THROW(run(broken, x, to3, w, grad), std::invalid_argument);
}

// transformers' combine, to the bit: each slot's output in x's dtype times its weight in the promoted
// dtype (rounded there), the slots summed in fp32, rounded once. Each slot's output is read from the
// same routing with the other slots' weights 0 (y * 1 + y' * 0 is y exactly).
TEST(Experts, CombineRoundsAsTransformers) {
  Shape s;
  s.dtype = at::kBFloat16;
  const Experts ex = make_experts(s);
  const at::Tensor index = random_index(10, 3, 5, 70), x = randn({10, 64}, 71).to(at::kBFloat16);
  for (at::ScalarType wt : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(wt));
    const at::Tensor w = random_weights(10, 3, 72, wt);
    std::vector<at::Tensor> slots;
    for (int64_t j = 0; j < 3; ++j) {
      const at::Tensor one_hot = at::zeros({10, 3}, wt).index_fill_(1, at::tensor({j}, at::kLong), 1.0);
      slots.push_back(grouped_experts(ex, x, index, one_hot).detach());
    }
    const at::Tensor y_slots = at::stack(slots, 1);  // [T, k, hidden] bf16
    const at::Tensor expected = (y_slots * w.unsqueeze(2)).sum(1).to(at::kBFloat16);
    EXPECT_TRUE(at::equal(grouped_experts(ex, x, index, w).detach(), expected));
    // And not the other rounding: one bf16 sum of bf16-rounded products differs somewhere.
    if (wt == at::kFloat) {
      const at::Tensor other = (y_slots * w.unsqueeze(2)).to(at::kBFloat16).sum(1);
      EXPECT_FALSE(at::equal(other, expected));
    }
  }
}

TEST(Experts, AddAdaptersDrawsAsPeftStacksThem) {
  Shape s;
  s.lora = false;
  Experts ex = make_experts(s);
  experts_add_adapters(ex, 3, 1.5, seeded(80), at::kCPU);
  EXPECT_EQ(ex.r, 3);
  EXPECT_EQ(ex.scale, 1.5);
  ASSERT_EQ(ex.trainable().size(), 4u);
  for (const at::Tensor& t : ex.trainable()) {
    EXPECT_TRUE(t.requires_grad());
    EXPECT_TRUE(t.is_leaf());
    EXPECT_EQ(t.scalar_type(), at::kFloat);
  }
  // peft's lora_A [r * E, in] and lora_B [out, r * E].
  EXPECT_EQ(ex.gate_up_a.sizes().vec(), (std::vector<int64_t>{15, 64}));
  EXPECT_EQ(ex.gate_up_b.sizes().vec(), (std::vector<int64_t>{64, 15}));
  EXPECT_EQ(ex.down_a.sizes().vec(), (std::vector<int64_t>{15, 32}));
  EXPECT_EQ(ex.down_b.sizes().vec(), (std::vector<int64_t>{64, 15}));
  EXPECT_TRUE(at::equal(ex.gate_up_b, at::zeros_like(ex.gate_up_b)));
  EXPECT_TRUE(at::equal(ex.down_b, at::zeros_like(ex.down_b)));
  // gate_up's stacked A, then down's, each drawn whole as lora_linear_add_adapter draws a LoRA A of
  // r * E rows (peft's nn.Linear(in, r * E) under kaiming_uniform: the bound is 1/sqrt(in)).
  at::Generator gen = seeded(80);
  using Draw = std::pair<at::Tensor, int64_t>;  // the stacked A's, their in_features
  for (const auto& [a, in] : std::initializer_list<Draw>{{ex.gate_up_a, 64}, {ex.down_a, 32}}) {
    LoraLinear one = lora_linear_dense(at::zeros({7, in}));
    lora_linear_add_adapter(one, 15, 1.0, 0.0, gen, at::kCPU);
    EXPECT_TRUE(at::equal(a, one.lora_a)) << "in " << in;
  }
  // B = 0: the adapted experts compute their bases exactly.
  const at::Tensor index = uneven_index(), x = randn({12, 64}, 81), w = random_weights(12, 2, 82, at::kFloat);
  EXPECT_TRUE(at::equal(grouped_experts(ex, x, index, w), grouped_experts(make_experts(s), x, index, w)));
}

TEST(Experts, AdaptersDisabledComputesTheBases) {
  Shape s;
  const Experts ex = make_experts(s);
  s.lora = false;
  const Experts bases = make_experts(s);
  const at::Tensor index = uneven_index(), x = randn({12, 64}, 90), w = random_weights(12, 2, 91, at::kFloat);
  const AdaptersDisabled off;
  EXPECT_TRUE(at::equal(grouped_experts(ex, x, index, w), grouped_experts(bases, x, index, w)));
}

// The merged weights are W + scale * B[e] @ A[e] in lora_merged_weight's form, and dense experts of
// them compute what the adapted ones do.
TEST(Experts, MergedWeightsComputeTheAdaptedExperts) {
  Shape s;
  s.nf4 = false;
  const Experts ex = make_experts(s);
  std::vector<at::Tensor> gu, down;
  for (int64_t e = 0; e < s.experts; ++e) {
    const at::Tensor m = experts_merged_gate_up(ex, e, ex.gate_up_dense[e]);
    const at::Tensor delta = at::matmul(b_of(ex.gate_up_b, s.experts, e), a_of(ex.gate_up_a, s.experts, e)).detach();
    EXPECT_TRUE(at::equal(m, ex.gate_up_dense[e].add(delta, 2.0)));
    gu.push_back(m);
    down.push_back(experts_merged_down(ex, e, ex.down_dense[e]));
  }
  const Experts merged = experts_dense(gu, down);
  const at::Tensor index = uneven_index(), x = randn({12, 64}, 95), w = random_weights(12, 2, 96, at::kFloat);
  EXPECT_LT(rel_err(grouped_experts(merged, x, index, w), grouped_experts(ex, x, index, w)), kFp32Tol);
  Shape bare = s;
  bare.lora = false;
  EXPECT_THROW(experts_merged_down(make_experts(bare), 0, ex.down_dense[0]), std::invalid_argument);
}

TEST(Experts, RejectsBadInputs) {
  const Experts ex = make_experts({});
  const at::Tensor x = randn({4, 64}, 1), w = random_weights(4, 2, 2, at::kFloat);
  const at::Tensor index = at::zeros({4, 2}, at::kLong);
  EXPECT_THROW(grouped_experts(ex, x, at::full_like(index, 5), w), std::invalid_argument);  // E = 5
  EXPECT_THROW(grouped_experts(ex, x, index.to(at::kInt), w), std::invalid_argument);      // int32
  EXPECT_THROW(grouped_experts(ex, x.narrow(1, 0, 32), index, w), std::invalid_argument);  // hidden
  EXPECT_THROW(grouped_experts(ex, x, index, w.narrow(1, 0, 1)), std::invalid_argument);   // weights' shape
  EXPECT_THROW(experts_dense({at::zeros({6, 4})}, {at::zeros({4, 4})}), std::invalid_argument);  // down [4, 3]
  EXPECT_THROW(experts_dense({at::zeros({6, 4})}, {}), std::invalid_argument);
  EXPECT_NO_THROW(experts_dense({at::zeros({6, 4})}, {at::zeros({4, 3})}));
  Experts biased = make_experts({});
  biased.down_bias = at::zeros({5, 63});  // [E, hidden] is [5, 64]
  EXPECT_THROW(grouped_experts(biased, x, index, w), std::invalid_argument);
  biased.down_bias = at::Tensor();
  biased.gate_up_bias = at::zeros({4, 64});  // [E, 2 * inter] is [5, 64]
  EXPECT_THROW(grouped_experts(biased, x, index, w), std::invalid_argument);
}

namespace {

// The experts on `device`: NF4 buffers copied, adapters copied as new leaves.
Experts experts_on(const Experts& ex, at::Device device) {
  Experts d = ex;
  for (Nf4Tensor& w : d.gate_up_nf4) w = w.to(device);
  for (Nf4Tensor& w : d.down_nf4) w = w.to(device);
  for (at::Tensor* t : {&d.gate_up_a, &d.gate_up_b, &d.down_a, &d.down_b})
    *t = t->detach().to(device).requires_grad_(true);
  for (at::Tensor* t : {&d.gate_up_bias, &d.down_bias})
    if (t->defined()) *t = t->to(device);
  return d;
}

}  // namespace

// The CUDA path against the CPU path on the same numbers (skipped without a CUDA device). Only the
// order of the GEMMs' sums differs (NF4 dequantizes to the same bits on both): fp32 (no TF32) to
// ~1e-6, 2e-5 allowed; bf16 roundings at other places in the sums, 3e-2 allowed (as
// test_cuda_parity.cpp's one-layer tolerances).
TEST(Experts, CountsAreTheValidTokensSlots) {  // router statistics: padding is not counted
  modules::Routing r;
  r.index = at::tensor({0, 2, 2, 1, 3, 2}, at::kLong).view({3, 2});  // 3 tokens, k 2
  EXPECT_TRUE(at::equal(modules::expert_counts(r, 4), at::tensor({1, 1, 3, 1}, at::kLong)));
  const at::Tensor valid = at::tensor({1, 0, 1}, at::kLong).to(at::kBool).view({1, 3});  // [batch, seq]: token 1 padding
  EXPECT_TRUE(at::equal(modules::expert_counts(r, 4, valid), at::tensor({1, 0, 2, 1}, at::kLong)));
  EXPECT_THROW(modules::expert_counts(r, 4, at::ones({2}, at::kBool)), std::invalid_argument);
}

TEST(Experts, CudaMatchesCpu) {
  if (!(at::hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0)) GTEST_SKIP() << "no CUDA device";
  const at::Device gpu(at::kCUDA, 0);
  for (const auto& [dt, gpt_oss] : {std::pair{at::kFloat, false}, std::pair{at::kBFloat16, false},
                                    std::pair{at::kFloat, true}, std::pair{at::kBFloat16, true}}) {
    SCOPED_TRACE(std::string(c10::toString(dt)) + (gpt_oss ? " gpt-oss" : ""));
    Shape s;
    s.dtype = dt;
    s.gpt_oss = gpt_oss;
    const Experts cpu = make_experts(s), cuda = experts_on(cpu, gpu);
    const at::Tensor index = uneven_index(), x = randn({12, 64}, 100).to(dt), grad = randn({12, 64}, 102).to(dt);
    const at::Tensor w = random_weights(12, 2, 101, at::kFloat);
    const Grads a = run(cpu, x, index, w, grad), b = run(cuda, x.to(gpu), index.to(gpu), w.to(gpu), grad.to(gpu));
    const double tol = dt == at::kFloat ? 2e-5 : 3e-2;
    using Pair = std::pair<at::Tensor, at::Tensor>;
    for (const Pair& p : std::initializer_list<Pair>{{a.y, b.y}, {a.dx, b.dx}, {a.dw, b.dw}, {a.gu_a, b.gu_a},
                                                    {a.gu_b, b.gu_b}, {a.down_a, b.down_a}, {a.down_b, b.down_b}})
      EXPECT_LT(rel_err(p.second.cpu(), p.first), tol);
  }
}
