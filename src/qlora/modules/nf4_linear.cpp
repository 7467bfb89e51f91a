#include "qlora/modules/nf4_linear.h"

#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <ATen/ops/matmul.h>

#include <stdexcept>
#include <string>

#include "qlora/ops/nf4_ops.h"

namespace qlora::modules {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void save_nf4(AutogradContext* ctx, const Nf4Tensor& w) {
  ctx->saved_data["codes"] = w.codes;
  ctx->saved_data["scalers"] = w.scalers;
  ctx->saved_data["factors"] = w.factors;
  ctx->saved_data["mean"] = w.mean;
  ctx->saved_data["shape"] = c10::IValue(w.shape);
  ctx->saved_data["numel"] = w.layout.numel;
  ctx->saved_data["block_size"] = w.layout.block_size;
  ctx->saved_data["scaler_block_size"] = w.layout.scaler_block_size;
  ctx->saved_data["padded_numel"] = w.layout.padded_numel;
}

Nf4Tensor load_nf4(AutogradContext* ctx) {
  Nf4Tensor w;
  w.codes = ctx->saved_data["codes"].toTensor();
  w.scalers = ctx->saved_data["scalers"].toTensor();
  w.factors = ctx->saved_data["factors"].toTensor();
  w.mean = ctx->saved_data["mean"].toTensor();
  w.shape = ctx->saved_data["shape"].toIntVector();
  w.layout.numel = ctx->saved_data["numel"].toInt();
  w.layout.block_size = ctx->saved_data["block_size"].toInt();
  w.layout.scaler_block_size = ctx->saved_data["scaler_block_size"].toInt();
  w.layout.padded_numel = ctx->saved_data["padded_numel"].toInt();
  return w;
}

at::Tensor Nf4LinearFunction::forward(AutogradContext* ctx, const at::Tensor& x,
                                      const Nf4Tensor& weight) {
  RECORD_USER_SCOPE("qlora::base_linear");  // a phase of bench_train_step's profile
  const at::Tensor w = ops::nf4_dequantize(weight, x.scalar_type());  // [out, in], dropped on return
  save_nf4(ctx, weight);
  return at::linear(x, w);  // [..., out]
}

variable_list Nf4LinearFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  RECORD_USER_SCOPE("qlora::base_linear");
  const at::Tensor& grad_y = grad_outputs[0];  // [..., out]
  // Dequantize again rather than having kept W alive between forward and backward.
  const at::Tensor w = ops::nf4_dequantize(load_nf4(ctx), grad_y.scalar_type());  // [out, in]
  at::Tensor grad_x = at::matmul(grad_y, w);  // [..., in]
  return {grad_x, at::Tensor()};              // the NF4 weight is frozen: no gradient
}

at::Tensor nf4_linear(const at::Tensor& x, const Nf4Tensor& weight) {
  if (weight.shape.size() != 2) {
    throw std::invalid_argument("nf4_linear: weight must be 2-D [out, in]");
  }
  if (x.dim() < 1 || x.size(-1) != weight.shape[1]) {
    throw std::invalid_argument("nf4_linear: input's last dim " +
                                (x.dim() ? std::to_string(x.size(-1)) : std::string("(scalar)")) +
                                " does not match weight in_features " + std::to_string(weight.shape[1]));
  }
  if (x.device() != weight.device()) {
    throw std::invalid_argument("nf4_linear: input and NF4 weight are on different devices");
  }
  return Nf4LinearFunction::apply(x, weight);
}

}  // namespace qlora::modules
