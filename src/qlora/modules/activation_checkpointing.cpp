#include "qlora/modules/activation_checkpointing.h"

#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

namespace qlora::modules {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Recompute : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> fn;
  std::vector<at::Tensor> params;  // the leaves fn reads that want gradients (same as the inputs)
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // Runs under no-grad (custom functions' forward always does), so none of fn's activations
  // are kept: only h (saved) and the RNG state.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, at::TensorList params,
                            const c10::intrusive_ptr<Recompute>& recompute) {
    ctx->save_for_backward({h});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(recompute);
    ctx->saved_data["n_params"] = static_cast<int64_t>(params.size());
    at::Generator gen = at::globalContext().defaultGenerator(h.device());
    ctx->saved_data["rng"] = gen.get_state();
    return recompute->fn(h);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor h = ctx->get_saved_variables()[0];
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["fn"].toCapsule());
    const int64_t n_params = ctx->saved_data["n_params"].toInt();
    // Gradients must reach the very leaf tensors fn reads during the replay, so we differentiate
    // with respect to those (kept in the closure), not the forward's input copies.
    at::Tensor h_in = h.detach().requires_grad_(h.requires_grad());
    at::Generator gen = at::globalContext().defaultGenerator(h.device());
    at::Tensor rng_now = gen.get_state();
    gen.set_state(ctx->saved_data["rng"].toTensor());  // replay the forward's dropout masks
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = recompute->fn(h_in);
    }
    gen.set_state(rng_now);
    variable_list inputs;
    std::vector<int64_t> where;  // index in the result of each entry of inputs
    if (h_in.requires_grad()) {
      inputs.push_back(h_in);
      where.push_back(0);
    }
    const std::vector<at::Tensor>& targets = recompute->params;
    for (int64_t i = 0; i < n_params; ++i) {
      if (targets[i].requires_grad()) {
        inputs.push_back(targets[i]);
        where.push_back(1 + i);
      }
    }
    variable_list result(static_cast<size_t>(n_params + 2));
    if (!inputs.empty() && out.requires_grad()) {
      variable_list grads = torch::autograd::grad({out}, inputs, {grad_outputs[0]}, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < grads.size(); ++j) result[where[j]] = grads[j];
    }
    return result;
  }
};

}  // namespace

at::Tensor checkpointed(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& h,
                        const std::vector<at::Tensor>& params) {
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->fn = fn;
  recompute->params = params;
  return CheckpointFunction::apply(h, at::TensorList(params), recompute);
}

}  // namespace qlora::modules
