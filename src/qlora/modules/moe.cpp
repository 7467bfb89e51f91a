#include "qlora/modules/moe.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "qlora/modules/rms_norm.h"

namespace qlora::modules {

namespace {

// Gemma 4's router input: x normalised in fp32 without a weight (Gemma4RMSNorm, with_scale False)
// and cast to x's dtype, times scale, times hidden^-0.5, each product rounded to x's dtype.
at::Tensor scaled_router_input(const MoeDims& dims, const RouterTensors& extra, const at::Tensor& x) {
  if (!extra.scale.defined() || !extra.per_expert_scale.defined())
    throw std::invalid_argument("route: a scaled router (Gemma 4) needs its scale and per_expert_scale");
  const at::Tensor normed = rms_norm(x, at::ones({x.size(-1)}, x.options()), dims.norm_eps, RmsScale::kWeightFp32);
  return normed * extra.scale * std::pow(static_cast<double>(x.size(-1)), -0.5);
}

}  // namespace

Routing route(const at::Tensor& router, const MoeDims& dims, const at::Tensor& x, const RouterTensors& extra) {
  if (dims.top_k < 1 || dims.top_k > dims.num_experts)
    throw std::invalid_argument("route: top_k " + std::to_string(dims.top_k) + " of " +
                                std::to_string(dims.num_experts) + " experts");
  const at::Tensor input = dims.scaled_router ? scaled_router_input(dims, extra, x) : x;
  const at::Tensor logits = at::linear(input, router, extra.bias);     // [T, E], x's dtype
  if (dims.softmax_after_topk) {  // gpt-oss: top k of the logits, softmax over those k in their dtype
    auto [top, index] = at::topk(logits, dims.top_k, -1);
    return {index, at::softmax(top, -1), at::softmax(logits.detach(), -1, at::kFloat)};
  }
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);        // fp32
  auto [top, index] = at::topk(probs, dims.top_k, -1);                 // sorted, largest first
  if (dims.norm_topk_prob) top = top / top.sum(-1, /*keepdim=*/true);
  if (dims.scaled_router) top = top * extra.per_expert_scale.index_select(0, index.reshape(-1)).view_as(index);
  if (!dims.fp32_weights) top = top.to(logits.scalar_type());
  return {index, top, probs.detach()};
}

at::Tensor moe_forward(const at::Tensor& router, const Experts& experts, const MoeDims& dims, const at::Tensor& x,
                       Routing* routing, const RouterTensors& extra) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  Routing r = route(router, dims, x2, extra);
  at::Tensor y = grouped_experts(experts, x2, r.index, r.weights);
  if (routing) *routing = std::move(r);
  return y.view(x.sizes());
}

at::Tensor expert_counts(const Routing& routing, int64_t num_experts, const at::Tensor& valid) {
  // index_add_ rather than bincount: bincount on CUDA reads the largest index back to the host first.
  const at::Tensor flat = routing.index.reshape(-1);
  if (valid.defined() && valid.numel() != routing.index.size(0))
    throw std::invalid_argument("expert_counts: valid has " + std::to_string(valid.numel()) + " tokens, the routing " +
                                std::to_string(routing.index.size(0)));
  const at::Tensor ones = valid.defined() ? valid.reshape({-1, 1}).expand(routing.index.sizes()).reshape(-1).to(flat.options())
                                          : at::ones_like(flat);
  return at::zeros({num_experts}, flat.options()).index_add_(0, flat, ones);
}

}  // namespace qlora::modules
