// The embedded default of `qlora run lora_finetune`: a tiny Llama-shaped model written as an HF
// checkpoint directory (so the real loading path runs), the bundled tokenizer and data set.
//
// The base is pre-trained, as a real base model is: a few minutes of full-parameter training on
// plain text ("Add the numbers.\n35 + 4\n39", "Reverse the word.\nkite\netik"), once per
// repository: the result ships in src/qlora/train/tiny_base_v<N>/ (scripts/make_tiny_base.sh makes it;
// recipe.tiny_base_shipped checks it); without it, once per machine, cached (see tiny_base_cache_dir).
// The LoRA fine-tune then teaches it the Alpaca instruction format, and
// since the character-level tokenizer (tests/data/tokenizer_chars) spells every word and number
// a character at a time, the skills carry over to the held-out file's words and sums, which
// neither the pretraining nor the training file contains.
#pragma once

#include <string>

namespace qlora::train {

// Where the bundled data lives: $QLORA_DATA_DIR, else the source tree's tests/data.
std::string bundled_data_dir();

// The embedded default's training file (data.path "") and held-out file: the validation file of
// a run whose data is the embedded default's (data.path "" and data.val_path "").
std::string bundled_train_path();
std::string bundled_val_path();
// The embedded default's tokenizer (one piece per character), which its base carries.
std::string bundled_tokenizer_path();

// Where the pre-trained tiny base is cached: $QLORA_CACHE_DIR, else $XDG_CACHE_HOME/qlora, else
// $HOME/.cache/qlora, with a directory name that changes whenever the base would.
std::string tiny_base_cache_dir();

// The randomly initialised tiny base (bf16, fixed seed) with `tokenizer` copied beside it and
// vocab_size = vocab, into an existing directory: what pre-training starts from. With the
// 512-piece tests/data/tokenizer it is the embedded default's base before #12, which
// tests/data/legacy_resume was trained on.
void write_random_tiny_base(const std::string& dir, const std::string& tokenizer, int64_t vocab);

// Writes <dir> (config.json, model.safetensors, tokenizer.model) unless it already holds a
// complete checkpoint (a resumed run keeps the base it started with): a copy of the shipped
// pre-trained base, else of the cached one, pre-training it first when the cache has none (a few
// minutes; concurrent processes wait for one another through a lock file). Deterministic on one machine: one thread,
// fixed seeds (another CPU's kernels give other bits).
// Committed atomically. Returns dir.
std::string ensure_tiny_base(const std::string& dir);

}  // namespace qlora::train
