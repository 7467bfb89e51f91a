#include "qlora/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/tensor.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>

#include "qlora/modules/kv_cache.h"

namespace qlora::models {

namespace {

// One draw from the categorical distribution of non-negative weights (float32 [n] on the CPU, not
// necessarily normalized): the first index whose running sum, in double and index order, exceeds
// u * total for one uniform u in [0, 1) from gen (53 bits of one 64-bit draw). One random number
// and one pass, where at::multinomial draws an exponential for every token.
int64_t draw_index(const at::Tensor& weights, at::Generator& gen) {
  const at::Tensor w = weights.contiguous();
  const float* p = w.const_data_ptr<float>();
  const int64_t n = w.numel();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += p[i];
  if (!(total > 0.0) || !std::isfinite(total))
    throw std::invalid_argument("sample_next_token: the token probabilities are not finite and positive (the logits "
                                "hold NaN or infinity)");
  uint64_t bits = 0;
  {
    auto* g = at::check_generator<at::CPUGeneratorImpl>(gen);
    std::lock_guard<std::mutex> lock(g->mutex_);
    bits = g->random64();
  }
  const double target = static_cast<double>(bits >> 11) * 0x1p-53 * total;
  double running = 0.0;
  int64_t last = 0;  // the last index of positive weight: where rounding leaves the target unreached
  for (int64_t i = 0; i < n; ++i) {
    if (!(p[i] > 0.0f)) continue;
    running += p[i];
    last = i;
    if (running > target) return i;
  }
  return last;
}

}  // namespace

int64_t sample_next_token(const at::Tensor& logits, double temperature, double top_p, int64_t top_k,
                          at::Generator& gen) {
  if (logits.dim() != 1 || logits.scalar_type() != at::kFloat || !logits.device().is_cpu()) {
    throw std::invalid_argument("sample_next_token: logits must be float32 [vocab] on the CPU");
  }
  if (temperature < 0.0) throw std::invalid_argument("sample_next_token: temperature must be >= 0");
  if (!(top_p > 0.0 && top_p <= 1.0)) throw std::invalid_argument("sample_next_token: top_p must be in (0, 1]");
  if (top_k < 0) throw std::invalid_argument("sample_next_token: top_k must be >= 0 (0 keeps every token)");
  if (temperature == 0.0) return at::argmax(logits).item<int64_t>();

  const at::Tensor probs = at::softmax(logits / temperature, 0);  // [vocab]
  // Every token kept (top_p 1, no top_k: transformers then adds no warper): drawn in vocabulary
  // order, no sort. A top_p of 1 cut after the sort could drop tail tokens whose mass before them
  // rounds to 1; this keeps them, as the definition does.
  if (top_p == 1.0 && (top_k == 0 || top_k >= probs.size(0))) return draw_index(probs, gen);
  // Stable descending sort: among equal probabilities the lower id comes first, as argmax picks.
  auto [sorted, order] = at::sort(probs, /*stable=*/true, /*dim=*/0, /*descending=*/true);
  if (top_k > 0 && top_k < sorted.size(0)) {  // top_p then measures mass within the k kept
    sorted = sorted.narrow(0, 0, top_k);
    order = order.narrow(0, 0, top_k);
    sorted = sorted / sorted.sum();
  }
  // Keep token i while the mass strictly before it is still short of top_p; the first token has
  // zero mass before it, so it always survives (top_p -> 0 degenerates to greedy).
  const at::Tensor before = at::cumsum(sorted, 0) - sorted;
  const at::Tensor kept = sorted.masked_fill(before >= top_p, 0.0);
  return order[draw_index(kept, gen)].item<int64_t>();
}

uint64_t sequence_seed(uint64_t seed, int64_t global_index) {
  // splitmix64's finalizer over seed + golden-ratio steps. Not seed + index: runs with seeds s and
  // s + 1 would then share every sequence's draws but one, shifted by one place.
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (static_cast<uint64_t>(global_index) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

namespace {

void check_prompt(const DecoderModel& model, const std::vector<int64_t>& prompt) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
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
}

void check_options(const GenerateOptions& opt) {
  if (opt.max_new_tokens < 0) throw std::invalid_argument("generate: max_new_tokens must be >= 0");
  if (opt.temperature < 0.0) throw std::invalid_argument("generate: temperature must be >= 0");
  if (!(opt.top_p > 0.0 && opt.top_p <= 1.0)) throw std::invalid_argument("generate: top_p must be in (0, 1]");
  if (opt.top_k < 0) throw std::invalid_argument("generate: top_k must be >= 0 (0 keeps every token)");
}

// The unfinished sequences as one batch. Why a per-row layout rather than one padded prefill:
// each distinct prompt is prefilled alone (batch 1, no padding), which is exact for every mixer: a
// Gated DeltaNet layer's conv window and recurrent state never see a pad token, and sliding
// windows and RoPE see the prompt as generate() does. The rows then meet only in the attention
// layers' key slots, left-padded to the longest prompt so that every row's newest token sits in the
// same last slot: the padding slots are masked out (key_mask), each row's RoPE position is its own
// length (positions), and within a row the slot distance equals the position distance, so a
// sliding window measured in slots (causal_window_mask) is the row's own. DeltaNet state and conv
// rows need no padding at all.
struct Batch {
  modules::KvCache cache;   // every layer's tensors [rows, ...]; cache.seen = key slots
  at::Tensor key_mask;      // [rows, slots] bool on the model's device: false on left padding
  at::Tensor positions;     // [rows] int64 on the device: the position of each row's next token
  bool shifted = false;     // a row's positions are not its slots (M-RoPE after images)
  at::Tensor logits;        // [rows, vocab] fp32: the distribution of each row's next token
  std::vector<int64_t> seq;  // the sequence each row generates
};

struct Prefilled {
  modules::KvCache cache;
  at::Tensor last;     // the logits of its next token [1, vocab]
  int64_t shift = 0;   // its next position minus its length (M-RoPE: the images' positions ran ahead)
};

// Prefills `prompt` (with its images) alone: its cache (batch 1), its next token's logits, and how far
// transformers' rope_deltas shift the positions of the tokens after it.
Prefilled prefill(const DecoderModel& m, const std::vector<int64_t>& prompt, const ImageInputs* images) {
  Prefilled p;
  const at::Tensor tokens = at::tensor(prompt, at::kLong).view({1, -1}).to(m.embed_tokens.device());  // [1, n]
  const at::Tensor logits = m.forward(tokens, &p.cache, images);                 // [1, n, vocab]
  p.last = logits.select(1, logits.size(1) - 1);
  if (images && images->positions.defined())
    p.shift = images->positions.max().item<int64_t>() + 1 - static_cast<int64_t>(prompt.size());
  return p;
}

// Each row's layer tensors from its prompt's batch-1 cache: attention K/V left-padded to `slots`.
at::Tensor gather_rows(const std::vector<at::Tensor>& per_prompt, const at::Tensor& row_prompt, int64_t slots) {
  if (!per_prompt.front().defined()) return {};  // a layer without this state (e.g. KV-shared)
  std::vector<at::Tensor> padded;
  for (const at::Tensor& t : per_prompt) {
    const int64_t pad = t.dim() == 4 && slots > 0 ? slots - t.size(2) : 0;
    padded.push_back(pad > 0 ? at::constant_pad_nd(t, {0, 0, pad, 0}) : t);
  }
  return at::cat(padded, 0).index_select(0, row_prompt);
}

// The batch of `seqs` (sequence index -> prompt slot `slot_of`), from the prefilled prompts.
Batch start_batch(std::vector<Prefilled>& prefilled, const std::vector<int64_t>& lengths,
                  const std::vector<int64_t>& seqs, const std::vector<int64_t>& slot_of, const at::Device device) {
  Batch b;
  b.seq = seqs;
  std::vector<int64_t> rp;
  for (const int64_t s : seqs) rp.push_back(slot_of[static_cast<size_t>(s)]);
  const at::Tensor row_prompt = at::tensor(rp, at::kLong).to(device);  // [rows]
  const int64_t slots = *std::max_element(lengths.begin(), lengths.end());
  const size_t layers = prefilled.front().cache.layers.size();
  b.cache.layers.resize(layers);
  for (size_t l = 0; l < layers; ++l) {
    std::vector<at::Tensor> k, v, conv, state;
    for (Prefilled& p : prefilled) {
      modules::LayerCache& c = p.cache.layers[l];
      k.push_back(c.k), v.push_back(c.v), conv.push_back(c.conv), state.push_back(c.state);
    }
    modules::LayerCache& out = b.cache.layers[l];
    out.k = gather_rows(k, row_prompt, slots);
    out.v = gather_rows(v, row_prompt, slots);
    out.conv = gather_rows(conv, row_prompt, 0);
    out.state = gather_rows(state, row_prompt, 0);
  }
  std::vector<int64_t> shifts;
  for (Prefilled& p : prefilled) {
    p.cache.reset();  // the batch holds its own copies now
    shifts.push_back(p.shift);
    b.shifted = b.shifted || p.shift != 0;
  }
  b.cache.seen = slots;
  const at::Tensor len = at::tensor(lengths, at::kLong).to(device);                       // [prompts]
  const at::Tensor slot = at::arange(slots, len.options());                               // [slots]
  b.key_mask = (slot.unsqueeze(0) >= (slots - len).unsqueeze(1)).index_select(0, row_prompt);  // [rows, slots]
  b.positions = (len + at::tensor(shifts, at::kLong).to(device)).index_select(0, row_prompt);
  std::vector<at::Tensor> last;
  for (Prefilled& p : prefilled) last.push_back(p.last);
  b.logits = at::cat(last, 0).index_select(0, row_prompt);  // [rows, vocab]
  return b;
}

// Keeps the rows `keep` (indices into the batch) and drops the key slots no kept row uses.
void keep_rows(Batch& b, const std::vector<int64_t>& keep) {
  const at::Tensor idx = at::tensor(keep, at::kLong).to(b.key_mask.device());
  const auto select = [&idx](at::Tensor& t) {
    if (t.defined()) t = t.index_select(0, idx);
  };
  select(b.key_mask);
  const int64_t first = b.key_mask.any(0).to(at::kByte).argmax().item<int64_t>();  // first slot in use
  const int64_t slots = b.key_mask.size(1) - first;
  b.key_mask = b.key_mask.narrow(1, first, slots);
  for (modules::LayerCache& c : b.cache.layers) {
    for (at::Tensor* t : {&c.k, &c.v, &c.conv, &c.state}) select(*t);
    for (at::Tensor* t : {&c.k, &c.v})
      if (t->defined()) *t = t->narrow(2, first, slots);
    c.k_room = c.v_room = at::Tensor();  // k and v are copies now; generate_batch reserves again
  }
  b.cache.seen = slots;
  select(b.positions);
  select(b.logits);
  std::vector<int64_t> seq;
  for (const int64_t r : keep) seq.push_back(b.seq[static_cast<size_t>(r)]);
  b.seq = std::move(seq);
}

// Key/value slots for every token the rows may still generate, so that each decode step writes its
// token's keys in place (modules::reserve_kv) rather than copying the whole cache.
void reserve(Batch& b, const std::vector<BatchSequence>& sequences, const std::vector<Completion>& out) {
  int64_t more = 0;
  for (const int64_t s : b.seq) {
    const size_t i = static_cast<size_t>(s);
    more = std::max<int64_t>(more, sequences[i].options.max_new_tokens - static_cast<int64_t>(out[i].ids.size()));
  }
  for (modules::LayerCache& c : b.cache.layers) modules::reserve_kv(c, b.cache.seen + more);
}

// One forward over each row's newest token ([rows] int64 on the device): extends the cache and
// sets the next logits.
void decode_step(const DecoderModel& m, Batch& b, const at::Tensor& next) {
  const at::Tensor tokens = next.view({-1, 1});  // [rows, 1]
  b.key_mask = at::cat({b.key_mask, at::ones({tokens.size(0), 1}, b.key_mask.options())}, 1);  // [rows, slots + 1]
  at::Tensor logits;
  if (!b.shifted && b.key_mask.all().item<bool>()) {
    logits = m.forward(tokens, &b.cache);  // no padding: every row is at position slots
  } else {
    logits = m.forward(tokens, b.positions.view({-1, 1}), b.key_mask.unsqueeze(1), &b.cache);
  }
  b.positions = b.positions + 1;
  b.logits = logits.select(1, 0);  // [rows, vocab]
}

// Each row's next token: greedy rows by one argmax over the batch, sampled rows from their own
// generator (a sequence's draws must not depend on its batch).
std::vector<int64_t> sample_rows(const Batch& b, const std::vector<BatchSequence>& sequences,
                                 std::vector<at::Generator>& gens) {
  const at::Tensor greedy = b.logits.argmax(-1).cpu();  // [rows] int64
  const int64_t* greedy_ids = greedy.data_ptr<int64_t>();
  std::vector<int64_t> next(b.seq.size());
  for (size_t r = 0; r < b.seq.size(); ++r) {
    const size_t s = static_cast<size_t>(b.seq[r]);
    const GenerateOptions& o = sequences[s].options;
    next[r] = o.temperature == 0.0 ? greedy_ids[r]
                                   : sample_next_token(b.logits[static_cast<int64_t>(r)].to(at::kCPU).contiguous(),
                                                       o.temperature, o.top_p, o.top_k, gens[s]);
  }
  return next;
}

// The sequences worth running (a token to generate) and the prompt slot of each sequence; fills
// `used` with the distinct prompts in slot order.
std::vector<int64_t> plan(const DecoderModel& m, const std::vector<std::vector<int64_t>>& prompts,
                          const std::vector<BatchSequence>& sequences, std::vector<int64_t>& slot_of,
                          std::vector<int64_t>& used) {
  std::vector<int64_t> slot(prompts.size(), -1), run;
  for (size_t s = 0; s < sequences.size(); ++s) {
    const BatchSequence& q = sequences[s];
    if (q.prompt < 0 || q.prompt >= static_cast<int64_t>(prompts.size())) {
      throw std::invalid_argument("generate_batch: sequence " + std::to_string(s) + " names prompt " +
                                  std::to_string(q.prompt) + " of " + std::to_string(prompts.size()));
    }
    check_options(q.options);
    const std::vector<int64_t>& p = prompts[static_cast<size_t>(q.prompt)];
    check_prompt(m, p);
    if (q.options.max_new_tokens == 0 || static_cast<int64_t>(p.size()) >= m.config.max_position_embeddings) continue;
    int64_t& sl = slot[static_cast<size_t>(q.prompt)];
    if (sl < 0) {
      sl = static_cast<int64_t>(used.size());
      used.push_back(q.prompt);
    }
    slot_of[s] = sl;
    run.push_back(static_cast<int64_t>(s));
  }
  return run;
}

}  // namespace

std::vector<Completion> generate_batch(const DecoderModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                       const std::vector<BatchSequence>& sequences,
                                       const std::vector<const ImageInputs*>& prompt_images) {
  if (!prompt_images.empty() && prompt_images.size() != prompts.size())
    throw std::invalid_argument("generate_batch: " + std::to_string(prompt_images.size()) + " prompts' images for " +
                                std::to_string(prompts.size()) + " prompts");
  std::vector<int64_t> slot_of(sequences.size(), -1), used;
  const std::vector<int64_t> run = plan(model, prompts, sequences, slot_of, used);
  std::vector<Completion> out(sequences.size());
  if (run.empty()) return out;

  // A shallow copy (tensor handles only) with dropout off: generation must not depend on whether
  // the caller left the model in training mode. The cache path never checkpoints anyway.
  DecoderModel m = model;
  m.training = false;
  m.activation_checkpointing = false;
  // Inference mode: no graph, no version counters; the cache tensors never leave this function.
  c10::InferenceMode no_grad;
  const at::Device device = m.embed_tokens.device();

  std::vector<Prefilled> prefilled;
  std::vector<int64_t> lengths;
  for (const int64_t p : used) {
    prefilled.push_back(prefill(m, prompts[static_cast<size_t>(p)],
                                prompt_images.empty() ? nullptr : prompt_images[static_cast<size_t>(p)]));
    lengths.push_back(static_cast<int64_t>(prompts[static_cast<size_t>(p)].size()));
  }
  Batch b = start_batch(prefilled, lengths, run, slot_of, device);
  prefilled.clear();

  std::vector<at::Generator> gens;
  for (const BatchSequence& q : sequences) gens.push_back(at::make_generator<at::CPUGeneratorImpl>(q.options.seed));
  const int64_t max_len = m.config.max_position_embeddings;
  bool reserved = false;
  while (true) {
    const std::vector<int64_t> next = sample_rows(b, sequences, gens);
    std::vector<int64_t> keep;
    for (size_t r = 0; r < next.size(); ++r) {
      const size_t s = static_cast<size_t>(b.seq[r]);
      const GenerateOptions& o = sequences[s].options;
      Completion& c = out[s];
      c.ids.push_back(next[r]);
      c.stopped = std::find(o.stop_ids.begin(), o.stop_ids.end(), next[r]) != o.stop_ids.end();
      const int64_t length = static_cast<int64_t>(prompts[static_cast<size_t>(sequences[s].prompt)].size() + c.ids.size());
      if (!c.stopped && static_cast<int64_t>(c.ids.size()) < o.max_new_tokens && length < max_len)
        keep.push_back(static_cast<int64_t>(r));
    }
    if (keep.empty()) break;
    std::vector<int64_t> kept_next;
    for (const int64_t r : keep) kept_next.push_back(next[static_cast<size_t>(r)]);
    if (keep.size() < next.size() || !reserved) {  // a finished row leaves the batch
      if (keep.size() < next.size()) keep_rows(b, keep);
      reserve(b, sequences, out);
      reserved = true;
    }
    decode_step(m, b, at::tensor(kept_next, at::kLong).to(device));
  }
  return out;
}

std::vector<int64_t> generate(const DecoderModel& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& opt, const ImageInputs* images) {
  return generate_batch(model, {prompt}, {BatchSequence{0, opt}}, {images}).front().ids;
}

}  // namespace qlora::models
