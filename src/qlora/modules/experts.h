// A Mixture-of-Experts feed-forward's routed experts: E gated MLPs (SwiGLU, or the family's gated
// activation: ExpertActivation), each token sent to k of
// them and their outputs summed with the router's weights. The frozen experts stay NF4 (or dense),
// each expert's matrix its own 2-D weight; an adapter (LoRA) per expert and projection is trainable.
//
// One autograd node runs all experts (grouped_experts): the tokens are grouped by expert, and only
// experts that received tokens are touched, each one's NF4 weights decoded tile by tile inside its
// products (ops/grouped_matmul_ops.h: never a dequantized copy of a weight), forward and backward. It
// saves the input, the routing and each slot's gate/up activations; backward gives the input's
// gradient, the routing weights' (so a router that is frozen still passes gradient to the residual
// stream through its softmax) and the adapters'.
//
// The router (which experts, which weights) is the family's (modules/moe.h); this file takes its
// choice as given.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "quant/nf4_tensor.h"

namespace qlora::modules {

// What an expert computes between its gate_up and down products, from gate and up (the halves of gate_up):
// kSwiglu: silu(gate) * up (Qwen, Mixtral); kGeluTanh: gelu(gate, tanh approximation) * up (Gemma 4: its
// hidden_activation gelu_pytorch_tanh); kClampedSwiglu (gpt-oss): gate clamped above at limit, up to
// [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), each op rounded to the compute dtype
// as transformers' GptOssExperts._apply_gate rounds it.
enum class ExpertActivation { kSwiglu, kGeluTanh, kClampedSwiglu };

// The routed experts of one layer. Expert e's gate and up projections are one weight gate_up[e]
// [2 * inter, hidden] (gate's rows, then up's), as transformers 5 holds them fused; down[e] is
// [hidden, inter]. Exactly one of the two bases is set, for all experts alike; both frozen.
struct Experts {
  std::vector<Nf4Tensor> gate_up_nf4, down_nf4;
  std::vector<at::Tensor> gate_up_dense, down_dense;  // compute dtype
  int64_t num_experts = 0, hidden = 0, inter = 0;

  // Adapters, one per expert and projection, held as peft holds LoRA on a fused expert parameter
  // (target_parameters), so they are the PEFT adapter's tensors as they stand; undefined without them.
  // fp32, requires_grad. Expert e's A is rows e*r .. e*r + r of lora_A (expert-major); its B is
  // columns j*E + e, j < r, of lora_B (expert-minor: lora_B.view({out, r, E}).select(2, e)); its
  // update of gate_up is (x @ A_e^T @ B_e^T) * scale.
  at::Tensor gate_up_a;  // [r * E, hidden]
  at::Tensor gate_up_b;  // [2 * inter, r * E]
  at::Tensor down_a;     // [r * E, inter]
  at::Tensor down_b;     // [hidden, r * E]
  int64_t r = 0;
  double scale = 0.0;  // alpha / r, or alpha / sqrt(r) with rsLoRA

  // The activation (ExpertActivation) and kClampedSwiglu's constants (gpt-oss's swiglu_alpha, swiglu_limit).
  ExpertActivation activation = ExpertActivation::kSwiglu;
  double alpha = 1.702, limit = 7.0;
  // gpt-oss: per-expert biases, frozen, compute dtype: gate_up's [E, 2 * inter] (gate's, then up's, as
  // the weight's rows) added to each gate_up product, down's [E, hidden] to each down product; undefined: none.
  at::Tensor gate_up_bias, down_bias;

  bool nf4() const { return !gate_up_nf4.empty(); }
  bool has_lora() const { return r > 0; }
  // The trainable tensors (the four adapters), empty without them.
  std::vector<at::Tensor> trainable() const;
};

// Experts from per-expert weights (all NF4 or all dense, of the shapes above).
Experts experts_nf4(std::vector<Nf4Tensor> gate_up, std::vector<Nf4Tensor> down);
Experts experts_dense(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down);

// Adds adapters as peft initialises LoRA on a parameter: lora_A [r * E, in] ~ U(-1/sqrt(in), 1/sqrt(in))
// (kaiming_uniform, a=sqrt(5)) drawn whole from `gen` (gate_up's, then down's), lora_B = 0; created
// in fp32 on `device`, requiring grad. `scale` as lora_scale gives it.
void experts_add_adapters(Experts& experts, int64_t r, double scale, at::Generator gen, at::Device device);

// y[t] = sum_j weights[t, j] * expert_{index[t, j]}(x[t]), with expert(x) = down(act(gate(x), up(x))),
// gate and up the halves of gate_up(x), each projection plus its adapter when the experts have them
// and its bias when they have biases; act the experts' activation (silu(gate) * up by default).
// x: [T, hidden] in the compute dtype; index: [T, k] int64 in [0, E); weights: [T, k] (the compute
// dtype or fp32: the family's), differentiable. Returns [T, hidden] in x's dtype, as transformers'
// grouped_mm path computes it: each slot's expert output (x's dtype) times its weight in the promoted
// dtype (rounded there), the k slots of a token summed with fp32 accumulation, rounded once to x's
// dtype. Under an AdaptersDisabled (lora_linear.h) the experts compute their bases alone, as
// LoraLinear does (the reference policy of preference tuning).
at::Tensor grouped_experts(const Experts& experts, const at::Tensor& x, const at::Tensor& index,
                           const at::Tensor& weights);

// Expert e's A [r, in] and B [out, r] (views of the stacked adapters).
at::Tensor expert_lora_a(const at::Tensor& stacked_a, int64_t num_experts, int64_t e);
at::Tensor expert_lora_b(const at::Tensor& stacked_b, int64_t num_experts, int64_t e);

// gpt-oss's order of gate and up along `dim` (interleaved: gate's entries at even indices, up's at odd
// ones) from ours (gate's half, then up's), and back; `dim` has 2 * inter entries.
at::Tensor interleave_gate_up(const at::Tensor& t, int64_t dim);
at::Tensor deinterleave_gate_up(const at::Tensor& t, int64_t dim);

// Expert e's merged weights W + scale * B_e @ A_e, fp32 (for exports); base: the expert's weight
// dequantized to fp32. Requires adapters.
at::Tensor experts_merged_gate_up(const Experts& experts, int64_t e, const at::Tensor& base);
at::Tensor experts_merged_down(const Experts& experts, int64_t e, const at::Tensor& base);

}  // namespace qlora::modules
