// AdamW with torch.optim.AdamW(foreach=False, fused=False) numerics, bit for bit on CPU fp32: the
// same ATen ops in the same order as torch's _single_tensor_adam, with the scalar arithmetic
// (bias corrections, step size) done in double exactly as Python does it.
//
// Bit-identity caveat: ATen's elementwise CPU kernels take a vectorized path for the body of a
// tensor and a scalar path for its tail (and per-thread chunk), and lerp's two paths round
// differently. So results match torch only for the same tensor layout, the same CPU capability
// (AVX2/AVX-512) and the same intra-op thread count. That is also why this works per tensor rather
// than on one flat buffer: flattening moves the vector/tail boundaries. Params may still be views
// into a flat buffer; each view is updated as its own tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace qlora::optim {

struct AdamWOptions {
  double lr = 1e-3;  // torch's defaults, so a default-built AdamW matches torch.optim.AdamW()
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

class AdamW {
 public:
  // params: fp32, any device, each with its gradient in .grad() (mutable_grad) when stepped.
  AdamW(std::vector<at::Tensor> params, AdamWOptions options);

  // The schedule sets this before every step, as LambdaLR does for torch.
  void set_lr(double lr) { options_.lr = lr; }
  double lr() const { return options_.lr; }
  const AdamWOptions& options() const { return options_; }

  // Updates every param whose grad is defined; a param without a grad keeps its state and step
  // count untouched, as torch skips it.
  void step();
  void zero_grad();  // sets grads to undefined (torch's set_to_none=True)

  const std::vector<at::Tensor>& params() const { return params_; }
  // Steps taken by param i (they differ only if some params had no grad on some steps).
  int64_t step_count(size_t i = 0) const { return steps_.at(i); }

  // "exp_avg.<i>", "exp_avg_sq.<i>" (copies, same dtype/shape as the param) and "step" (int64
  // [num_params]). load_state_dict checks every name, shape and dtype and copies into the state.
  NamedTensors state_dict() const;
  void load_state_dict(const NamedTensors& state);

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_;
  std::vector<int64_t> steps_;
  AdamWOptions options_;
};

// torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False): total = ||stack(||g_i||)||,
// grads *= clamp(max_norm / (total + 1e-6), max=1). Params without grads are ignored. Returns the
// total norm before clipping (0-dim fp32 tensor). A max_norm <= 0 only measures: grads untouched.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm);
// The total norm alone, as torch.nn.utils.get_total_norm(grads, foreach=False).
at::Tensor grad_total_norm(const std::vector<at::Tensor>& params);

}  // namespace qlora::optim
