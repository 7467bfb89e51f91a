#include "qlora/modules/lora_linear.h"

#include <ATen/ops/dropout.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "qlora/modules/nf4_linear.h"

namespace qlora::modules {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;


// base(x) + scale * (x @ A^T) @ B^T as one autograd node, for an adapter without dropout: the
// update accumulates into the base output inside the GEMM (no [tokens, out] temporaries), and
// backward runs five GEMMs and nothing else (the base weight dequantized again, as nf4_linear's
// backward does). Saved: x and x @ A^T [tokens, r]. In the compute dtype bf16 the update is added
// in fp32 and the sum cast back, as lora_linear_forward does.
struct LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                            const LoraLinear* layer) {
    RECORD_USER_SCOPE("qlora::lora_linear");  // a phase of bench_train_step's profile
    const at::Tensor x2 = x.reshape({-1, layer->in_features});         // [T, in]
    const at::Tensor xa = at::mm(x2.to(a.scalar_type()), a.t());     // [T, r] fp32
    at::Tensor y = layer->base_nf4.defined() ? nf4_times_transposed(x2, layer->base_nf4)
                                             : at::linear(x2, layer->base_dense.to(x.scalar_type()));  // [T, out]
    if (layer->bias.defined()) y.add_(layer->bias);
    if (y.scalar_type() == b.scalar_type()) y.addmm_(xa, b.t(), 1.0, layer->scale);
    else y = y.to(b.scalar_type()).addmm_(xa, b.t(), 1.0, layer->scale).to(x.scalar_type());
    ctx->save_for_backward({x, a, b, xa});
    if (layer->base_nf4.defined()) save_nf4(ctx, layer->base_nf4);
    else ctx->saved_data["dense"] = layer->base_dense;
    ctx->saved_data["scale"] = layer->scale;
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = layer->out_features;
    return y.view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_USER_SCOPE("qlora::lora_linear");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &a = saved[1], &b = saved[2], &xa = saved[3];
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor g = grad_outputs[0].reshape({-1, b.size(0)});  // [T, out]
    const at::Tensor gf = g.to(b.scalar_type());
    // The skinny GEMMs in the operand layouts MKL runs fast: g @ B with B as a transposed [r, out]
    // copy (~2x faster than B as stored), B's gradient as (xa^T g)^T (~8x faster than g^T xa).
    const at::Tensor gxa = at::mm(gf, b.t().contiguous().t());  // [T, r], before the scale
    const at::Tensor x2 = x.reshape({-1, a.size(1)});
    at::Tensor gx, ga, gb;
    if (ctx->needs_input_grad(1)) ga = at::mm(gxa.t(), x2.to(a.scalar_type())).mul_(scale);  // [r, in]
    if (ctx->needs_input_grad(2)) gb = at::mm(xa.t(), gf).mul_(scale).t().contiguous();      // [out, r]
    if (ctx->needs_input_grad(0)) {
      gx = ctx->saved_data.count("dense") ? at::mm(g, ctx->saved_data["dense"].toTensor().to(g.scalar_type()))
                                          : grad_times_nf4(g, load_nf4(ctx));  // [T, in]
      if (gx.scalar_type() == a.scalar_type()) gx.addmm_(gxa, a, 1.0, scale);
      else gx = gx.to(a.scalar_type()).addmm_(gxa, a, 1.0, scale).to(x.scalar_type());
      gx = gx.view(x.sizes());
    }
    return {gx, ga, gb, at::Tensor()};
  }
};

}  // namespace

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
  if (layer.has_lora() && !(training && layer.dropout > 0.0))
    return LoraLinearFunction::apply(x, layer.lora_a, layer.lora_b, &layer);
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
