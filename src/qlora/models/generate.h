// Autoregressive text generation with a LlamaModel: one prefill pass over the prompt fills the KV
// cache, then one forward per new token over just that token. Greedy or temperature + top-p
// (nucleus) sampling from a seeded generator, so a run is reproducible from its seed.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "qlora/models/llama.h"

namespace qlora::models {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.0;  // 0 = greedy (argmax); > 0 divides the logits before softmax
  double top_p = 1.0;        // nucleus mass in (0, 1]; 1 keeps the whole distribution
  uint64_t seed = 0;         // seeds the CPU generator used for sampling
  std::vector<int64_t> stop_ids;  // e.g. the tokenizer's EOS; generation ends after emitting one
};

// Returns the continuation only (not the prompt). When a stop id ends generation it is the last
// element, so callers can tell "stopped" from "ran out of max_new_tokens". Generation also ends
// at the config's max_position_embeddings (RoPE positions beyond it were never trained).
// Runs without autograd and with dropout off, whatever model.training says; the model is not
// modified. prompt: token ids, non-empty, each in [0, vocab).
std::vector<int64_t> generate(const LlamaModel& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);

// One sampling decision. logits: [vocab] float32 on the CPU. temperature 0 = argmax (first index
// on ties). Otherwise softmax(logits / temperature), restricted to the smallest set of most
// likely tokens whose mass reaches top_p (the most likely token is always kept, so top_p -> 0 is
// greedy), renormalized, and one draw from `gen`.
int64_t sample_next_token(const at::Tensor& logits, double temperature, double top_p, at::Generator& gen);

}  // namespace qlora::models
