// The chunked gated delta rule (ops/gated_delta_ops.h) against the recurrent definition written here
// token by token in float64 (transformers' torch_recurrent_gated_delta_rule states it), values and
// autograd gradients of q, k, v, g, beta and the initial state: sequence lengths around the chunk
// size, grouped key heads, dk != dv, with and without an initial state, fp32 and bf16 inputs; and,
// where a CUDA device is present, the op on CUDA against the same op on the CPU.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>
#include <vector>

#include "qlora/ops/gated_delta_ops.h"

namespace qlora {
namespace {

struct Case {
  int64_t batch, seq, k_heads, v_heads, dk, dv;
  bool state0, l2;
  at::ScalarType dtype;
  double g_scale;  // how strong the decay is: g = -g_scale * softplus(randn)
};

std::string name_of(const Case& c) {
  return "b" + std::to_string(c.batch) + "_t" + std::to_string(c.seq) + "_h" + std::to_string(c.k_heads) + "x" +
         std::to_string(c.v_heads) + "_dk" + std::to_string(c.dk) + "_dv" + std::to_string(c.dv) +
         (c.state0 ? "_s0" : "") + (c.l2 ? "" : "_nol2") + (c.dtype == at::kBFloat16 ? "_bf16" : "_f32") +
         (c.g_scale > 1.0 ? "_strongdecay" : c.g_scale < 1.0 ? "_weakdecay" : "");
}

at::Tensor rnd(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::TensorOptions().dtype(at::kFloat));
}

struct Inputs {
  at::Tensor q, k, v, g, beta, state0;  // as the op takes them (the case's dtype; g fp32, as Qwen3.5 computes it)
};

Inputs make_inputs(const Case& c) {
  Inputs in;
  in.q = rnd({c.batch, c.seq, c.k_heads, c.dk}, 1).to(c.dtype);
  // Without the L2 norm the delta rule is stable only for beta |k|^2 < 2: keep |k| near 0.5.
  in.k = (rnd({c.batch, c.seq, c.k_heads, c.dk}, 2) * (c.l2 ? 1.0 : 0.5 / std::sqrt(double(c.dk)))).to(c.dtype);
  in.v = rnd({c.batch, c.seq, c.v_heads, c.dv}, 3).to(c.dtype);
  in.g = -at::softplus(rnd({c.batch, c.seq, c.v_heads}, 4)) * c.g_scale;
  in.beta = at::sigmoid(rnd({c.batch, c.seq, c.v_heads}, 5)).to(c.dtype);
  if (c.state0) in.state0 = rnd({c.batch, c.v_heads, c.dk, c.dv}, 6) * 0.5;
  return in;
}

// The definition, token by token, in float64 on the op's own (possibly bf16-rounded) inputs.
std::pair<at::Tensor, at::Tensor> recurrent_reference(const Inputs& in, bool l2) {
  const auto l2norm = [&](const at::Tensor& x) { return l2 ? x * at::rsqrt(x.square().sum(-1, true) + 1e-6) : x; };
  const int64_t rep = in.v.size(2) / in.q.size(2), dk = in.q.size(3);
  at::Tensor q = (l2norm(in.q) / std::sqrt(double(dk))).repeat_interleave(rep, 2).transpose(1, 2);  // [b, h, T, dk]
  at::Tensor k = l2norm(in.k).repeat_interleave(rep, 2).transpose(1, 2);
  const at::Tensor v = in.v.transpose(1, 2), g = in.g.transpose(1, 2), beta = in.beta.transpose(1, 2);
  at::Tensor s = in.state0.defined() ? in.state0
                                     : at::zeros({v.size(0), v.size(1), dk, v.size(3)}, v.options());  // [b, h, dk, dv]
  std::vector<at::Tensor> out;
  for (int64_t t = 0; t < v.size(2); ++t) {
    const at::Tensor qt = q.select(2, t), kt = k.select(2, t);  // [b, h, dk]
    s = s * g.select(2, t).exp().unsqueeze(-1).unsqueeze(-1);
    const at::Tensor kv = (s * kt.unsqueeze(-1)).sum(-2);  // S^T k  [b, h, dv]
    const at::Tensor delta = (v.select(2, t) - kv) * beta.select(2, t).unsqueeze(-1);
    s = s + kt.unsqueeze(-1) * delta.unsqueeze(-2);
    out.push_back((s * qt.unsqueeze(-1)).sum(-2));
  }
  return {at::stack(out, 1), s};  // [b, T, h, dv]
}

std::vector<at::Tensor> leaves(const Inputs& in, at::ScalarType dtype) {
  std::vector<at::Tensor> l;
  for (const at::Tensor& t : {in.q, in.k, in.v, in.g, in.beta, in.state0})
    if (t.defined()) l.push_back(t.detach().to(dtype == at::kDouble ? at::kDouble : t.scalar_type()).requires_grad_());
  return l;
}

Inputs from_leaves(const std::vector<at::Tensor>& l) {
  return {l[0], l[1], l[2], l[3], l[4], l.size() > 5 ? l[5] : at::Tensor()};
}

// |got - want| <= tol * max |want| over the whole tensor: the chunked form sums in another order
// than the recurrence, so the error is relative to the tensor's scale, not to each element.
void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = want.abs().max().item<double>();
  const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what << ": max error " << err << " against max |want| " << scale;
}

