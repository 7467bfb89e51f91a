// A Mixture-of-Experts feed-forward: a router picks k of E experts per token and weighs them, the
// routed experts (modules/experts.h) compute and sum. The router is frozen (as the other toolkits
// keep it); its weights still carry gradient to the residual stream through their softmax.
// Numerics follow transformers' router of each family op for op.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "qlora/modules/experts.h"

namespace qlora::modules {

// How a family's router turns its logits into the top-k experts and their weights.
struct MoeDims {
  int64_t num_experts = 0, top_k = 0;
  int64_t inter = 0;            // an expert's width (moe_intermediate_size)
  bool norm_topk_prob = false;  // the k probabilities renormalised to sum to 1 (Qwen3-MoE's key; Mixtral always)
  bool fp32_weights = false;    // the weights stay fp32 (Mixtral) instead of cast to the logits' dtype (Qwen3-MoE)
  // The experts' activation and its constants (experts.h), for the loader to give the experts.
  ExpertActivation activation = ExpertActivation::kSwiglu;
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  // Gemma 4's router (Gemma4TextRouter): its input RMS-normalised without a weight (eps norm_eps),
  // times RouterTensors::scale and hidden^-0.5, before the projection; the renormalised top-k weights
  // (fp32) times RouterTensors::per_expert_scale[index].
  bool scaled_router = false;
  double norm_eps = 1e-6;
  // gpt-oss: the top k of the logits themselves (the router has a bias), then a softmax over those k
  // in the logits' dtype (no softmax over all experts, no renormalisation).
  bool softmax_after_topk = false;
};

// A router's tensors besides its projection, frozen, in the compute dtype, undefined where the
// family has none: Gemma 4's scale [hidden] and per_expert_scale [experts], gpt-oss's bias [experts].
struct RouterTensors {
  at::Tensor scale, per_expert_scale, bias;
};

// The router's choice for T tokens: index [T, k] int64, weights [T, k] (fp32 or the compute dtype,
// differentiable w.r.t. x), and the full probabilities [T, E] fp32 (detached; router statistics).
struct Routing {
  at::Tensor index, weights, probs;
};

// logits = x @ router^T (+ bias) in x's dtype; softmax over all experts in fp32; top k (ties to
// the lower index, as torch.topk on the CPU); renormalised under norm_topk_prob; cast to x's dtype
// unless fp32_weights. x: [T, hidden]; router: [E, hidden] in x's dtype, frozen. Under
// dims.scaled_router (Gemma 4) x is first normalised and scaled and the weights scaled per expert;
// under softmax_after_topk (gpt-oss) the top k of the logits, softmax over those k in x's dtype.
Routing route(const at::Tensor& router, const MoeDims& dims, const at::Tensor& x, const RouterTensors& extra = {});

// The layer's MoE output for x [batch, seq, hidden]: route, then grouped_experts. `routing` (optional)
// receives the router's choice (for statistics).
at::Tensor moe_forward(const at::Tensor& router, const Experts& experts, const MoeDims& dims, const at::Tensor& x,
                       Routing* routing = nullptr, const RouterTensors& extra = {});

// Tokens each expert received, [E] int64 on the routing's device (no host sync), from its index;
// `valid` (the routed tokens' [T] bool, or any shape of T elements; undefined: all) limits them to its true ones.
at::Tensor expert_counts(const Routing& routing, int64_t num_experts, const at::Tensor& valid = {});

}  // namespace qlora::modules
