#include "qlora/modules/gated_mlp.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/gelu.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <vector>

#include "qlora/modules/lora_linear.h"
#include "qlora/ops/swiglu_ops.h"

namespace qlora::modules {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// silu(gate) * up as one autograd node: one pass forward and one backward on the CPU
// (ops/swiglu_ops.h). Saves gate and up (views of their projections' output), not silu(gate).
struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return ops::swiglu(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto [dg, du] = ops::swiglu_backward(grad_outputs[0], saved[0], saved[1]);
    return {dg, du};
  }
};

at::Tensor activate(const LayerDims& dims, const at::Tensor& gate, const at::Tensor& up) {
  return dims.activation == MlpActivation::kSilu ? SwiGluFunction::apply(gate, up) : at::gelu(gate, "tanh") * up;
}

}  // namespace

at::Tensor gated_mlp(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x, bool training) {
  if (layer.gate_up_proj.out_features == 0) return gated_mlp(layer.gate_proj, layer.up_proj, layer.down_proj, dims, x, training);
  const at::Tensor gu = lora_linear_forward(layer.gate_up_proj, x, training);  // [b, s, 2 * inter]
  const int64_t inter = gu.size(-1) / 2;
  return lora_linear_forward(layer.down_proj, activate(dims, gu.narrow(-1, 0, inter), gu.narrow(-1, inter, inter)),
                             training);  // [b, s, hidden]
}

at::Tensor gated_mlp(const LoraLinear& gate_proj, const LoraLinear& up_proj, const LoraLinear& down_proj,
                     const LayerDims& dims, const at::Tensor& x, bool training) {
  const std::vector<at::Tensor> gu = lora_linear_group_forward({&gate_proj, &up_proj}, x, training);  // [b, s, inter]
  return lora_linear_forward(down_proj, activate(dims, gu[0], gu[1]), training);  // [b, s, hidden]
}

}  // namespace qlora::modules
