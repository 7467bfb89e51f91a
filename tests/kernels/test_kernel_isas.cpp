// Every vector kernel on every ISA path this machine has (forced in-process with ScopedIsaCap,
// below QLORA_CPU_ISA if that is set), in fp32 and bf16, against float64 on the same (rounded)
// inputs; NF4 dequantize bit for bit against the reference. Paths the CPU lacks are skipped by
// name. Tolerances sit beside each check with their reason.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <tuple>

#include "kernels/cpu_isa.h"
#include "qlora/ops/decode_attention_ops.h"
#include "qlora/ops/decode_matmul_ops.h"
#include "qlora/ops/grouped_matmul_ops.h"
#include "qlora/ops/narrow_ops.h"
#include "qlora/ops/nf4_ops.h"
#include "qlora/ops/rmsnorm_ops.h"
#include "qlora/ops/rope_ops.h"
#include "qlora/ops/softmax_ops.h"
#include "qlora/ops/swiglu_ops.h"
#include "quant/nf4_tensor.h"

namespace qlora {
namespace {

using kernels::CpuIsa;

// One bf16 rounding: a relative error of at most 2^-9, 2^-8 leaves room for the fp32 work before it.
constexpr double kBf16Rel = 1.0 / 256;

at::Tensor rnd(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype, double scale = 1.0) {
  return (at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::TensorOptions().dtype(at::kFloat)) *
          scale)
      .to(dtype);
}

at::Tensor f64(const at::Tensor& t) { return t.to(at::kDouble); }

// |got - want| <= rel |want| + abs_of_max max |want| elementwise.
void expect_near(const at::Tensor& got, const at::Tensor& want, double rel, double abs_of_max, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor err = (f64(got) - want).abs() - want.abs() * rel - want.abs().max() * abs_of_max;
  EXPECT_LE(err.max().item<double>(), 0.0) << what;
}

class KernelIsas : public ::testing::TestWithParam<std::tuple<CpuIsa, at::ScalarType>> {
 protected:
  void SetUp() override {
    const CpuIsa isa = std::get<0>(GetParam());
    if (isa > kernels::active_isa())
      GTEST_SKIP() << "ISA " << kernels::isa_name(isa) << " not available here (this CPU or QLORA_CPU_ISA gives "
                   << kernels::isa_name(kernels::active_isa()) << ")";
    cap_ = std::make_unique<kernels::ScopedIsaCap>(isa);
    ASSERT_EQ(kernels::active_isa(), isa);
  }
  at::ScalarType dtype() const { return std::get<1>(GetParam()); }
  bool bf16() const { return dtype() == at::kBFloat16; }
  // fp32: sums of up to ~1000 products in another order than float64, ~1e-6 of their scale.
  // bf16: plus the one rounding of each output.
  double rel() const { return bf16() ? kBf16Rel : 1e-6; }

