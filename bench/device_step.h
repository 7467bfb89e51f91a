// What bench_train_step's device mode (--device) reports beside tokens/s: the model FLOPs a
// QLoRA step spends per token, the device's dense bf16 peak (for MFU), and a traced step.
#pragma once

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>

#include "qlora/models/architecture.h"
#include "qlora/models/decoder_config.h"

namespace qlora::bench {

// Model FLOPs per trained token of a QLoRA step (PaLM's MFU convention: the work the step needs,
// not what activation checkpointing recomputes): every frozen projection (each layer's and the
// output head) runs forward and backward for its input's gradient, 2 + 2 FLOPs per weight (no
// weight gradient); LoRA's A and B also get weight gradients, 6 per adapter weight; causal
// attention's two products, forward (2) and backward (4), over the half of the [seq, seq] matrix
// a causal mask keeps: 6 * seq * (heads * head_dim) per layer.
struct StepFlops {
  double frozen = 0, lora = 0, attention = 0;
  double total() const { return frozen + lora + attention; }
};

inline StepFlops step_flops_per_token(const models::DecoderConfig& c, int64_t r, int64_t seq) {
  const models::Architecture& arch = models::architecture_of(c);
  StepFlops f;
  for (const models::ProjectionRow& row : arch.projections) {
    const std::vector<int64_t> s = models::projection_shape(row, c, 0);  // [out, in] (the shape's layers are alike)
    const double layers = row.member ? static_cast<double>(c.num_hidden_layers) : 1.0;
    f.frozen += 4.0 * static_cast<double>(s[0] * s[1]) * layers;
    if (row.member) f.lora += 6.0 * static_cast<double>(r * (s[0] + s[1])) * layers;
  }
  f.attention = 6.0 * static_cast<double>(seq) * static_cast<double>(c.num_attention_heads * c.head_dim) *
                static_cast<double>(c.num_hidden_layers);
  return f;
}

// Dense bf16 tensor-core peak (FLOP/s, no sparsity) of a GPU by the name its driver gives; 0
// when unknown (then --peak-tflops gives it). From the vendors' data sheets.
inline double bf16_peak_flops(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H100") && (has("PCIe") || has("PCI"))) return 756e12;
  if (has("H100") || has("H200") || has("H800") || has("GH200")) return 989.4e12;
  if (has("B200")) return 2250e12;
  if (has("A100") || has("A800")) return 312e12;
  if (has("L40S")) return 362e12;
  if (has("RTX 4090")) return 165.2e12;
  return 0;
}

// Runs `step` once under the Kineto profiler (CPU ops, and the device's kernels and copies) and
// writes a Chrome trace to `path`, which bench/trace_summary.py sums up by kind of work.
inline void trace_step(const std::function<void()>& step, const std::string& path, bool cuda) {
  namespace prof = torch::profiler::impl;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  std::set<prof::ActivityType> activities = {prof::ActivityType::CPU};
  if (cuda) activities.insert(prof::ActivityType::CUDA);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  step();
  torch::autograd::profiler::disableProfiler()->save(path);
}

}  // namespace qlora::bench