class GatedDelta : public ::testing::TestWithParam<Case> {};

TEST_P(GatedDelta, ValuesAndGradientsMatchFloat64Recurrence) {
  const Case c = GetParam();
  const Inputs in = make_inputs(c);
  const std::vector<at::Tensor> ours = leaves(in, c.dtype), ref = leaves(in, at::kDouble);
  const Inputs a = from_leaves(ours), b = from_leaves(ref);
  const auto [out, fin] = ops::chunk_gated_delta_rule(a.q, a.k, a.v, a.g, a.beta, a.state0, true, c.l2);
  const auto [want_out, want_fin] = recurrent_reference(b, c.l2);
  ASSERT_EQ(out.scalar_type(), c.dtype);
  ASSERT_EQ(fin.scalar_type(), at::kFloat);
  // fp32: the chunked sums and the per-chunk triangular inverse differ from the recurrence by fp32
  // rounding grown over <= 200 steps: <= 3e-6 of the scale measured, 1e-4 allowed.
  // bf16: the inputs are the same bf16 values on both sides, so what remains is the output's one
  // rounding to bf16 (2^-9 relative, <= 4e-3 of the scale measured): 1e-2.
  const double tol = c.dtype == at::kBFloat16 ? 1e-2 : 1e-4;
  expect_close(out, want_out, tol, "out");
  expect_close(fin, want_fin, 1e-4, "final state (fp32 in both dtypes)");
  // One backward through both outputs, with random weights so that no gradient cancels by symmetry.
  const at::Tensor w_out = rnd(out.sizes(), 7), w_fin = rnd(fin.sizes(), 8);
  const at::Tensor loss = (out.to(at::kFloat) * w_out).sum() + (fin * w_fin).sum();
  const at::Tensor want_loss = (want_out * w_out.to(at::kDouble)).sum() + (want_fin * w_fin.to(at::kDouble)).sum();
  const auto grads = torch::autograd::grad({loss}, ours);
  const auto want_grads = torch::autograd::grad({want_loss}, ref);
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dstate0"};
  for (size_t i = 0; i < grads.size(); ++i) {
    ASSERT_EQ(grads[i].scalar_type(), ours[i].scalar_type()) << names[i];
    // bf16 gradients are rounded once to bf16 (2^-9) after fp32 sums (<= 4e-3 measured): 1e-2.
    // fp32: 2e-4, since backward chains more products (dg, a sum over the rest of the chunk of
    // terms that cancel, is the worst: <= 2e-5 measured).
    expect_close(grads[i], want_grads[i], c.dtype == at::kBFloat16 ? 1e-2 : 2e-4, names[i]);
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  constexpr int64_t c = ops::kGatedDeltaChunk;
  for (int64_t seq : {int64_t{1}, c - 1, c, c + 1, int64_t{200}})
    for (bool state0 : {false, true}) all.push_back({2, seq, 2, 4, 16, 32, state0, true, at::kFloat, 1.0});
  for (int64_t seq : {int64_t{1}, c + 1, int64_t{200}}) all.push_back({2, seq, 2, 4, 16, 32, true, true, at::kBFloat16, 1.0});
  all.push_back({1, 130, 3, 3, 32, 8, false, true, at::kFloat, 1.0});   // no grouping, dv < dk
  all.push_back({1, 70, 1, 2, 128, 128, true, true, at::kFloat, 1.0});  // Qwen3.5's head dims
  all.push_back({1, 100, 2, 2, 16, 16, true, false, at::kFloat, 1.0});  // no L2 norm
  all.push_back({1, 150, 1, 2, 16, 16, true, true, at::kFloat, 20.0});  // decay to ~0 within a chunk
  all.push_back({1, 600, 1, 2, 16, 8, true, true, at::kFloat, 0.05});  // across the blocks of 8 chunks
  return all;
}

INSTANTIATE_TEST_SUITE_P(Cases, GatedDelta, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return name_of(i.param); });

