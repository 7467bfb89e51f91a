// Where a checkpoint keeps its language model's weights. The architecture tables name the keys of a
// text-only model ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"); the Hub's
// multimodal Gemma 3 (Gemma3ForConditionalGeneration) nests the same language model beside a
// vision tower and a projector, under one of two prefixes:
//   language_model.model.X, language_model.lm_head.weight: the Hub's files, and what transformers
//       (4.50 ... 5.x) writes with save_pretrained (it renames the modules back on save);
//   model.language_model.X, lm_head.weight: the class's module names since transformers 4.52, so a
//       state_dict saved as it is; and the names PEFT gives the adapter's modules.
// Both are read; a merged export writes the layout its input had.
#pragma once
#include <cstdint>
#include <string>

#include <vector>

#include "qlora/io/checkpoint_dir.h"
#include "qlora/models/architecture.h"
#include "qlora/models/decoder_config.h"

namespace qlora::models {

enum class KeyLayout {
  kText,           // model.X, lm_head.weight
  kLanguageModel,  // language_model.model.X, language_model.lm_head.weight
  kModelLanguage,  // model.language_model.X, lm_head.weight
};

// A text-only key or module name ("model.norm.weight", "lm_head") in `layout`.
std::string layout_key(KeyLayout layout, const std::string& text_key);
// The inverse: a language-model key of `layout` in its text-only spelling ("model.X", "lm_head.weight").
std::string text_key(KeyLayout layout, const std::string& key);
// The names PEFT gives a model of this config's class (the module names of transformers 5).
KeyLayout peft_layout(const DecoderConfig& config);
// adapter_config.json's target_modules for a multimodal model, as a regular expression over module
// names (PEFT fullmatches a string): a list of names ("q_proj") would match by suffix and wrap the
// vision tower's q/k/v projections too. One alternative per targeted row (PEFT names), matching the
// module under the multimodal class and under the text-only class AutoModelForCausalLM builds, e.g.
// model\.(?:language_model\.)?layers\.\d+\.self_attn\.q_proj|lm_head.
// tower_modules: the vision tower's adapted modules (vision::adapted_modules), one alternative per
// module name with its layer index as \d+ ("model\.visual\.blocks\.\d+\.attn\.qkv").
std::string peft_target_pattern(const Architecture& arch, KeyLayout layout, const std::vector<std::string>& peft_names,
                                const std::vector<std::string>& tower_modules = {});
// The layout of `ckpt`'s language model, found by its embedding: kText for a text-only config; for a
// multimodal one whichever prefix holds the embedding, and an error naming the checkpoint and both
// keys when neither does.
KeyLayout key_layout_of(const io::CheckpointDir& ckpt, const DecoderConfig& config);
// Whether a checkpoint key belongs to the language model (or to what no text computation reads,
// e.g. "vision_tower.*" and "multi_modal_projector.*").
bool is_language_model_key(KeyLayout layout, const std::string& key);

// The checkpoint tensors outside the language model (a vision tower, a projector, Qwen3.5's
// multi-token prediction block mtp.*, in any layout): never read, copied as they are into merged exports.
struct SkippedWeights {
  int64_t tensors = 0;
  int64_t bytes = 0;
  std::string first;  // a key of them, to name in the log
};
SkippedWeights skipped_weights(const io::CheckpointDir& ckpt, KeyLayout layout);
// One line for the log: "skipped 437 tensors (0.84 GB) outside the language model (a vision
// tower, a multi-modal projector, mtp.*; e.g. 'vision_tower...'): not computed, copied unchanged into
// merged exports"; empty when nothing was skipped.
std::string skipped_weights_note(const SkippedWeights& skipped);

}  // namespace qlora::models
