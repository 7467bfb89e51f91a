#include "qlora/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/tensor.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace qlora::models {

int64_t sample_next_token(const at::Tensor& logits, double temperature, double top_p, at::Generator& gen) {
  if (logits.dim() != 1 || logits.scalar_type() != at::kFloat || !logits.device().is_cpu()) {
    throw std::invalid_argument("sample_next_token: logits must be float32 [vocab] on the CPU");
  }
  if (temperature < 0.0) throw std::invalid_argument("sample_next_token: temperature must be >= 0");
  if (!(top_p > 0.0 && top_p <= 1.0)) throw std::invalid_argument("sample_next_token: top_p must be in (0, 1]");
  if (temperature == 0.0) return at::argmax(logits).item<int64_t>();

  const at::Tensor probs = at::softmax(logits / temperature, 0);  // [vocab]
  // Stable descending sort: among equal probabilities the lower id comes first, as argmax picks.
  auto [sorted, order] = at::sort(probs, /*stable=*/true, /*dim=*/0, /*descending=*/true);
  // Keep token i while the mass strictly before it is still short of top_p; the first token has
  // zero mass before it, so it always survives (top_p -> 0 degenerates to greedy).
  const at::Tensor before = at::cumsum(sorted, 0) - sorted;
  const at::Tensor kept = sorted.masked_fill(before >= top_p, 0.0);
  // multinomial normalizes the weights itself; drawing from `gen` keeps runs reproducible.
  const int64_t pick = at::multinomial(kept, 1, /*replacement=*/false, gen).item<int64_t>();
  return order[pick].item<int64_t>();
}

std::vector<int64_t> generate(const LlamaModel& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& opt) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
  if (opt.max_new_tokens < 0) throw std::invalid_argument("generate: max_new_tokens must be >= 0");
  const int64_t vocab = model.config.vocab_size;
  for (const int64_t t : prompt) {
    if (t < 0 || t >= vocab) {
      throw std::invalid_argument("generate: prompt token " + std::to_string(t) + " outside the vocab [0, " +
                                  std::to_string(vocab) + ")");
    }
  }
  const int64_t max_len = model.config.max_position_embeddings;
  if (static_cast<int64_t>(prompt.size()) > max_len) {
    throw std::invalid_argument("generate: prompt of " + std::to_string(prompt.size()) +
                                " tokens exceeds max_position_embeddings " + std::to_string(max_len));
  }
  // Validate sampling options before the (possibly long) prefill.
  if (opt.temperature < 0.0) throw std::invalid_argument("generate: temperature must be >= 0");
  if (!(opt.top_p > 0.0 && opt.top_p <= 1.0)) throw std::invalid_argument("generate: top_p must be in (0, 1]");

  // A shallow copy (tensor handles only) with dropout off: generation must not depend on whether
  // the caller left the model in training mode. The cache path never checkpoints anyway.
  LlamaModel m = model;
  m.training = false;
  m.activation_checkpointing = false;

  // Inference mode: no graph, no version counters; the cache tensors never leave this function.
  c10::InferenceMode no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(opt.seed);
  const at::Device device = m.embed_tokens.device();
  modules::KvCache cache;

  std::vector<int64_t> out;
  at::Tensor step = at::tensor(prompt, at::kLong).view({1, -1}).to(device);  // [1, prompt]
  int64_t length = static_cast<int64_t>(prompt.size());
  while (static_cast<int64_t>(out.size()) < opt.max_new_tokens && length < max_len) {
    const at::Tensor logits = m.forward(step, &cache);                 // [1, seq, vocab] fp32
    const at::Tensor last = logits[0][logits.size(1) - 1].to(at::kCPU);  // [vocab]
    const int64_t next = sample_next_token(last.contiguous(), opt.temperature, opt.top_p, gen);
    out.push_back(next);
    ++length;
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) break;
    step = at::tensor({next}, at::kLong).view({1, 1}).to(device);  // [1, 1]
  }
  return out;
}

}  // namespace qlora::models
