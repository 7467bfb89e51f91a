// One JSON record → template segments, per data.format:
//   instruct  {"instruction", "input" (optional), "output"}; names mappable (data.*_field)
//   chat      OpenAI {"messages": [{"role", "content"}, ...]} or ShareGPT
//             {"conversations": [{"from", "value"}, ...]}, told apart by their keys: with
//             data.messages_field empty a record's "messages" is used, else its "conversations";
//             each turn is role/content or from/value by the keys it holds
//   text      {"text"}
// A record that lacks the configured format's keys but has another format's gets an error saying
// which format it looks like and the key to set; a missing mapped field names its data.*_field key.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "qlora/data/dataset.h"

namespace qlora::data {

// ShareGPT speaker names as the common converters write them (FastChat/torchtune: human, gpt,
// system; axolotl also takes user/assistant; Gemma-style data says model; OpenAssistant exports
// say prompter; some dumps say bot or chatgpt) → "user", "assistant" or "system". Throws
// std::invalid_argument listing the accepted names.
std::string sharegpt_role(std::string_view from);

// The conversation of a chat record (see above), roles canonical. Throws std::invalid_argument
// naming the key and turn ("conversations[2]: ...").
std::vector<Message> chat_messages(const nlohmann::json& record, const DatasetOptions& options);

// The record rendered by options.prompt_template (text: one trained segment). Throws
// std::invalid_argument saying what is wrong; callers prefix the file and line.
std::vector<Segment> render_record(const nlohmann::json& record, const DatasetOptions& options);

}  // namespace qlora::data
