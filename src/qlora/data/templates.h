// Prompt templates: a record becomes text segments, each marked prompt (no loss unless
// train_on_input) or response (loss).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qlora/io/enum_names.h"

namespace qlora::data {

// Each chat kind renders exactly what transformers' apply_chat_template renders with the named
// model's own chat template (tests/data/chat_templates/ holds those texts; the conformance test
// tests/conformance/test_chat_templates.py compares), except that BOS is never spelled: the
// dataset's add_bos puts it first.
//   llama2-chat    Meta's Llama-2 chat_completion format
//   llama3-chat    Meta-Llama-3-8B-Instruct: header, trimmed content, <|eot_id|> per message
//   llama3.1-chat  Llama-3.1/3.3 Instruct: llama3-chat plus the system header the template always
//                  writes ("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")
//   chatml         plain ChatML (teknium/OpenHermes-2.5-Mistral-7B): no default system, no trim
//   qwen2.5        Qwen2.5-Instruct: ChatML with Qwen's default system message when none is given
//   qwen3          Qwen3: ChatML; the last answer gets a <think> block, earlier answers lose theirs
//   gemma          Gemma 3 instruct (and Gemma 2's, which refuses a system message): user/model
//                  turns, trimmed content, the system message folded into the first user turn
//   mistral-v0.3   Mistral-7B-Instruct-v0.3: "[INST] user[/INST]", " answer" + EOS; its template
//                  puts the system message only into a conversation's last message when that is a
//                  user message, so a training conversation (ending with an answer) renders without it
//   auto           the model's own chat template (chat_template.h); resolved against the
//                  tokenizer before rendering (DatasetOptions::chat_template)
enum class TemplateKind {
  kAuto, kAlpaca, kLlama2Chat, kLlama3Chat, kLlama31Chat, kChatML, kQwen25, kQwen3, kGemma, kMistralV03
};

inline constexpr io::EnumName<TemplateKind> kTemplateKindNames[] = {
    {TemplateKind::kAuto, "auto"},
    {TemplateKind::kAlpaca, "alpaca"},
    {TemplateKind::kLlama2Chat, "llama2-chat"},
    {TemplateKind::kLlama3Chat, "llama3-chat"},
    {TemplateKind::kLlama31Chat, "llama3.1-chat"},
    {TemplateKind::kChatML, "chatml"},
    {TemplateKind::kQwen25, "qwen2.5"},
    {TemplateKind::kQwen3, "qwen3"},
    {TemplateKind::kGemma, "gemma"},
    {TemplateKind::kMistralV03, "mistral-v0.3"}};
// Throws std::invalid_argument listing the names.
TemplateKind template_kind_from_name(std::string_view name);
std::string_view template_name(TemplateKind kind);

// A piece of a message's content where it holds images: a text, or one image (the record's next,
// data/record_images.h), in transformers' chat format [{"type": "text", "text"}, {"type": "image"}].
struct ContentPart {
  std::string text;
  bool image = false;
};

struct Message {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
  // An assistant turn's reasoning, from the record's "reasoning_content", "thinking" or "reasoning"
  // (the first that is not null, as transformers reads them). Only a model's own template renders
  // it (chat_template.h); the hand-written kinds refuse a message that has one.
  std::optional<std::string> reasoning = std::nullopt;
  // The content as parts where it holds an image (content is then its text parts joined); empty:
  // plain text. Only a model's own template renders images (its placeholder for each).
  std::vector<ContentPart> parts = {};
};

struct InstructRecord {
  std::string instruction;
  std::string input;  // empty: the Alpaca prompt without the "### Input:" block
  std::string output;
};

// A piece of the rendered text. What is trained (is_prompt false) is each answer with its end of
// turn (<|eot_id|>, <|im_end|>\n, <end_of_turn>\n, EOS); prompts and answer headers are prompt.
struct Segment {
  std::string text;
  bool is_prompt = true;
  // Llama-2 chat opens every later turn with BOS and closes every answer but the last with EOS
  // (Meta's chat_completion); Mistral v0.3 closes every answer with EOS. Those are ids that a
  // sentencepiece model never produces from text, so the segment carries them.
  bool bos_before = false;
  bool eos_after = false;
};

// Checks roles: an optional leading system message, then user/assistant alternating, starting
// with user and ending with assistant. Throws std::invalid_argument saying which message is
// wrong; callers prefix the file and line.
void validate_messages(const std::vector<Message>& messages);

// An instruct record as the conversation chat templates see: [user: instruction ("\n\n" input),
// assistant: output].
std::vector<Message> instruct_messages(const InstructRecord& record);
// An instruct record as segments. Chat templates see it as [user: instruction ("\n\n" input),
// assistant: output].
std::vector<Segment> render_instruct(TemplateKind kind, const InstructRecord& record);
// A conversation as segments. Alpaca has no multi-turn form: it accepts exactly
// [system?, user, assistant], the user content being the instruction (system is refused).
std::vector<Segment> render_chat(TemplateKind kind, const std::vector<Message>& messages);

// `kind` as a Jinja chat template (data/template_jinja.cpp; not kAuto): rendered with the model's
// bos_token / eos_token it gives render_chat's text, the segments' BOS/EOS ids spelled, and EOS after
// the last answer for alpaca and llama2-chat (whose answers end with add_eos' EOS). What serves a
// model trained on `kind` writes it (the GGUF export's tokenizer.chat_template).
std::string template_jinja(TemplateKind kind);

// A record rendered with kAnswerStandIn as its (last) answer, cut there: the segments before that
// answer (the prompt up to the opened answer turn: what transformers' add_generation_prompt renders)
// and what the template writes after the stand-in (its end of turn, "<|im_end|>\n"; Qwen3's <think>
// block comes before the stand-in). Throws std::logic_error when the last answer segment lacks it.
inline constexpr std::string_view kAnswerStandIn = "qlora-answer";
std::pair<std::vector<Segment>, std::string> cut_at_answer(std::vector<Segment> rendered);

// All segment texts joined, e.g. to show a rendered prompt.
std::string join_segments(const std::vector<Segment>& segments);

}  // namespace qlora::data
