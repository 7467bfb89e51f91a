// A decoder of any family qlora trains (architecture.h has their tables, decoder_config.h what
// each computes differently) as a plain struct of tensors, loaded from a Hugging Face checkpoint
// directory, with a frozen base (full precision or NF4) and optional LoRA adapters whose names
// follow PEFT's adapter_model.safetensors keys.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qlora/models/architecture.h"
#include "qlora/models/key_layout.h"
#include "qlora/models/decoder_config.h"
#include "qlora/models/multimodal.h"
#include "qlora/models/unit_hooks.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/kv_cache.h"
#include "qlora/modules/lora_linear.h"

namespace qlora::models {

struct DecoderLoadOptions {
  // Every *_proj.weight of the decoder layers is read as NF4 (io::load_nf4, one tensor at
  // a time), so a full-precision copy of the base never sits whole in memory.
  bool base_in_nf4 = false;
  at::ScalarType compute_dtype = at::kFloat;  // kFloat or kBFloat16
  // Storage dtype of the large frozen dense weights: embed_tokens and the lm_head base (norms stay
  // in the compute dtype; decoder projections are NF4 or the compute dtype). Undefined (the
  // default) means compute_dtype, i.e. no conversion. kBFloat16 with fp32 compute halves those
  // weights' memory (2 x 0.5 GB -> 2 x 0.25 GB for Llama-2-7B); compute stays fp32: embedding rows
  // are gathered in bf16 and widened (exact), and the lm_head widens its weight a chunk of rows at
  // a time (DecoderModel::lm_head_chunk_rows), so with a bf16 checkpoint the results equal those
  // of compute_dtype storage.
  at::ScalarType frozen_dtype = at::ScalarType::Undefined;
  at::Device device = at::kCPU;
  // LoRA targets, as rows of the family's architecture (models/architecture.h) in either spelling:
  // PEFT (q_proj ... down_proj, lm_head for the output projection) or short (q ... down, output);
  // a fused projection (Phi-3's qkv_proj) by its name or by all its parts (q, k, v).
  std::vector<std::string> lora_targets;
  int64_t lora_r = 8;
  double lora_alpha = 16.0;
  double lora_dropout = 0.0;
  bool lora_use_rslora = false;  // scale alpha / sqrt(r) instead of alpha / r
  bool lora_use_dora = false;    // DoRA: a trainable magnitude per output row (not on the output projection)
  uint64_t seed = 0;  // LoRA A init: drawn layer by layer in table order, then lm_head
  bool activation_checkpointing = false;
  // Called with each decoder layer as soon as it is built (in order; the layer stays at that
  // address in the returned model). A sharded engine takes its slice here, so the whole base never
  // sits in one rank's memory.
  // The family's architecture says which of the layer's tensors it holds.
  std::function<void(int64_t, modules::DecoderLayer&, const Architecture&)> on_layer_loaded;
};

struct DecoderModel {
  DecoderConfig config;
  // Where the checkpoint it was loaded from keeps the language model's weights; a merged export
  // writes the same layout.
  KeyLayout key_layout = KeyLayout::kText;
  // What of that checkpoint no computation reads (a multimodal one's vision tower and projector).
  SkippedWeights skipped_weights;
  at::ScalarType compute_dtype = at::kFloat;
  // Storage dtype of embed_tokens and the dense lm_head base (DecoderLoadOptions::frozen_dtype):
  // compute_dtype, or kBFloat16 under fp32 compute. forward() follows the tensors' own dtypes;
  // this records what load_decoder chose.
  at::ScalarType frozen_dtype = at::kFloat;
  // The lm_head runs this many vocab rows at a time: a dense base stored narrower than the compute
  // dtype is widened block by block (forward and backward), so no [vocab, hidden] compute-dtype copy
  // exists; loss() goes through the vocabulary in blocks of this many rows.
  int64_t lm_head_chunk_rows = 4096;
  // loss() scores this many (scored) tokens at a time (models/output_head.h); 0:
  // default_loss_chunk_tokens, one [tokens, vocab block] fp32 logits block within kLossChunkBytes.
  int64_t loss_chunk_tokens = 0;
  // false: loss() forms the whole [tokens, vocab] logits, as forward() does; the reference the tests
  // and bench_train_step --ce-compare measure the chunked loss against.
  bool chunked_loss = true;
  // loss(), row_losses() and token_losses() score logits / logit_temperature (OutputHead::temperature):
  // GRPO's log-probabilities at its sampling temperature. forward() and generation ignore it.
  double logit_temperature = 1.0;
  at::Tensor embed_tokens;  // [vocab, hidden], frozen, in frozen_dtype
  modules::PerLayerInputs per_layer_inputs;  // Gemma 4's, of the embedding unit; undefined for the others
  std::vector<modules::DecoderLayer> layers;
  at::Tensor norm;                 // [hidden], frozen
  modules::LoraLinear lm_head;     // [vocab, hidden], dense (frozen_dtype); shares embed_tokens when tied
  at::Tensor inv_freq;             // [head_dim / 2] fp32
  // Rows of embed_tokens and the lm_head base that the run replaced before training (the recipes'
  // model.untrained_tokens = "mean"; train/untrained_tokens.h): the exports write these in place of
  // the checkpoint's rows. ids ascending; embed, head: [ids, hidden], the rows as the model holds
  // them (head undefined when the head is the tied embedding). Empty: the checkpoint's rows.
  struct TokenRows {
    std::vector<int64_t> ids;
    at::Tensor embed, head;
  } token_rows;
  at::Tensor inv_freq_local;       // Gemma 3's, OLMo 3's sliding layers' own frequencies; undefined: inv_freq
  bool activation_checkpointing = false;
  bool training = false;           // enables LoRA dropout
  std::shared_ptr<UnitHooks> hooks;  // optional; see UnitHooks
  // A multimodal checkpoint's vision tower where the run reads images (recipes load it; a sharded
  // run shards it: engine::ShardedDecoder::add_tower); its trainable tensors (LoRA on its encoder linears, the projector: vision::
  // add_tower_lora / train_projector) are among lora_parameters(). Null: text only.
  std::shared_ptr<vision::Tower> tower;
  // Router statistics: when set, each training forward (m.training, no cache) adds the tokens each
  // expert of each MoE layer received to `counts`, [layers, experts] int64 on the model's device (rows
  // of dense layers stay 0; counted there, no host sync per layer); the caller reads and clears it.
  // `valid` [batch, seq] bool (the caller's, per batch; undefined: every token) marks the tokens
  // counted, so padding is not.
  struct RouterCounts {
    at::Tensor counts, valid;
  };
  std::shared_ptr<RouterCounts> router_counts;

