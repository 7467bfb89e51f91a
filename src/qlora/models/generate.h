// Autoregressive text generation with a DecoderModel: one prefill pass over the prompt fills the KV
// cache, then one forward per new token over just that token. Greedy or temperature + top-k +
// top-p (nucleus) sampling from a seeded generator, so a run is reproducible from its seed.
// generate_batch runs many sequences (GRPO's rollouts: P prompts x G completions) as one batch.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "qlora/models/decoder.h"

namespace qlora::models {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.0;  // 0 = greedy (argmax); > 0 divides the logits before softmax
  double top_p = 1.0;        // nucleus mass in (0, 1]; 1 keeps the whole distribution
  int64_t top_k = 0;         // keep the k most likely tokens (before top_p); 0 keeps all
  uint64_t seed = 0;         // seeds the CPU generator used for sampling
  std::vector<int64_t> stop_ids;  // e.g. the tokenizer's EOS; generation ends after emitting one
};

// Returns the continuation only (not the prompt). When a stop id ends generation it is the last
// element, so callers can tell "stopped" from "ran out of max_new_tokens". Generation also ends
// at the config's max_position_embeddings (RoPE positions beyond it were never trained).
// Runs without autograd and with dropout off, whatever model.training says; the model is not
// modified. prompt: token ids, non-empty, each in [0, vocab). It is generate_batch of one sequence.
// images (optional): the prompt's images (models/multimodal.h) at its image tokens; with Qwen3.5's
// M-RoPE the new tokens' positions continue after the largest position the images gave.
std::vector<int64_t> generate(const DecoderModel& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options, const ImageInputs* images = nullptr);

// One sequence of a batch: which prompt it continues and how it samples (options.seed seeds its
// own generator; see sequence_seed).
struct BatchSequence {
  int64_t prompt = 0;  // index into generate_batch's prompts
  GenerateOptions options;
};

struct Completion {
  std::vector<int64_t> ids;  // the continuation only; a stop id that ended it is its last element
  bool stopped = false;      // ended by a stop id; false: max_new_tokens or the context limit
};

// Every sequence generated as one batch: each distinct prompt is prefilled once (alone, so its
// cache is exactly the one generate() would build), its cache copied to each of its sequences, then
// one forward per step over the new token of every unfinished sequence. A sequence's completion
// equals generate(model, prompts[s.prompt], s.options) up to the float rounding of a batched GEMM
// (same seed, same draws), whatever else shares the batch. A sequence that ends leaves the batch;
// the loop ends when every sequence has. Same checks and errors as generate(); prompts that no
// sequence names are not run.
// prompt_images (empty, or one per prompt, nullptr for none): each prompt's images, as generate takes them.
std::vector<Completion> generate_batch(const DecoderModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                       const std::vector<BatchSequence>& sequences,
                                       const std::vector<const ImageInputs*>& prompt_images = {});

// The seed of the sequence at `global_index` among all ranks' sequences of a step, from the run's
// seed: a fixed mix of the two, so a completion depends on its place in the step and not on
// which rank or batch samples it. Across steps, count on (step * sequences per step + place), so
// that a resumed run draws what the uninterrupted one would have.
uint64_t sequence_seed(uint64_t seed, int64_t global_index);

// One sampling decision. logits: [vocab] float32 on the CPU. temperature 0 = argmax (first index
// on ties). Otherwise softmax(logits / temperature), restricted to the top_k most likely tokens
// (0: all), renormalized, then to the smallest set of most likely tokens whose mass reaches top_p
// (the most likely token is always kept, so top_p -> 0 is greedy), renormalized, and one draw
// from `gen`. The order of the cuts is transformers' (temperature, top-k, top-p).
int64_t sample_next_token(const at::Tensor& logits, double temperature, double top_p, int64_t top_k,
                          at::Generator& gen);

}  // namespace qlora::models
