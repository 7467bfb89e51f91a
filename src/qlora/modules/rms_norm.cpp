#include "qlora/modules/rms_norm.h"

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

#include "qlora/ops/rmsnorm_ops.h"

namespace qlora::modules {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// RMSNorm with a frozen weight as one autograd node. It keeps x and rstd (not the normed tensor), and
// backward is the analytic gradient, per row, in fp32 (ops/rmsnorm_ops.h: one kernel each way on the
// CPU, where autograd through ATen's chain made ~9 passes over six nodes).
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            int64_t scale) {
    auto [out, rstd] = ops::rms_norm(x, weight, eps, static_cast<RmsScale>(scale));
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const auto scale = static_cast<RmsScale>(ctx->saved_data["scale"].toInt());
    return {ops::rms_norm_backward(grad_outputs[0], saved[0], saved[1], saved[2], scale), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// The node only when it has a gradient to give: without grad mode or a grad-requiring x the plain ops
// record nothing, and a trainable weight (never the case here) keeps autograd's op chain, which
// differentiates both.
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, RmsScale scale) {
  if (!at::GradMode::is_enabled() || !x.requires_grad() || weight.requires_grad()) {
    return ops::rms_norm(x, weight, eps, scale).first;
  }
  return RmsNormFunction::apply(x, weight, eps, static_cast<int64_t>(scale));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x, weight, eps, RmsScale::kWeight);
}

at::Tensor rms_norm_plus_one(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x, weight, eps, RmsScale::kOnePlusWeight);
}

}  // namespace qlora::modules