  // tokens: [batch, seq] int64. With a cache, the tokens continue the cached sequence and the
  // cache is extended (cache and activation checkpointing are exclusive: generation needs no
  // backward). Returns logits [batch, seq, vocab] float32.
  // images (optional): the prompt's images at its image tokens (a prefill: the cache empty).
  at::Tensor forward(const at::Tensor& tokens, modules::KvCache* cache = nullptr,
                     const ImageInputs* images = nullptr) const;

  // Packed rows (training): several samples per row, each with its own positions and attending
  // only within itself. tokens, position_ids: [batch, seq] int64, positions restarting at 0 per
  // sample (they drive RoPE); attn_mask: [batch, seq, seq] bool, true where query i may attend to
  // key j (e.g. data::block_causal_mask), with at least one true per row (give padding a
  // causal block of its own). Returns logits [batch, seq, vocab] float32.
  // With a cache (a generation batch, models/generate.h): the tokens continue each row, position_ids
  // are each row's own positions and attn_mask is [batch, seq, past + seq] over the cached key slots
  // and the new ones (false on a row's left padding).
  // A model with Gated DeltaNet layers takes one token per row here (those layers read no mask: each
  // row's state is its own, so a row prefilled alone never needs padding).
  // images (optional, models/multimodal.h): the batch's image features placed at its image tokens
  // and, for Qwen3.5, their 3-D positions (the 1-D position_ids still say where packed samples start).
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& position_ids, const at::Tensor& attn_mask,
                     modules::KvCache* cache = nullptr, const ImageInputs* images = nullptr) const;

