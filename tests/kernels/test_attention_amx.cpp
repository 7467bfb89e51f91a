// The vision towers' segment attention (ops/segment_attention_ops.h): the AMX kernel
// (kernels/attention_amx_cpu.cpp) against attention in float64 on the same bf16 operands, beside
// ATen's bf16 SDPA (what transformers runs) measured against the same reference: the kernel's error
// must stay within 1.5x of ATen's plus a bf16 rounding. Shapes cover the towers' head dims (72, 64),
// tails of every block (rows not a multiple of 16, 64 or 256; d not a multiple of 16 or 32), several
// segments, strided operands (q, k, v as views of one qkv projection), and logits far from 0 both
// ways (the softmax's reference moved). Skipped without AMX-BF16;
// the ATen fallback (grad mode, fp32) is checked everywhere.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention_amx_cpu.h"
#include "kernels/cpu_isa.h"
#include "qlora/ops/segment_attention_ops.h"

namespace qlora {
namespace {

at::Tensor rnd(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::TensorOptions().dtype(at::kFloat));
}

// float64 attention per segment of q, k, v [rows, heads, d].
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& segs,
                     double scale) {
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (const int64_t n : segs) {
    const auto part = [&](const at::Tensor& t) { return t.narrow(0, start, n).transpose(0, 1).to(at::kDouble); };
    const at::Tensor p = at::softmax(at::matmul(part(q), part(k).transpose(1, 2)) * scale, -1);
    outs.push_back(at::matmul(p, part(v)).transpose(0, 1));
    start += n;
  }
  return at::cat(outs, 0);
}

// ATen's bf16 SDPA per segment, as transformers runs the towers.
at::Tensor aten_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& segs,
                     double scale) {
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (const int64_t n : segs) {
    const auto part = [&](const at::Tensor& t) { return t.narrow(0, start, n).transpose(0, 1).unsqueeze(0); };
    outs.push_back(at::scaled_dot_product_attention(part(q), part(k), part(v), std::nullopt, 0.0, false, scale)
                       .squeeze(0)
                       .transpose(0, 1));
    start += n;
  }
  return at::cat(outs, 0);
}

double max_err(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want).abs().max().item<double>();
}

struct Case {
  int64_t heads, d;
  std::vector<int64_t> segs;
  double spread = 2.0;  // q and k drawn N(0, spread^2)
  double offset = 0.0;  // every score shifted by about this (a shared dimension of q and k)
};

TEST(AttentionAmx, MatchesFloat64WithinAtenSdpasError) {
  if (!kernels::attention_amx_available()) GTEST_SKIP() << "no AMX-BF16 here: the towers take ATen's SDPA";
  const std::vector<Case> cases = {
      {16, 72, {300}},       // a tower's head dim; rows past a 256-key block, not a multiple of 16
      {3, 64, {17, 64, 5}},  // segments: one past a block of 16, one exactly 64, one short
      {2, 40, {1, 257}},     // d past a tile of 32 and of 16; a single-row segment
      {1, 128, {96}},        // two A tiles of depth, eight output tiles (two passes of p v)
      // The softmax's reference moved: logits far above 0 (and rising past the first key block),
      // and every logit far below 0.
      {2, 72, {1100}, 12.0},
      {2, 72, {700}, 2.0, -400.0},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    int64_t rows = 0;
    for (const int64_t n : c.segs) rows += n;
    // q, k, v as views of one projection [rows, 3, heads, d] (row stride 3 heads d); scaled up so the
    // softmax is peaked and the online rescaling is exercised across key blocks.
    at::Tensor qkv = rnd({rows, 3, c.heads, c.d}, seed++) * c.spread;
    if (c.offset != 0.0) {  // q's and k's last dims 1 and offset / scale: each score gains offset
      qkv.select(1, 0).select(2, c.d - 1).fill_(1.0);
      qkv.select(1, 1).select(2, c.d - 1).fill_(c.offset * std::sqrt(static_cast<double>(c.d)));
    }
    qkv = qkv.to(at::kBFloat16);
    const at::Tensor q = qkv.select(1, 0), k = qkv.select(1, 1), v = qkv.select(1, 2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    ASSERT_TRUE(ops::segment_attention_uses_amx(q, k, v));
    const at::Tensor got = ops::segment_attention(q, k, v, c.segs, scale);
    ASSERT_EQ(got.sizes(), q.sizes());
    const at::Tensor want = reference(q, k, v, c.segs, scale);
    const double err = max_err(got, want), aten = max_err(aten_sdpa(q, k, v, c.segs, scale), want);
    const double bf16_ulp = want.abs().max().item<double>() / 128.0;
    EXPECT_LE(err, 1.5 * aten + bf16_ulp) << "heads " << c.heads << " d " << c.d << ": ATen's error " << aten;
    EXPECT_GT(err, 0.0);  // it computed something of its own (bf16 output), not a copy of the reference
  }
}

TEST(AttentionAmx, NanInARowGivesNanThere) {
  if (!kernels::attention_amx_available()) GTEST_SKIP() << "no AMX-BF16 here";
  at::Tensor q = rnd({40, 2, 72}, 7).to(at::kBFloat16), k = rnd({40, 2, 72}, 8).to(at::kBFloat16);
  const at::Tensor v = rnd({40, 2, 72}, 9).to(at::kBFloat16);
  q[3][1][5] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor out = ops::segment_attention(q, k, v, {40}, 0.1);
  EXPECT_TRUE(out[3][1].isnan().all().item<bool>());
  EXPECT_TRUE(out[3][0].isfinite().all().item<bool>());
  EXPECT_TRUE(out.select(0, 4).isfinite().all().item<bool>());
}

TEST(AttentionAmx, IsaCapAndGradModeTakeAtensSdpa) {
  const at::Tensor q = rnd({33, 2, 72}, 3).to(at::kBFloat16), k = rnd({33, 2, 72}, 4).to(at::kBFloat16);
  const at::Tensor v = rnd({33, 2, 72}, 5).to(at::kBFloat16);
  {
    kernels::ScopedIsaCap cap(kernels::CpuIsa::kAvx512);
    EXPECT_FALSE(ops::segment_attention_uses_amx(q, k, v));
    EXPECT_TRUE(at::equal(ops::segment_attention(q, k, v, {20, 13}, 0.2), aten_sdpa(q, k, v, {20, 13}, 0.2)));
  }
  const at::Tensor qg = q.to(at::kFloat).requires_grad_();
  EXPECT_FALSE(ops::segment_attention_uses_amx(qg, k.to(at::kFloat), v.to(at::kFloat)));
  const at::Tensor og = ops::segment_attention(qg, k.to(at::kFloat), v.to(at::kFloat), {33}, 0.2);
  EXPECT_TRUE(og.requires_grad());
  EXPECT_THROW(ops::segment_attention(q, k, v, {20, 12}, 0.2), std::invalid_argument);
}

}  // namespace
}  // namespace qlora
