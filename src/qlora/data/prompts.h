// GRPO's prompts (data.format = "prompt"; `qlora run lora_grpo`), as TRL's GRPOTrainer reads them:
//   {"prompt": "...", "answer": ..., other fields}        a string: the model's input as written
//                                                         (BOS as data.add_bos says)
//   {"prompt": [messages], "answer": ..., other fields}   a conversation ending with a user message
//                                                         ({"role", "content"} or ShareGPT's
//                                                         {"from", "value"}), rendered by
//                                                         data.template up to the opened answer
//                                                         turn (transformers' add_generation_prompt)
// Every field of the record stays with it: the rewards read them (train/rewards.h: the answer
// reward's field, the reward command's input).
// A conversation's user turns may hold images, read as a chat record's (record_images.h: image parts
// with their sources, or a record-level "images" with {"type": "image"} parts or "<image>" in the
// text, TRL's vision GRPO form): each placeholder expanded as the model's processor does; the
// rollouts prefill with them and the loss's log-probs see them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/dataset.h"

namespace qlora::data {

struct PromptRecord {
  std::string origin;         // "<file>: line N"
  nlohmann::json record;      // the record as read, every field
  std::string text;           // the prompt as the model reads it
  std::vector<int64_t> tokens;
  std::string end_of_turn;    // what the template writes after an answer ("" for a string prompt)
  std::vector<SampleImage> images;  // the prompt's, in the order of their tokens
};

// One record (base_dir: the data file's directory, for images' relative paths). Throws
// std::invalid_argument (callers prefix the origin) when "prompt" is missing or neither a string nor
// messages, the conversation does not end with a user message, a string prompt comes with images, or
// the prompt leaves no room for a completion in options.max_seq_len tokens.
PromptRecord prompt_record(const nlohmann::json& record, const std::string& origin, const Tokenizer& tokenizer,
                           const DatasetOptions& options, const std::string& base_dir = "");

// Every record of a JSON / JSONL file (read_json_records), in order; errors name the file and line.
std::vector<PromptRecord> load_prompts(const std::string& path, const Tokenizer& tokenizer,
                                       const DatasetOptions& options);

}  // namespace qlora::data