  // The summed token cross-entropy over labels != -100 (labels: [batch, seq] int64, already shifted
  // as data::collate makes them), as at::cross_entropy_loss(forward(...), labels, Sum) computes it, but
  // by chunks of tokens: no [tokens, vocab] logits tensor exists, in forward or backward (see
  // chunked_token_loss). Returns a 0-dim fp32 tensor; the unit hooks fire as in forward().
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& labels, const ImageInputs* images = nullptr) const;
  // The same over packed rows (position_ids and attn_mask as the packed forward takes them).
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& position_ids, const at::Tensor& attn_mask,
                  const at::Tensor& labels, const ImageInputs* images = nullptr) const;
  // The same summed per row: [batch] fp32, row b = -(log-probability of its scored labels), the
  // sequence log-probabilities of preference losses; its backward weighs each row by its gradient.
  at::Tensor row_losses(const at::Tensor& tokens, const at::Tensor& labels) const;
  // The same over packed rows, with images (as loss() takes them): a preference pair's rows with their prompt's images.
  at::Tensor row_losses(const at::Tensor& tokens, const at::Tensor& position_ids, const at::Tensor& attn_mask,
                        const at::Tensor& labels, const ImageInputs* images) const;
  // The same per token: [batch, seq] fp32, each scored label's cross-entropy (0 where unscored), the
  // per-token log-probabilities GRPO weighs one by one. Still no [tokens, vocab] logits; with an
  // adapter on the output head its gradients are kept per token, so that case costs memory.
  // entropy (optional): set to each token's entropy of its softmax, [batch, seq] fp32, 0 where
  // unscored (OutputHead::entropy), from the same pass over the vocabulary.
  at::Tensor token_losses(const at::Tensor& tokens, const at::Tensor& labels, at::Tensor* entropy = nullptr) const;
  // The same over packed rows, with images (GRPO's completions of prompts with images).
  at::Tensor token_losses(const at::Tensor& tokens, const at::Tensor& position_ids, const at::Tensor& attn_mask,
                          const at::Tensor& labels, const ImageInputs* images, at::Tensor* entropy = nullptr) const;

  // Trainable tensors with PEFT names, e.g.
  // base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight ([r, in]) / .lora_B.weight
  // (a multimodal gemma3: base_model.model.model.language_model.layers.0...; key_layout.h), and
  // with DoRA each adapted projection's .lora_magnitude_vector ([out], peft's key); then the vision
  // tower's (vision::tower_trainable: its adapters, the trained projector as peft's modules_to_save keys).
  std::vector<std::pair<std::string, at::Tensor>> lora_parameters() const;
  // lora_parameters() as the PEFT adapter holds them: the same tensors, except where peft orders a
  // family's fused expert rows otherwise (gpt-oss: gate_up's lora_B rows interleave gate's and up's),
  // a copy in peft's order there. to_peft: one entry's tensor (or its gradient) in peft's order.
  std::vector<std::pair<std::string, at::Tensor>> peft_parameters() const;
  at::Tensor to_peft(const std::string& name, const at::Tensor& t) const;
  // Layer i's forward options (its window, the family's norm and attention numerics).
  modules::LayerDims dims(int64_t layer) const;
  const Architecture& architecture() const { return architecture_of(config); }
};

// checkpoint_dir: an HF directory with config.json and model.safetensors (or shards + index).
// Errors name the checkpoint and the tensor (missing key, wrong shape).
DecoderModel load_decoder(const std::string& checkpoint_dir, const DecoderLoadOptions& options);

}  // namespace qlora::models
