// The step's row softmaxes (ops/softmax_ops.h, kernels/softmax_cpu.cpp) against float64:
// causal attention's block softmax with its log-sum-exp and garbage in the masked entries, its
// gradient, and the chunked loss's online log-sum-exp over vocabulary blocks of uneven widths;
// lengths with scalar tails, 1 vs 2 threads bit for bit, NaN and +inf propagation, the ATen
// fallbacks for other layouts, and shape errors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "qlora/ops/softmax_ops.h"

namespace qlora {
namespace {

const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

at::Tensor rnd(at::IntArrayRef shape, uint64_t seed, double scale) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::TensorOptions().dtype(at::kFloat)) *
         scale;
}

// |got - want| <= 4e-6 |want| + 1e-7 max |want| elementwise, want in float64.
void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  const at::Tensor err = (got.to(at::kDouble) - want).abs() - (want.abs() * 4e-6 + want.abs().max() * 1e-7);
  EXPECT_LE(err.max().item<double>(), 0.0) << what;
}

// Row r of a [heads, nq, keys] block sees keys - nq + r + 1 keys: true where it does not.
at::Tensor future(int64_t nq, int64_t keys) {
  return at::ones({nq, keys}, at::TensorOptions().dtype(at::kBool)).triu_(keys - nq + 1);
}

// Scaled scores with NaN, +inf and huge values in the masked entries, which must not matter.
at::Tensor scores_with_garbage(int64_t heads, int64_t nq, int64_t keys, uint64_t seed) {
  const at::Tensor s = rnd({heads, nq, keys}, seed, 4.0);
  const at::Tensor junk = at::where(rnd({heads, nq, keys}, seed + 1, 1.0) > 0, kNan, 1e30f);
  return at::where(future(nq, keys), junk, s);
}

const std::vector<std::tuple<int64_t, int64_t, int64_t>> kBlocks = {{1, 1, 1}, {3, 5, 5}, {2, 7, 37}, {4, 64, 512}};

TEST(SoftmaxKernels, CausalSoftmaxAndLogSumExpMatchFloat64) {
  for (const auto& [heads, nq, keys] : kBlocks) {
    const at::Tensor s = scores_with_garbage(heads, nq, keys, 1);
    const at::Tensor masked = s.to(at::kDouble).masked_fill(future(nq, keys), -INFINITY);
    const at::Tensor lse_all = at::full({heads, nq + 3}, -7.0f);  // the block's rows, a slice of a longer row
    const at::Tensor lse = lse_all.narrow(1, 2, nq);
    const at::Tensor p = s.clone();
    ops::causal_softmax_(p, lse);
    expect_close(p, at::softmax(masked, -1), "probabilities");
    EXPECT_TRUE((p.masked_select(future(nq, keys)) == 0).all().item<bool>()) << "masked entries";
    expect_close(lse, at::logsumexp(masked, -1), "log-sum-exp");
    EXPECT_TRUE((lse_all.narrow(1, 0, 2) == -7.0f).all().item<bool>()) << "outside the slice";
  }
}

TEST(SoftmaxKernels, SoftmaxBackwardMatchesFloat64) {
  for (const auto& [heads, nq, keys] : kBlocks) {
    at::Tensor p = scores_with_garbage(heads, nq, keys, 2);
    ops::causal_softmax_(p, at::Tensor());
    const at::Tensor dp = rnd({heads, nq, keys}, 3, 1.0), delta_all = rnd({heads, nq + 4, 1}, 4, 1.0);
    const at::Tensor delta = delta_all.narrow(1, 4, nq);
    const at::Tensor want = p.to(at::kDouble) * (dp.to(at::kDouble) - delta.to(at::kDouble));
    const at::Tensor ds = dp.clone();
    ops::softmax_backward_(ds, p, delta);
    expect_close(ds, want, "ds");
  }
}

// The log-sum-exp of z [T, V] by blocks of the given widths, as the chunked loss runs it.
struct Online {
  at::Tensor m, s, last_p, first_rescale;
};
Online online_lse(const at::Tensor& z, const std::vector<int64_t>& widths, bool in_place) {
  const int64_t T = z.size(0);
  Online o{at::full({T, 1}, -kInf), at::zeros({T, 1}), at::Tensor(), at::Tensor()};
  int64_t c0 = 0;
  for (int64_t w : widths) {
    const at::Tensor zb = z.narrow(1, c0, w).contiguous();
    const at::Tensor p = in_place ? zb : at::empty_like(zb);
    const at::Tensor rescale = ops::online_softmax_(zb, p, o.m, o.s);
    if (c0 == 0) o.first_rescale = rescale;
    o.last_p = p;
    c0 += w;
  }
  return o;
}

