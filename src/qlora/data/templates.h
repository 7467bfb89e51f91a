// Prompt templates: a record becomes text segments, each marked prompt (no loss unless
// train_on_input) or response (loss).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "qlora/io/enum_names.h"

namespace qlora::data {

enum class TemplateKind { kAlpaca, kLlama2Chat, kLlama3Chat, kChatML };

inline constexpr io::EnumName<TemplateKind> kTemplateKindNames[] = {
    {TemplateKind::kAlpaca, "alpaca"},
    {TemplateKind::kLlama2Chat, "llama2-chat"},
    {TemplateKind::kLlama3Chat, "llama3-chat"},
    {TemplateKind::kChatML, "chatml"}};
// Throws std::invalid_argument listing the names.
TemplateKind template_kind_from_name(std::string_view name);
std::string_view template_name(TemplateKind kind);

struct Message {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

struct InstructRecord {
  std::string instruction;
  std::string input;  // empty: the Alpaca prompt without the "### Input:" block
  std::string output;
};

struct Segment {
  std::string text;
  bool is_prompt = true;
  // Llama-2 chat opens every later turn with BOS and closes every answer but the last with EOS
  // (Meta's chat_completion). Those are ids no text spells, so the segment carries them.
  bool bos_before = false;
  bool eos_after = false;
};

// Checks roles: an optional leading system message, then user/assistant alternating, starting
// with user and ending with assistant. Throws std::invalid_argument saying which message is
// wrong; callers prefix the file and line.
void validate_messages(const std::vector<Message>& messages);

// An instruct record as segments. Chat templates see it as [user: instruction ("\n\n" input),
// assistant: output].
std::vector<Segment> render_instruct(TemplateKind kind, const InstructRecord& record);
// A conversation as segments. Alpaca has no multi-turn form: it accepts exactly
// [system?, user, assistant], the user content being the instruction (system is refused).
std::vector<Segment> render_chat(TemplateKind kind, const std::vector<Message>& messages);

// All segment texts joined, e.g. to show a rendered prompt.
std::string join_segments(const std::vector<Segment>& segments);

}  // namespace qlora::data
