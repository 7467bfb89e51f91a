// The CUDA path against the CPU path on the same numbers (skipped without a CUDA device): the NF4
// LoRA linear's forward and backward, and a whole QLoRA training step of the tiny Llama (NF4 base,
// LoRA on every projection, activation checkpointing), in fp32 and in bf16. NF4 dequantization is
// bit-identical on both devices (qlora_tests' CUDA cases); what differs is the order of GEMM and
// attention reductions, so each dtype has its tolerance, written beside it.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fixtures.h"
#include "qlora/models/decoder.h"
#include "qlora/modules/lora_linear.h"
#include "qlora/ops/nf4_ops.h"

using namespace qlora;
using qlora::models::test_fixtures::randn;
using qlora::models::test_fixtures::rel_err;
using qlora::models::test_fixtures::seeded;

namespace {

bool have_cuda() { return at::hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0; }

// max |cuda - cpu| / max |cpu| allowed. fp32: no TF32 (torch's default for matmul), so only the
// reduction order differs: ~1e-6 seen in such comparisons, 2e-5 allowed. bf16: every activation
// is rounded to 8 mantissa bits (3.9e-3 relative) at a different place in the sums: 3e-2 allowed
// for one layer, 5e-2 for a whole step's gradients.
double tolerance(at::ScalarType t, bool whole_step) {
  if (t == at::kFloat) return whole_step ? 1e-4 : 2e-5;
  return whole_step ? 5e-2 : 3e-2;
}

class CudaParity : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  }
};

std::string dtype_name(const ::testing::TestParamInfo<at::ScalarType>& p) {
  return p.param == at::kFloat ? "fp32" : "bf16";
}

}  // namespace

TEST_P(CudaParity, LoraNf4LinearForwardBackward) {
  const at::ScalarType dt = GetParam();
  const at::Device gpu(at::kCUDA, 0);
  modules::LoraLinear cpu = modules::lora_linear_nf4(ops::nf4_quantize(randn({96, 128}, 1, 0.05), "w"));
  modules::lora_linear_add_adapter(cpu, 8, 16.0, 0.0, seeded(2), at::kCPU);
  {
    at::NoGradGuard g;
    cpu.lora_b.copy_(randn({96, 8}, 3, 0.05));  // B != 0: the update path counts
  }
  modules::LoraLinear cuda = modules::lora_linear_nf4(cpu.base_nf4.to(gpu));
  modules::lora_linear_add_adapter(cuda, 8, 16.0, 0.0, seeded(2), gpu);
  {
    at::NoGradGuard g;
    cuda.lora_b.copy_(cpu.lora_b);
  }
  const at::Tensor x = randn({2, 9, 128}, 4).to(dt), up = randn({2, 9, 96}, 5);
  auto run = [&](const modules::LoraLinear& l, at::Device d) {
    at::Tensor xi = x.to(d).detach().requires_grad_(true);  // x.to(kCPU) is x itself: never mark x
    at::Tensor y = modules::lora_linear_forward(l, xi, /*training=*/true);
    (y.to(at::kFloat) * up.to(d)).sum().backward();
    return std::vector<at::Tensor>{y.cpu(), xi.grad().cpu(), l.lora_a.grad().cpu(), l.lora_b.grad().cpu()};
  };
  const std::vector<at::Tensor> want = run(cpu, at::kCPU), got = run(cuda, gpu);
  const char* names[] = {"output", "input gradient", "lora_A gradient", "lora_B gradient"};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), want[i].scalar_type()) << names[i];
    EXPECT_LE(rel_err(got[i], want[i]), tolerance(dt, false)) << names[i];
  }
}

TEST_P(CudaParity, TinyLlamaTrainingStepGradients) {
  const at::ScalarType dt = GetParam();
  auto load = [&](at::Device d) {
    models::DecoderLoadOptions o;
    o.base_in_nf4 = true;
    o.compute_dtype = dt;
    o.device = d;
    o.lora_targets = {"q", "k", "v", "o", "gate", "up", "down"};
    o.activation_checkpointing = true;
    o.seed = 7;
    models::DecoderModel m = models::load_decoder(models::test_fixtures::tiny_llama(), o);
    m.training = true;
    uint64_t seed = 100;
    at::NoGradGuard g;
    for (auto& [name, t] : m.lora_parameters())
      if (name.find("lora_B") != std::string::npos) t.copy_(randn(t.sizes(), seed++, 0.02));
    return m;
  };
  const models::DecoderModel cpu = load(at::kCPU), cuda = load(at::Device(at::kCUDA, 0));
  const at::Tensor tokens = at::randint(0, 256, {2, 33}, seeded(9));
  const at::Tensor inp = tokens.narrow(1, 0, 32), labels = tokens.narrow(1, 1, 32);
  auto step = [&](const models::DecoderModel& m, at::Device d) {
    at::Tensor loss = m.loss(inp.to(d), labels.to(d)) / static_cast<double>(labels.numel());
    loss.backward();
    return loss.item<double>();
  };
  const double want = step(cpu, at::kCPU), got = step(cuda, at::Device(at::kCUDA, 0));
  EXPECT_LE(std::abs(got - want) / std::abs(want), tolerance(dt, true) / 10) << got << " vs " << want;
  const auto pc = cpu.lora_parameters(), pg = cuda.lora_parameters();
  ASSERT_EQ(pc.size(), pg.size());
  for (size_t i = 0; i < pc.size(); ++i) {
    ASSERT_EQ(pc[i].first, pg[i].first);
    ASSERT_TRUE(pg[i].second.grad().defined()) << pg[i].first;
    EXPECT_LE(rel_err(pg[i].second.grad().cpu(), pc[i].second.grad()), tolerance(dt, true)) << pc[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaParity, ::testing::Values(at::kFloat, at::kBFloat16), dtype_name);