// The op is ATen calls only, so it runs on CUDA as it is: there it must agree with the CPU. fp32: no
// TF32 (torch's default for matmul), so only the GEMMs' summation order differs: 1e-4 of the scale.
// bf16: the same bf16 inputs on both sides and fp32 inside; the output's one bf16 rounding (2^-9)
// may fall either way: 1e-2.
TEST(GatedDeltaOp, CudaEqualsCpu) {
  if (!at::hasCUDA() || at::detail::getCUDAHooks().deviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const Case c{1, 300, 2, 4, 128, 128, true, true, dt, 1.0};
    const Inputs in = make_inputs(c);
    std::vector<at::Tensor> cpu = leaves(in, dt), gpu;
    for (const at::Tensor& t : cpu) gpu.push_back(t.detach().to(at::kCUDA).requires_grad_());
    const Inputs a = from_leaves(cpu), b = from_leaves(gpu);
    const auto [out, fin] = ops::chunk_gated_delta_rule(a.q, a.k, a.v, a.g, a.beta, a.state0, true, c.l2);
    const auto [gout, gfin] = ops::chunk_gated_delta_rule(b.q, b.k, b.v, b.g, b.beta, b.state0, true, c.l2);
    const double tol = dt == at::kBFloat16 ? 1e-2 : 1e-4;
    expect_close(gout.cpu(), out.to(at::kDouble), tol, "out");
    expect_close(gfin.cpu(), fin.to(at::kDouble), 1e-4, "final state");
    const at::Tensor w_out = rnd(out.sizes(), 7), w_fin = rnd(fin.sizes(), 8);
    const auto grads = torch::autograd::grad({(out.to(at::kFloat) * w_out).sum() + (fin * w_fin).sum()}, cpu);
    const auto ggrads = torch::autograd::grad(
        {(gout.to(at::kFloat) * w_out.to(at::kCUDA)).sum() + (gfin * w_fin.to(at::kCUDA)).sum()}, gpu);
    for (size_t i = 0; i < grads.size(); ++i)
      expect_close(ggrads[i].cpu(), grads[i].to(at::kDouble), dt == at::kBFloat16 ? 1e-2 : 2e-4,
                   "gradient " + std::to_string(i));
  }
}

TEST(GatedDeltaOp, FinalStateOnlyWhenAskedAndShapesChecked) {
  const Case c{1, 5, 2, 4, 8, 4, false, true, at::kFloat, 1.0};
  const Inputs in = make_inputs(c);
  const auto [out, fin] = ops::chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, {}, false, true);
  EXPECT_EQ(out.sizes(), in.v.sizes());
  EXPECT_FALSE(fin.defined());
  // A g of the wrong length: the error names what was expected.
  try {
    ops::chunk_gated_delta_rule(in.q, in.k, in.v, in.g.narrow(1, 0, 4), in.beta, {}, false, true);
    ADD_FAILURE() << "a g of the wrong length was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("g and beta must be [batch, seq, v_heads]"), std::string::npos) << e.what();
  }
  // Three value heads cannot share two key heads.
  EXPECT_THROW(ops::chunk_gated_delta_rule(in.q, in.k, in.v.narrow(2, 0, 3), in.g.narrow(2, 0, 3),
                                           in.beta.narrow(2, 0, 3), {}, false, true),
               std::invalid_argument);
}

}  // namespace
}  // namespace qlora
