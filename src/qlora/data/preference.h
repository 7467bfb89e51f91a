// Preference pairs (data.format = "preference", `qlora run lora_dpo`): one prompt, a chosen and a
// rejected response, rendered by the run's template and tokenized like any training record.
//   {"prompt": "...", "chosen": "...", "rejected": "..."}          strings: the prompt is the user's
//                                                                   turn, each response the answer
//   {"chosen": [messages], "rejected": [messages]}                 the conversational form HF
//                                                                   preference sets ship
//                                                                   (UltraFeedback binarized): the
//                                                                   shared leading messages are the
//                                                                   prompt, the rest each response
//   {"prompt": [messages], "chosen": [messages], "rejected": [...]} the prompt given apart
// Messages are {"role", "content"} (or ShareGPT's {"from", "value"}). Only the responses are
// scored: an assistant turn inside the prompt is context.
// The prompt may hold images, read as a chat record's (record_images.h): image parts with their
// sources, or TRL's vision form, a record-level "images": [paths] with {"type": "image"} parts (or
// "<image>" in a string prompt). Both sequences carry them (Sample::images); a response holds none.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/dataset.h"

namespace qlora::data {

struct PreferencePair {
  std::string origin;  // "<file>: line N"
  // Prompt + response each: labels (unshifted) on the response's tokens only.
  Sample chosen, rejected;
  int64_t prompt_tokens = 0;   // after truncation, shared by both
  bool prompt_truncated = false;
  bool response_truncated = false;
};

struct PreferenceOptions {
  int64_t max_seq_len = 512;     // prompt + response, per sequence (<= 0: no truncation)
  int64_t max_prompt_len = 256;  // the prompt keeps at most its last this many tokens when a pair is too long
};

// A pair that is too long keeps the prompt's end (at most max_prompt_len tokens; a BOS that opens
// it stays) and cuts each response's end to fit max_seq_len; a cut response gets no EOS (it was not
// finished). Throws std::invalid_argument naming the record when a field is missing or of the
// wrong type, the two responses are the same, the conversational prompt is empty, or a response
// has no token left.
std::vector<PreferencePair> load_preference_pairs(const std::string& path, const Tokenizer& tokenizer,
                                                  const DatasetOptions& options, const PreferenceOptions& limits);

// One record as a pair (origin prefixes errors; base_dir: the data file's directory, for images' relative paths).
// Truncation that would cut into an image is refused naming it.
PreferencePair preference_pair(const nlohmann::json& record, const std::string& origin, const Tokenizer& tokenizer,
                               const DatasetOptions& options, const PreferenceOptions& limits,
                               const std::string& base_dir = "");

}  // namespace qlora::data
