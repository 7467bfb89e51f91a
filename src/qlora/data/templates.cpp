#include "qlora/data/templates.h"

#include <stdexcept>

namespace qlora::data {
namespace {

// Stanford Alpaca's PROMPT_DICT (train.py), verbatim.
constexpr std::string_view kAlpacaWithInput =
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
constexpr std::string_view kAlpacaNoInput =
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

std::string fill(std::string_view pattern, std::string_view key, std::string_view value) {
  std::string out(pattern);
  const std::string marker = "{" + std::string(key) + "}";
  const auto at = out.find(marker);
  if (at != std::string::npos) out.replace(at, marker.size(), value);
  return out;
}

std::vector<Segment> alpaca(const InstructRecord& r) {
  std::string prompt = r.input.empty()
                           ? fill(kAlpacaNoInput, "instruction", r.instruction)
                           : fill(fill(kAlpacaWithInput, "instruction", r.instruction), "input",
                                  r.input);
  return {Segment{std::move(prompt), true}, Segment{r.output, false}};
}

// Meta's llama chat_completion format: "[INST] <<SYS>>\n{sys}\n<</SYS>>\n\n{user} [/INST]"
// then " {answer} " and EOS; each later turn starts with BOS. The first BOS and the last EOS
// come from the dataset's add_bos / add_eos. Meta strips contents; we keep them as given.
std::vector<Segment> llama2(const std::vector<Message>& m) {
  std::vector<Segment> out;
  size_t i = 0;
  std::string system;
  if (!m.empty() && m[0].role == "system") system = m[i++].content;
  bool first_turn = true;
  for (; i < m.size(); i += 2) {
    std::string user = m[i].content;
    if (first_turn && !system.empty()) user = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + user;
    Segment prompt{"[INST] " + user + " [/INST]", true};
    prompt.bos_before = !first_turn;
    out.push_back(std::move(prompt));
    if (i + 1 < m.size()) {
      Segment answer{" " + m[i + 1].content + " ", false};
      answer.eos_after = i + 2 < m.size();
      out.push_back(std::move(answer));
    }
    first_turn = false;
  }
  return out;
}

// Llama-3 instruct format, as text: a tiktoken (Llama-3) tokenizer encodes the markers as their
// special ids; with a sentencepiece model they are plain text. <|begin_of_text|> is not written:
// it is Llama-3's BOS, which the dataset's add_bos puts first (as for every template); spelled
// here too it would reach the ids twice. Loss covers the answer and its <|eot_id|>, as in Meta's
// and torchtune's Llama-3 formats.
std::vector<Segment> llama3(const std::vector<Message>& m) {
  std::vector<Segment> out;
  std::string prompt;
  for (const auto& msg : m) {
    const std::string header = "<|start_header_id|>" + msg.role + "<|end_header_id|>\n\n";
    if (msg.role == "assistant") {
      prompt += header;
      out.push_back(Segment{std::move(prompt), true});
      prompt.clear();
      out.push_back(Segment{msg.content + "<|eot_id|>", false});
    } else {
      prompt += header + msg.content + "<|eot_id|>";
    }
  }
  if (!prompt.empty()) out.push_back(Segment{std::move(prompt), true});
  return out;
}

// ChatML: the assistant header is prompt; answer plus "<|im_end|>\n" is trained.
std::vector<Segment> chatml(const std::vector<Message>& m) {
  std::vector<Segment> out;
  std::string prompt;
  for (const auto& msg : m) {
    const std::string header = "<|im_start|>" + msg.role + "\n";
    if (msg.role == "assistant") {
      prompt += header;
      out.push_back(Segment{std::move(prompt), true});
      prompt.clear();
      out.push_back(Segment{msg.content + "<|im_end|>\n", false});
    } else {
      prompt += header + msg.content + "<|im_end|>\n";
    }
  }
  if (!prompt.empty()) out.push_back(Segment{std::move(prompt), true});
  return out;
}

}  // namespace

TemplateKind template_kind_from_name(std::string_view name) {
  return io::enum_from_name(kTemplateKindNames, name, "prompt template");
}

std::string_view template_name(TemplateKind kind) { return io::enum_name(kTemplateKindNames, kind); }

void validate_messages(const std::vector<Message>& m) {
  if (m.empty()) throw std::invalid_argument("conversation has no messages");
  size_t i = 0;
  if (m[0].role == "system") ++i;
  if (i == m.size()) throw std::invalid_argument("conversation has only a system message");
  for (size_t k = 0; k < m.size(); ++k) {
    const auto& role = m[k].role;
    if (role != "system" && role != "user" && role != "assistant") {
      throw std::invalid_argument("message " + std::to_string(k + 1) + " has role '" + role +
                                  "'; expected system, user or assistant");
    }
  }
  for (size_t k = i; k < m.size(); ++k) {
    const char* want = (k - i) % 2 == 0 ? "user" : "assistant";
    if (m[k].role != want) {
      throw std::invalid_argument("message " + std::to_string(k + 1) + " has role '" + m[k].role +
                                  "' where '" + want +
                                  "' was expected (optional system first, then user and "
                                  "assistant alternating)");
    }
  }
  if (m.back().role != "assistant") {
    throw std::invalid_argument("conversation ends with a " + m.back().role +
                                " message; the last message must be the assistant's (the part "
                                "that is trained)");
  }
}

std::vector<Segment> render_instruct(TemplateKind kind, const InstructRecord& r) {
  if (kind == TemplateKind::kAlpaca) return alpaca(r);
  std::string user = r.input.empty() ? r.instruction : r.instruction + "\n\n" + r.input;
  return render_chat(kind, {Message{"user", std::move(user)}, Message{"assistant", r.output}});
}

std::vector<Segment> render_chat(TemplateKind kind, const std::vector<Message>& m) {
  validate_messages(m);
  switch (kind) {
    case TemplateKind::kAlpaca:
      if (m.size() != 2) {
        throw std::invalid_argument(
            "the alpaca template takes one user and one assistant message (got " +
            std::to_string(m.size()) + " messages); use llama2-chat, llama3-chat or chatml");
      }
      return alpaca(InstructRecord{m[0].content, "", m[1].content});
    case TemplateKind::kLlama2Chat: return llama2(m);
    case TemplateKind::kLlama3Chat: return llama3(m);
    case TemplateKind::kChatML: return chatml(m);
  }
  throw std::logic_error("render_chat: unhandled template");
}

std::string join_segments(const std::vector<Segment>& segments) {
  std::string out;
  for (const auto& s : segments) out += s.text;
  return out;
}

}  // namespace qlora::data
