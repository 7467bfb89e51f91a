#include "qlora/modules/lora_linear.h"

#include <ATen/ops/dropout.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "qlora/modules/nf4_linear.h"

namespace qlora::modules {

LoraLinear lora_linear_dense(at::Tensor weight) {
  if (weight.dim() != 2) throw std::invalid_argument("lora_linear: base weight must be 2-D [out, in]");
  LoraLinear l;
  l.out_features = weight.size(0);
  l.in_features = weight.size(1);
  l.base_dense = weight.detach();
  return l;
}

LoraLinear lora_linear_nf4(Nf4Tensor weight) {
  if (weight.shape.size() != 2) throw std::invalid_argument("lora_linear: NF4 weight must be 2-D [out, in]");
  LoraLinear l;
  l.out_features = weight.shape[0];
  l.in_features = weight.shape[1];
  l.base_nf4 = std::move(weight);
  return l;
}

void lora_linear_set_bias(LoraLinear& layer, at::Tensor bias) {
  if (bias.dim() != 1 || bias.size(0) != layer.out_features) {
    throw std::invalid_argument("lora_linear: bias must be [out] = [" + std::to_string(layer.out_features) + "]");
  }
  layer.bias = bias.detach();
}

void lora_linear_add_adapter(LoraLinear& layer, int64_t r, double alpha, double dropout,
                             at::Generator gen, at::Device device) {
  if (r <= 0) throw std::invalid_argument("lora: rank r must be positive, got " + std::to_string(r));
  if (!(dropout >= 0.0 && dropout < 1.0)) {
    throw std::invalid_argument("lora: dropout must be in [0, 1), got " + std::to_string(dropout));
  }
  // kaiming_uniform_(a=sqrt(5)) with fan_in = in: gain = sqrt(2 / (1 + 5)), bound =
  // gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(layer.in_features));
  at::Tensor a = at::empty({r, layer.in_features}, at::TensorOptions().dtype(at::kFloat));
  a.uniform_(-bound, bound, gen);  // drawn on CPU so the values do not depend on the device
  layer.lora_a = a.to(device).set_requires_grad(true);
  layer.lora_b = at::zeros({layer.out_features, r}, at::TensorOptions().dtype(at::kFloat).device(device))
                     .set_requires_grad(true);
  layer.r = r;
  layer.scale = alpha / static_cast<double>(r);
  layer.dropout = dropout;
}

at::Tensor lora_linear_base(const LoraLinear& layer, const at::Tensor& x) {
  if (!layer.base_nf4.defined()) return at::linear(x, layer.base_dense, layer.bias);  // [..., out]
  at::Tensor y = nf4_linear(x, layer.base_nf4);
  return layer.bias.defined() ? y + layer.bias : y;
}

at::Tensor lora_linear_forward(const LoraLinear& layer, const at::Tensor& x, bool training) {
  at::Tensor y = lora_linear_base(layer, x);  // [..., out]
  if (!layer.has_lora()) return y;
  return (y + lora_delta(layer, x, training)).to(x.scalar_type());
}

at::Tensor lora_input(const LoraLinear& layer, const at::Tensor& x, bool training) {
  at::Tensor h = x.to(layer.lora_a.scalar_type());  // [..., in] fp32, as peft's _cast_input_dtype
  if (training && layer.dropout > 0.0) h = at::dropout(h, layer.dropout, /*train=*/true);
  return h;
}

at::Tensor lora_update(const LoraLinear& layer, const at::Tensor& lora_x) {
  return at::linear(at::linear(lora_x, layer.lora_a), layer.lora_b) * layer.scale;  // [..., out] fp32
}

at::Tensor lora_delta(const LoraLinear& layer, const at::Tensor& x, bool training) {
  return lora_update(layer, lora_input(layer, x, training));
}

at::Tensor lora_merged_weight(const LoraLinear& layer, const at::Tensor& base) {
  const at::Tensor delta =
      at::matmul(layer.lora_b.detach().to(at::kFloat), layer.lora_a.detach().to(at::kFloat));  // [out, in]
  return base.to(delta.device()).add(delta, layer.scale);
}

}  // namespace qlora::modules