TEST(SoftmaxKernels, OnlineLogSumExpOverUnevenBlocksMatchesFloat64) {
  const at::Tensor z = rnd({9, 100}, 5, 6.0);
  z[3].add_(40.0);  // a row whose max sits in a later block than its first
  z[3].narrow(0, 0, 30).sub_(80.0);
  for (bool in_place : {false, true}) {
    const Online o = online_lse(z, {13, 8, 40, 39}, in_place);
    expect_close((o.m + o.s.log()).squeeze(1), at::logsumexp(z.to(at::kDouble), 1), "lse");
    expect_close(o.last_p, (z.narrow(1, 61, 39).to(at::kDouble) - o.m.to(at::kDouble)).exp(), "last block's p");
    EXPECT_TRUE((o.first_rescale == 0).all().item<bool>());
  }
}

TEST(SoftmaxKernels, NanAndInfinityPropagateToTheirRowsOnly) {
  at::Tensor z = rnd({4, 21}, 6, 3.0);
  z[1][17] = kNan;
  z[2][3] = kInf;
  const Online o = online_lse(z, {21}, false);
  const at::Tensor s = o.s.squeeze(1);
  EXPECT_TRUE(std::isnan(s[1].item<float>()));
  EXPECT_TRUE(std::isnan(s[2].item<float>()));
  EXPECT_TRUE(std::isfinite(s[0].item<float>()) && std::isfinite(s[3].item<float>()));
  at::Tensor a = rnd({1, 2, 19}, 7, 1.0);
  a[0][1][18] = kNan;  // inside row 1's causal window, not row 0's
  ops::causal_softmax_(a, at::Tensor());
  EXPECT_TRUE(a[0][0].isfinite().all().item<bool>());
  EXPECT_TRUE(a[0][1].isnan().any().item<bool>());
}

TEST(SoftmaxKernels, OneAndTwoThreadsGiveTheSameBits) {
  const int threads = at::get_num_threads();
  auto run = [] {
    at::Tensor p = scores_with_garbage(12, 64, 512, 8);
    const at::Tensor lse = at::empty({12, 64});
    ops::causal_softmax_(p, lse);
    at::Tensor ds = rnd({12, 64, 512}, 9, 1.0);
    ops::softmax_backward_(ds, p, rnd({12, 64}, 10, 1.0));
    const Online o = online_lse(rnd({512, 3000}, 11, 5.0), {1000, 2000}, true);
    return std::vector<at::Tensor>{p, lse, ds, o.m, o.s, o.last_p};
  };
  at::set_num_threads(1);
  const auto one = run();
  at::set_num_threads(2);
  const auto two = run();
  at::set_num_threads(threads);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(at::equal(one[i], two[i])) << "output " << i;
}

TEST(SoftmaxKernels, OtherLayoutsTakeAtensOps) {
  // A strided block and a bf16 one: ATen's masked softmax, equal to the kernel's within rounding.
  const at::Tensor s = scores_with_garbage(2, 7, 37, 12);
  const at::Tensor wide = at::zeros({2, 7, 40});
  wide.narrow(2, 0, 37).copy_(s);
  const at::Tensor strided = wide.narrow(2, 0, 37), dense = s.clone();
  ops::causal_softmax_(strided, at::Tensor());
  ops::causal_softmax_(dense, at::Tensor());
  EXPECT_TRUE(at::allclose(strided, dense, 1e-6, 1e-7));
  const at::Tensor z = rnd({5, 30}, 13, 3.0).to(at::kBFloat16);
  at::Tensor m = at::full({5, 1}, -kInf, at::TensorOptions().dtype(at::kBFloat16)), sum = at::zeros_like(m);
  const at::Tensor p = at::empty_like(z);
  ops::online_softmax_(z, p, m, sum);
  EXPECT_TRUE(at::equal(m, at::amax(z, 1, true)));
  EXPECT_TRUE(at::equal(p, (z - m).exp()));
}

TEST(SoftmaxKernels, BadShapesAreRejected) {
  EXPECT_THROW(ops::causal_softmax_(at::zeros({2, 5, 4}), at::Tensor()), std::invalid_argument);  // nq > keys
  EXPECT_THROW(ops::causal_softmax_(at::zeros({5, 4}), at::Tensor()), std::invalid_argument);
  EXPECT_THROW(ops::softmax_backward_(at::zeros({2, 3, 4}), at::zeros({2, 3, 5}), at::zeros({2, 3})),
               std::invalid_argument);
  at::Tensor m = at::zeros({3, 1}), s = at::zeros({3, 1});
  EXPECT_THROW(ops::online_softmax_(at::zeros({4, 8}), at::zeros({4, 8}), m, s), std::invalid_argument);
}

}  // namespace
}  // namespace qlora
