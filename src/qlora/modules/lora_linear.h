// A frozen base projection (NF4 or full precision) plus an optional trainable LoRA adapter:
//   y = base(x) + (dropout(x) @ A^T @ B^T) * (alpha / r)
// With DoRA (peft's use_dora), a trainable magnitude per output row rescales the adapted row:
//   y = m / ||W + scale·B A||_row ⊙ (x W^T + scale·x A^T B^T) + bias,
// the norm a constant of the graph, as peft detaches it (the DoRA paper, §4.3).
// Adapters live in fp32 (weights, gradients, optimizer state). Without dropout (the group node,
// lora_linear_group_forward) the LoRA products run in x's dtype: fp32 through the narrow kernels,
// or bf16 GEMMs (fp32 accumulation) on bf16 copies of A and B, as autocast does on a GPU, so no
// activation is converted. With dropout drawn in training, the path is peft's lora.Linear: x cast
// to fp32, the update added in fp32 and the sum cast back to the compute dtype.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "quant/nf4_tensor.h"

namespace qlora::modules {

struct LoraLinear {
  // Exactly one of the two bases is set; both frozen (no requires_grad).
  Nf4Tensor base_nf4;     // [out, in] NF4
  at::Tensor base_dense;  // [out, in] in the compute dtype
  int64_t in_features = 0, out_features = 0;
  at::Tensor bias;  // [out] in the compute dtype, frozen; undefined for a projection without one

  // Adapter; undefined when this projection is not a LoRA target (r == 0).
  at::Tensor lora_a;  // [r, in]  fp32, requires_grad
  at::Tensor lora_b;  // [out, r] fp32, requires_grad
  int64_t r = 0;
  double scale = 0.0;      // alpha / r
  double dropout = 0.0;    // probability, applied to the LoRA path's input only
  // DoRA; undefined for plain LoRA.
  at::Tensor magnitude;      // [out] fp32, requires_grad; starts as the base's row norms
  at::Tensor base_sq_norms;  // [out] fp32 ||W_i||^2 of the frozen base, taken once when DoRA is added

  bool has_lora() const { return r > 0; }
  bool has_dora() const { return magnitude.defined(); }
  // Whether forward adds the adapter: it exists and no AdaptersDisabled is in scope.
  bool active() const;
};

// While one is alive, every LoraLinear's forward on this thread computes its base alone, as
// peft's disable_adapter() does: the reference policy of preference tuning is the same NF4 base
// with the adapters off, never a second copy of the weights. Nests; the adapters stay as they are.
class AdaptersDisabled {
 public:
  AdaptersDisabled();
  ~AdaptersDisabled();
  AdaptersDisabled(const AdaptersDisabled&) = delete;
  AdaptersDisabled& operator=(const AdaptersDisabled&) = delete;

 private:
  bool was_disabled_;
};

LoraLinear lora_linear_dense(at::Tensor weight /*[out, in]*/);
LoraLinear lora_linear_nf4(Nf4Tensor weight /*[out, in]*/);

// A frozen bias (Qwen2's q/k/v): added to the base output, before the LoRA update, as HF's
// Linear (inside peft's base layer) adds it.
void lora_linear_set_bias(LoraLinear& layer, at::Tensor bias /*[out]*/);

// Adds an adapter as peft initialises one (init_lora_weights=True): A ~ kaiming_uniform(a=sqrt(5)),
// i.e. U(-1/sqrt(in), 1/sqrt(in)), drawn from `gen` (CPU) so runs are reproducible; B = 0, so the
// adapted layer starts out equal to the base. The adapters are created on `device`.
void lora_linear_add_adapter(LoraLinear& layer, int64_t r, double alpha, double dropout,
                             at::Generator gen, at::Device device);

// alpha / r, or alpha / sqrt(r) with rsLoRA (peft's use_rslora).
double lora_scale(double alpha, int64_t r, bool rslora);

// Makes an adapter DoRA, as peft's use_dora initialises it: the magnitude is ||W + scale·B A||
// per row (with B = 0: the base's row norms), in fp32. Needs the base present (not a shard).
void lora_linear_add_dora(LoraLinear& layer);

// DoRA's row norms ||W + scale·B A||, [out] fp32, no gradient: from ||W_i||^2 kept since load,
// one product A W^T with the base (never dequantized whole) and B (A A^T) B^T's diagonal.
at::Tensor dora_weight_norm(const LoraLinear& layer);

// x: [..., in] in the compute dtype. `training` enables dropout (drawn from the default
// generator of x's device, so activation checkpointing can replay it). Returns [..., out].
// An adapter without dropout runs as one fused autograd node (a group of one, below: the update
// accumulated into the base output inside its GEMM; five GEMMs in backward, no elementwise
// passes); with dropout, the base and the update are separate nodes.
at::Tensor lora_linear_forward(const LoraLinear& layer, const at::Tensor& x, bool training);

// Projections that read the same x (q/k/v, gate/up), each as lora_linear_forward, as one autograd
// node: their bases in one GEMM (small NF4 weights dequantized one under the other), x @ A^T of
// all adapters in one, and in backward one GEMM back to x instead of one per member plus their
// sum. Members may lack an adapter; with mixed bases or an adapter drawing dropout they run one by
// one. Returns [..., out_i] per member, in order.
std::vector<at::Tensor> lora_linear_group_forward(const std::vector<const LoraLinear*>& members,
                                                  const at::Tensor& x, bool training);

// The base output alone: x @ W^T (+ bias), [..., out] in x's dtype.
at::Tensor lora_linear_base(const LoraLinear& layer, const at::Tensor& x);

// The LoRA path's input: dropout(x cast to the adapters' dtype), [..., in] fp32, as peft's
// _cast_input_dtype then lora_dropout. Drawn once per forward; a caller that splits the update into
// chunks of rows (the chunked output loss) draws it whole first, so the mask equals the unchunked one.
at::Tensor lora_input(const LoraLinear& layer, const at::Tensor& x, bool training);
// The update from that input: (lora_x @ A^T @ B^T) * scale, [..., out] fp32.
at::Tensor lora_update(const LoraLinear& layer, const at::Tensor& lora_x);

// The LoRA update alone, the one place it is computed for a forward: lora_update(lora_input(x)).
// A caller with its own base output y (the lm_head's widened base) adds it exactly as
// lora_linear_forward does: (y + lora_delta(...)).to(x's dtype). Requires an adapter.
at::Tensor lora_delta(const LoraLinear& layer, const at::Tensor& x, bool training);

// The merged weight W + scale * (B @ A) (DoRA: its rows rescaled to the magnitudes), [out, in] fp32 on the adapters' device, for exports.
// base: W [out, in] fp32, on any device. One add with alpha (w + scale * d), not w + d * scale:
// the two can differ in the last fp32 bit, which can flip a bf16 rounding of the merged weight,
// and exports must stay byte-identical. Requires an adapter.
at::Tensor lora_merged_weight(const LoraLinear& layer, const at::Tensor& base);

}  // namespace qlora::modules
