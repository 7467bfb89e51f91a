#include "qlora/modules/moe.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

#include <stdexcept>
#include <string>

namespace qlora::modules {

Routing route(const at::Tensor& router, const MoeDims& dims, const at::Tensor& x, const at::Tensor& router_bias) {
  if (dims.top_k < 1 || dims.top_k > dims.num_experts)
    throw std::invalid_argument("route: top_k " + std::to_string(dims.top_k) + " of " +
                                std::to_string(dims.num_experts) + " experts");
  const at::Tensor logits = at::linear(x, router, router_bias);        // [T, E], x's dtype
  if (dims.softmax_after_topk) {  // gpt-oss: top k of the logits, softmax over those k in their dtype
    auto [top, index] = at::topk(logits, dims.top_k, -1);
    return {index, at::softmax(top, -1), at::softmax(logits.detach(), -1, at::kFloat)};
  }
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);        // fp32
  auto [top, index] = at::topk(probs, dims.top_k, -1);                 // sorted, largest first
  if (dims.norm_topk_prob) top = top / top.sum(-1, /*keepdim=*/true);
  if (!dims.fp32_weights) top = top.to(logits.scalar_type());
  return {index, top, probs.detach()};
}

at::Tensor moe_forward(const at::Tensor& router, const Experts& experts, const MoeDims& dims, const at::Tensor& x,
                       Routing* routing, const at::Tensor& router_bias) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  Routing r = route(router, dims, x2, router_bias);
  at::Tensor y = grouped_experts(experts, x2, r.index, r.weights);
  if (routing) *routing = std::move(r);
  return y.view(x.sizes());
}

at::Tensor expert_counts(const Routing& routing, int64_t num_experts) {
  return at::bincount(routing.index.reshape(-1).cpu(), {}, num_experts);
}

}  // namespace qlora::modules