 private:
  std::unique_ptr<kernels::ScopedIsaCap> cap_;
};

TEST_P(KernelIsas, NarrowProductsMatchFloat64) {
  for (auto [T, K, R] : {std::tuple<int64_t, int64_t, int64_t>{37, 203, 11}, {64, 768, 16}, {5, 3, 1}}) {
    const std::string what = std::string(c10::toString(dtype())) + " T=" + std::to_string(T) + " K=" + std::to_string(K);
    const at::Tensor x = rnd({T, K}, 1, dtype()), a = rnd({R, K}, 2, dtype()), u = rnd({T, R}, 3, dtype());
    // Sums of K products of unit normals: the error scales with max |want| (1e-5 of it), not each |want|.
    expect_near(ops::narrow_product(x, a.t(), 0.5), f64(x).mm(f64(a).t()) * 0.5, rel(), 1e-5, "x @ a^T, " + what);
    expect_near(ops::narrow_reduction(u, x, 0.5), f64(u).t().mm(f64(x)) * 0.5, rel(), 1e-5, "u^T x, " + what);
    at::Tensor y = rnd({T, K}, 4, dtype());
    const at::Tensor want = f64(y) + f64(u).mm(f64(a)) * 0.5;
    ops::narrow_update_(y, u, a, 0.5);
    expect_near(y, want, rel(), 1e-5, "y += u a, " + what);
  }
}

TEST_P(KernelIsas, SoftmaxesMatchFloat64) {
  const int64_t heads = 3, nq = 7, keys = 45;
  const at::Tensor s = rnd({heads, nq, keys}, 5, dtype(), 4.0);
  const at::Tensor future = at::ones({nq, keys}, at::kBool).triu_(keys - nq + 1);
  const at::Tensor masked = f64(s).masked_fill(future, -INFINITY);
  at::Tensor p = s.clone(), lse = at::empty({heads, nq});
  ops::causal_softmax_(p, lse);
  // exp within 2 ulp and 45-term sums: 4e-6 of each value plus 1e-7 of the row's largest.
  expect_near(p, at::softmax(masked, -1), bf16() ? kBf16Rel : 4e-6, 1e-7, "probabilities");
  expect_near(lse, at::logsumexp(masked, -1), 4e-6, 1e-7, "log-sum-exp (fp32 either way)");

  const at::Tensor dp = rnd({heads, nq, keys}, 6, dtype()), delta = rnd({heads, nq}, 7, at::kFloat);
  at::Tensor ds = dp.clone();
  ops::softmax_backward_(ds, p, delta);
  // One fp32 subtraction and product per element: 1e-6 of the largest |dp - delta| terms.
  expect_near(ds, f64(p) * (f64(dp) - f64(delta).unsqueeze(-1)), rel(), 1e-6, "softmax gradient");

  const at::Tensor z = rnd({9, 37}, 8, dtype(), 3.0);
  at::Tensor m = at::full({9, 1}, 0.5f), sum = at::full({9, 1}, 2.0f), pz = at::empty_like(z);
  const at::Tensor m_new = at::maximum(f64(m), at::amax(f64(z), 1, true));
  const at::Tensor want_s = f64(sum) * (f64(m) - m_new).exp() + (f64(z) - m_new).exp().sum(1, true);
  ops::online_softmax_(z, pz, m, sum);
  expect_near(pz, (f64(z) - m_new).exp(), bf16() ? kBf16Rel : 4e-6, 1e-7, "online p");
  expect_near(sum, want_s, 4e-6, 0, "online running sum (fp32 either way)");
}

TEST_P(KernelIsas, RopeMatchesFloat64) {
  const int64_t B = 2, H = 3, S = 5, d = 38;  // half = 19: a vector tail on every ISA
  const at::Tensor x = rnd({B, H, S, d}, 9, dtype()), ang = rnd({S, d}, 10, at::kFloat);
  const at::Tensor c = ang.cos().to(dtype()), s = ang.sin().to(dtype());
  for (double sign : {-1.0, 1.0}) {
    const at::Tensor xd = f64(x), cd = f64(c), sd = f64(s);
    at::Tensor want = xd * cd;
    want.narrow(-1, 0, d / 2).add_(xd.narrow(-1, d / 2, d / 2) * sd.narrow(-1, 0, d / 2) * sign);
    want.narrow(-1, d / 2, d / 2).sub_(xd.narrow(-1, 0, d / 2) * sd.narrow(-1, d / 2, d / 2) * sign);
    // Two products and a sum that may cancel: error up to ~1e-7 of max |x|, not of each |want|.
    expect_near(ops::rope(x, c, s, sign, sign > 0), want, bf16() ? kBf16Rel : 1e-6, 1e-6,
                "sign " + std::to_string(sign));
  }
}

TEST_P(KernelIsas, SwigluMatchesFloat64) {
  const at::Tensor g = rnd({6, 77}, 11, dtype(), 3.0), u = rnd({6, 77}, 12, dtype()), gr = rnd({6, 77}, 13, dtype());
  const at::Tensor gd = f64(g), sig = gd.sigmoid();
  // exp within 2 ulp, one division and a few products: 4e-6 of each value (plus bf16's rounding).
  const double r = bf16() ? kBf16Rel : 4e-6;
  expect_near(ops::swiglu(g, u), gd * sig * f64(u), r, 1e-7, "forward");
  auto [dg, du] = ops::swiglu_backward(gr, g, u);
  expect_near(du, f64(gr) * gd * sig, r, 1e-7, "du");
  // 1 + g (1 - s) cancels near g = -1.28: 1e-6 of the largest |dg| covers it.
  expect_near(dg, f64(gr) * f64(u) * sig * (1 + gd * (1 - sig)), r, 1e-6, "dg");
}

TEST_P(KernelIsas, RmsNormMatchesFloat64) {
  const int64_t n = 77;  // a vector tail on every ISA
  const at::Tensor x = rnd({2, 5, n}, 15, dtype(), 2.0), w = rnd({n}, 16, dtype()), gr = rnd({2, 5, n}, 17, dtype());
  const double eps = 1e-6;
  using kernels::RmsScale;
  for (RmsScale scale : {RmsScale::kWeight, RmsScale::kOnePlusWeight, RmsScale::kWeightFp32}) {
    const bool plus_one = scale == RmsScale::kOnePlusWeight, rounded = scale == RmsScale::kWeight;
    const std::string what = plus_one ? " (1 + w)" : rounded ? " (w)" : " (w, fp32)";
    const at::Tensor xd = f64(x), wd = plus_one ? f64(w) + 1.0 : f64(w);
    const at::Tensor rstd = (xd.pow(2).mean(-1, true) + eps).rsqrt();
    auto [y, r] = ops::rms_norm(x, w, eps, scale);
    // A sum of 77 squares and a square root: 1e-6 of rstd.
    expect_near(r, rstd, 1e-6, 0, "rstd" + what);
    // bf16 in Llama's form rounds x * rstd before w multiplies it (transformers' order): two roundings.
    expect_near(y, xd * rstd * wd, bf16() ? (rounded ? 2 : 1) * kBf16Rel : 1e-6, 0, "forward" + what);
    const at::Tensor gw = f64(gr) * wd;
    const at::Tensor want = gw * rstd - xd * rstd.pow(3) * (gw * xd).mean(-1, true);
    // gw rstd - x c cancels: 1e-6 of the row's largest terms.
    expect_near(ops::rms_norm_backward(gr, x, w, r, scale), want, rel(), 1e-6, "backward" + what);
  }
}

// NF4 dequantize is exact on every path: the reference's values, bit for bit, into either dtype.
TEST_P(KernelIsas, Nf4DequantizeMatchesReferenceExactly) {
  at::manual_seed(14);
  const at::Tensor w = (at::randn({96, 130}) * 0.02).to(dtype());  // 12480 = 195 blocks of 64
  const Nf4Tensor q = nf4_quantize_reference(w, "w");
  for (at::ScalarType out : {at::kFloat, at::kBFloat16})
    EXPECT_TRUE(at::equal(ops::nf4_dequantize(q, out), nf4_dequantize_reference(q, out))) << c10::toString(out);
}

// x W^T for decode steps: an NF4 W stored in the test's dtype, then a dense fp32 W; x and y fp32;
// every tail of the tiles (weight rows past a multiple of 4 or 2, x rows past 6 or 4), strided operands.
TEST_P(KernelIsas, DecodeMatmulMatchesFloat64) {
  at::manual_seed(15);
  const Nf4Tensor q = nf4_quantize_reference((at::randn({97, 192}) * 0.02).to(dtype()), "w");  // 3 blocks a row
  const at::Tensor w = f64(ops::nf4_dequantize(q, at::kFloat));
  for (const int64_t M : {1, 3, 5, 6, 7, 13, 32}) {
    const at::Tensor xs = rnd({M, 200}, 16, at::kFloat), x = xs.narrow(1, 0, 192);  // row stride 200
    at::Tensor ys = at::full({M, 100}, 7.0), y = ys.narrow(1, 0, 97);
    ASSERT_TRUE(ops::decode_matmul_out(x, q, y)) << "M=" << M;
    // Sums of 192 products in another order than float64: 1e-6 of the largest output.
    expect_near(y, f64(x).mm(w.t()), 1e-6, 1e-6, "M=" + std::to_string(M));
    EXPECT_TRUE(at::equal(ys.narrow(1, 97, 3), at::full({M, 3}, 7.0))) << "wrote past y's columns, M=" << M;
  }
  // A dense W, row stride 208, in place (its last group of rows short on every ISA: 97 rows).
  const at::Tensor ws = rnd({97, 208}, 17, at::kFloat), wd = ws.narrow(1, 0, 192);
  for (const int64_t M : {1, 7, 32}) {
    const at::Tensor x = rnd({M, 192}, 18, at::kFloat);
    at::Tensor y = at::empty({M, 97});
    ASSERT_TRUE(ops::decode_matmul_out(x, wd, y)) << "dense, M=" << M;
    expect_near(y, f64(x).mm(f64(wd).t()), 1e-6, 1e-6, "dense, M=" + std::to_string(M));
  }
  // Rows that split a block (130 = 2 blocks + 2): not the fused kernel's; the caller dequantizes.
  const Nf4Tensor odd = nf4_quantize_reference(at::randn({96, 130}).to(dtype()), "odd");
  at::Tensor y = at::zeros({2, 96});
  EXPECT_FALSE(ops::decode_matmul_out(at::randn({2, 130}), odd, y));
}

// The experts' frozen products in one call (ops/grouped_matmul_ops.h): rows grouped by expert,
// unevenly (one expert without rows, whose weight is undefined and never read; one with one row;
// every tail of the tiles), each group times its own NF4 W stored in fp32 and in bf16, forward and
// transposed, x and y column slices of wider tensors; against float64 products of W dequantized to
// x's dtype. Big enough (3M multiply-adds) to be split among two threads.
TEST_P(KernelIsas, GroupedNf4MatmulMatchesFloat64) {
  at::manual_seed(19);
  const int64_t N = 194, K = 256;  // a last panel of 2 rows, a last chunk of 2 rows
  const std::vector<int64_t> counts = {7, 0, 1, 13, 40};
  const int64_t S = 61;
  for (at::ScalarType storage : {at::kFloat, at::kBFloat16}) {
    std::vector<Nf4Tensor> q(counts.size());
    std::vector<const Nf4Tensor*> w;
    for (size_t g = 0; g < counts.size(); ++g) {
      if (counts[g] > 0) q[g] = nf4_quantize_reference((at::randn({N, K}) * 0.02).to(storage), "w");
      w.push_back(&q[g]);
    }
    for (bool transposed : {false, true}) {
      const std::string what = std::string(transposed ? "transposed" : "forward") + ", W " + c10::toString(storage);
      const int64_t in = transposed ? N : K, out = transposed ? K : N;
      const at::Tensor xs = rnd({S, in + 8}, 20, dtype()), x = xs.narrow(1, 0, in);
      at::Tensor ys = at::full({S, out + 5}, 7.0, dtype()), y = ys.narrow(1, 0, out);
      ASSERT_TRUE(ops::grouped_nf4_matmul_out(x, counts, w, transposed, y)) << what;
      at::Tensor want = at::empty({S, out}, at::kDouble);
      for (size_t g = 0, off = 0; g < counts.size(); off += counts[g], ++g) {
        if (counts[g] == 0) continue;
        const at::Tensor wd = f64(ops::nf4_dequantize(q[g], dtype())), xg = f64(x.narrow(0, off, counts[g]));
        want.narrow(0, off, counts[g]).copy_(transposed ? xg.mm(wd) : xg.mm(wd.t()));
      }
      expect_near(y, want, rel(), 1e-6, what);
      EXPECT_TRUE(at::equal(ys.narrow(1, out, 5), at::full({S, 5}, 7.0, dtype()))) << "wrote past y's columns, " << what;
    }
  }
  // Rows that are not whole 64-column tiles: not the kernel's; the caller multiplies per expert.
  const Nf4Tensor odd = nf4_quantize_reference(at::randn({8, 96}).to(dtype()), "odd");
  at::Tensor y = at::zeros({3, 8}, dtype());
  EXPECT_FALSE(ops::grouped_nf4_matmul_out(at::randn({3, 96}).to(dtype()), {3}, {&odd}, false, y));
}

// A decode step's attention: one query per sequence against keys and values that are views of a
// longer cache (row stride past the used keys), grouped-query heads, a per-row mask of allowed keys
// (left padding, holes, one row with none), soft-capping; D 64 and 80 (a tail of 16-lane blocks).
TEST_P(KernelIsas, DecodeAttentionMatchesFloat64) {
  for (const int64_t D : {64, 80}) {
    const int64_t B = 3, H = 6, KVH = 2, T = 37, room = 45;
    const at::Tensor q = rnd({B, H, 1, D}, 20, dtype());
    const at::Tensor k = rnd({B, KVH, room, D}, 21, dtype(), 2.0).narrow(2, 0, T);
    const at::Tensor v = rnd({B, KVH, room, D}, 22, dtype()).narrow(2, 0, T);
    at::Tensor allowed = at::ones({B, T}, at::kBool);
    allowed[0].narrow(0, 0, 5).fill_(false);  // left padding
    allowed[1].narrow(0, 10, 3).fill_(false);
    allowed[2].fill_(false);  // no key: zeros
    for (const double cap : {0.0, 5.0}) {
      const double scale = 0.125;
      const at::Tensor got = ops::decode_attention(q, k, v, allowed, scale, cap);
      ASSERT_TRUE(got.defined()) << "D=" << D;
      ASSERT_EQ(got.scalar_type(), dtype());
      // float64: [B, H, 1, T] scores of the repeated KV heads, masked softmax, weighted values.
      const at::Tensor kk = f64(k).repeat_interleave(H / KVH, 1), vv = f64(v).repeat_interleave(H / KVH, 1);
      at::Tensor s = f64(q).matmul(kk.transpose(2, 3)) * scale;
      if (cap > 0) s = at::tanh(s / cap) * cap;
      const at::Tensor m = allowed.view({B, 1, 1, T});
      at::Tensor want = at::softmax(s.masked_fill(m.logical_not(), -INFINITY), -1).matmul(vv);
      want = at::where(m.any(-1, true), want, at::zeros_like(want));  // the row with no key: 0, not NaN
      const std::string what = "D=" + std::to_string(D) + " cap=" + std::to_string(cap);
      // fp32: softmax and sums of 37 terms in another order, ~1e-6 relative; bf16: plus the output's rounding.
      expect_near(got, want, bf16() ? kBf16Rel : 1e-5, 1e-5, what);
      EXPECT_TRUE(at::equal(got[2], at::zeros_like(got[2]))) << what;
    }
    // Every key visible (no mask), one head per KV head.
    const at::Tensor qh = rnd({B, KVH, 1, D}, 23, dtype());
    const at::Tensor all = ops::decode_attention(qh, k, v, {}, 0.2, 0.0);
    ASSERT_TRUE(all.defined());
    const at::Tensor want = at::softmax(f64(qh).matmul(f64(k).transpose(2, 3)) * 0.2, -1).matmul(f64(v));
    expect_near(all, want, bf16() ? kBf16Rel : 1e-5, 1e-5, "unmasked D=" + std::to_string(D));
  }
  // Not the kernel's: two queries per sequence, D not a multiple of 16.
  EXPECT_FALSE(ops::decode_attention(at::randn({1, 2, 2, 64}), at::randn({1, 2, 5, 64}), at::randn({1, 2, 5, 64}), {},
                                     1.0, 0.0)
                   .defined());
  EXPECT_FALSE(ops::decode_attention(at::randn({1, 2, 1, 24}), at::randn({1, 2, 5, 24}), at::randn({1, 2, 5, 24}), {},
                                     1.0, 0.0)
                   .defined());
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<CpuIsa, at::ScalarType>>& p) {
  return std::string(kernels::isa_name(std::get<0>(p.param))) + "_" + c10::toString(std::get<1>(p.param));
}

INSTANTIATE_TEST_SUITE_P(All, KernelIsas,
                         ::testing::Combine(::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512,
                                                              CpuIsa::kAvx512Bf16),
                                            ::testing::Values(at::kFloat, at::kBFloat16)),
                         param_name);

}  // namespace
}  // namespace qlora
