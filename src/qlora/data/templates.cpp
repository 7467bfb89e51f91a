#include "qlora/data/templates.h"

#include <algorithm>
#include <iterator>
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

// Collects segments: text is prompt until an answer is added as a trained segment.
class SegmentList {
 public:
  void prompt(std::string_view text) { prompt_ += text; }
  // A message's text after its header: trained for an answer, prompt otherwise.
  void body(std::string text, bool is_answer) {
    if (is_answer) answer(std::move(text));
    else prompt(text);
  }
  void answer(std::string text, bool eos_after = false) {
    flush();
    Segment s{std::move(text), false};
    s.eos_after = eos_after;
    out_.push_back(std::move(s));
  }
  std::vector<Segment> take() {
    flush();
    return std::move(out_);
  }

 private:
  void flush() {
    if (!prompt_.empty()) out_.push_back(Segment{std::move(prompt_), true});
    prompt_.clear();
  }
  std::string prompt_;
  std::vector<Segment> out_;
};

// What Python's str.isspace() accepts, UTF-8 encoded: Jinja's trim filter is Python's strip().
constexpr std::string_view kPythonSpaces[] = {
    "\t", "\n", "\v", "\f", "\r", "\x1c", "\x1d", "\x1e", "\x1f", " ", "\u0085", "\u00a0",
    "\u1680", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004", "\u2005", "\u2006", "\u2007",
    "\u2008", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000"};

// Byte length of the space that starts (at_end: ends) `s`, 0 if none.
size_t space_at(std::string_view s, bool at_end) {
  for (const auto sp : kPythonSpaces) {
    if (sp.size() > s.size()) continue;
    if (s.compare(at_end ? s.size() - sp.size() : 0, sp.size(), sp) == 0) return sp.size();
  }
  return 0;
}

// Python's s.strip(), s.lstrip() (left only) or s.rstrip() (right only); `chars` empty means
// whitespace, else those bytes (ASCII here: Qwen3's template strips "\n").
std::string py_strip(std::string_view s, bool left = true, bool right = true,
                     std::string_view chars = {}) {
  const auto take = [&](bool at_end) -> size_t {
    if (s.empty()) return 0;
    if (chars.empty()) return space_at(s, at_end);
    return chars.find(at_end ? s.back() : s.front()) != std::string_view::npos ? 1 : 0;
  };
  for (size_t n; left && (n = take(false)) > 0;) s.remove_prefix(n);
  for (size_t n; right && (n = take(true)) > 0;) s.remove_suffix(n);
  return std::string(s);
}

// Meta-Llama-3-8B-Instruct's turns: "<|start_header_id|>" role "<|end_header_id|>\n\n", the
// content trimmed, "<|eot_id|>". The markers are text: a tiktoken (Llama-3) or tokenizer.json
// tokenizer encodes them as their special ids. <|begin_of_text|> is the dataset's add_bos.
void llama3_turns(SegmentList& out, const std::vector<Message>& m, size_t first) {
  for (size_t k = first; k < m.size(); ++k) {
    out.prompt("<|start_header_id|>" + m[k].role + "<|end_header_id|>\n\n");
    out.body(py_strip(m[k].content) + "<|eot_id|>", m[k].role == "assistant");
  }
}

std::vector<Segment> llama3(const std::vector<Message>& m) {
  SegmentList out;
  llama3_turns(out, m, 0);
  return out.take();
}

// Llama-3.1 Instruct writes a system header whatever the conversation holds: the knowledge and
// date lines (the date is the template's default; transformers passes no date_string), then the
// system message trimmed, if any.
std::vector<Segment> llama31(const std::vector<Message>& m) {
  const bool has_system = m[0].role == "system";
  SegmentList out;
  out.prompt(
      "<|start_header_id|>system<|end_header_id|>\n\n"
      "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" +
      (has_system ? py_strip(m[0].content) : std::string()) + "<|eot_id|>");
  llama3_turns(out, m, has_system ? 1 : 0);
  return out.take();
}

// "<|im_start|>" role "\n" content "<|im_end|>\n"; an answer's header is prompt, its content and
// "<|im_end|>\n" are trained. `answer_text` gives what an answer renders (Qwen3 rewrites it).
template <class AnswerText>
void chatml_turns(SegmentList& out, const std::vector<Message>& m, AnswerText answer_text) {
  for (size_t k = 0; k < m.size(); ++k) {
    const bool answer = m[k].role == "assistant";
    out.prompt("<|im_start|>" + m[k].role + "\n");
    out.body((answer ? answer_text(k) : m[k].content) + "<|im_end|>\n", answer);
  }
}

std::vector<Segment> chatml(const std::vector<Message>& m, std::string_view default_system) {
  SegmentList out;
  if (m[0].role != "system" && !default_system.empty()) {
    out.prompt("<|im_start|>system\n" + std::string(default_system) + "<|im_end|>\n");
  }
  chatml_turns(out, m, [&](size_t k) { return m[k].content; });
  return out.take();
}

// Qwen3's template: the last user message that is not a <tool_response> ends the query; an answer
// after it is rendered with its reasoning in a <think> block (an empty one when it has none) if
// it is the last message or has reasoning, every other answer without its reasoning. Reasoning is
// what the content holds before "</think>" (after "<think>").
std::string qwen3_answer(const std::vector<Message>& m, size_t k, size_t last_query) {
  std::string content = m[k].content, reasoning;
  constexpr std::string_view kClose = "</think>", kOpen = "<think>";
  if (content.find(kClose) != std::string::npos) {
    std::string before = py_strip(content.substr(0, content.find(kClose)), false, true, "\n");
    const size_t open = before.rfind(kOpen);
    if (open != std::string::npos) before.erase(0, open + kOpen.size());
    reasoning = py_strip(before, true, false, "\n");
    content = py_strip(content.substr(content.rfind(kClose) + kClose.size()), true, false, "\n");
  }
  if (k > last_query && (k + 1 == m.size() || !reasoning.empty())) {
    return "<think>\n" + py_strip(reasoning, true, true, "\n") + "\n</think>\n\n" +
           py_strip(content, true, false, "\n");
  }
  return content;
}

bool is_tool_response(std::string_view c) {
  constexpr std::string_view kOpen = "<tool_response>", kClose = "</tool_response>";
  return c.substr(0, kOpen.size()) == kOpen && c.size() >= kClose.size() &&
         c.substr(c.size() - kClose.size()) == kClose;
}

std::vector<Segment> qwen3(const std::vector<Message>& m) {
  size_t last_query = m.size() - 1;
  for (size_t k = m.size(); k-- > 0;) {
    if (m[k].role == "user" && !is_tool_response(m[k].content)) {
      last_query = k;
      break;
    }
  }
  SegmentList out;
  chatml_turns(out, m, [&](size_t k) { return qwen3_answer(m, k, last_query); });
  return out.take();
}

// Gemma's turns: "<start_of_turn>user\n" or "<start_of_turn>model\n", the content trimmed,
// "<end_of_turn>\n". Gemma has no system role: Gemma 3's template puts the system message and
// "\n\n" (untrimmed) before the first user message's content. <bos> is the dataset's add_bos.
std::vector<Segment> gemma(const std::vector<Message>& m) {
  const size_t first = m[0].role == "system" ? 1 : 0;
  const std::string prefix = first == 1 ? m[0].content + "\n\n" : "";
  SegmentList out;
  for (size_t k = first; k < m.size(); ++k) {
    const bool answer = m[k].role == "assistant";
    out.prompt(std::string("<start_of_turn>") + (answer ? "model" : "user") + "\n" +
               (k == first ? prefix : ""));
    out.body(py_strip(m[k].content) + "<end_of_turn>\n", answer);
  }
  return out.take();
}

// Mistral-7B-Instruct-v0.3: "[INST] " user "[/INST]", then " " + the answer trimmed + EOS (an id,
// see Segment). The system message is dropped, as the template drops it from conversations that
// end with an answer (it writes it only into a last message that is the user's). <s> is add_bos.
std::vector<Segment> mistral_v03(const std::vector<Message>& m) {
  SegmentList out;
  for (size_t k = m[0].role == "system" ? 1 : 0; k < m.size(); ++k) {
    if (m[k].role == "user") out.prompt("[INST] " + m[k].content + "[/INST]");
    else out.answer(" " + py_strip(m[k].content), /*eos_after=*/true);
  }
  return out.take();
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

std::vector<Message> instruct_messages(const InstructRecord& r) {
  std::string user = r.input.empty() ? r.instruction : r.instruction + "\n\n" + r.input;
  return {Message{"user", std::move(user)}, Message{"assistant", r.output}};
}

std::vector<Segment> render_instruct(TemplateKind kind, const InstructRecord& r) {
  if (kind == TemplateKind::kAlpaca) return alpaca(r);
  return render_chat(kind, instruct_messages(r));
}

std::vector<Segment> render_chat(TemplateKind kind, const std::vector<Message>& m) {
  validate_messages(m);
  for (size_t k = 0; k < m.size(); ++k) {
    if (m[k].reasoning) {
      throw std::invalid_argument("message " + std::to_string(k) + " has reasoning (reasoning_content, thinking or " +
                                  "reasoning), which data.template = \"" + std::string(template_name(kind)) +
                                  "\" does not render; data.template = \"auto\" renders it with the model's own template");
    }
  }
  switch (kind) {
    case TemplateKind::kAuto:
      throw std::logic_error("render_chat: template 'auto' renders through the model's ChatTemplate");
    case TemplateKind::kAlpaca:
      if (m.size() != 2) {
        throw std::invalid_argument(
            "the alpaca template takes one user and one assistant message (got " +
            std::to_string(m.size()) + " messages); use a chat template, e.g. llama3-chat or chatml");
      }
      return alpaca(InstructRecord{m[0].content, "", m[1].content});
    case TemplateKind::kLlama2Chat: return llama2(m);
    case TemplateKind::kLlama3Chat: return llama3(m);
    case TemplateKind::kLlama31Chat: return llama31(m);
    case TemplateKind::kChatML: return chatml(m, "");
    case TemplateKind::kQwen25:
      return chatml(m, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
    case TemplateKind::kQwen3: return qwen3(m);
    case TemplateKind::kGemma: return gemma(m);
    case TemplateKind::kMistralV03: return mistral_v03(m);
  }
  throw std::logic_error("render_chat: unhandled template");
}

std::pair<std::vector<Segment>, std::string> cut_at_answer(std::vector<Segment> all) {
  const auto answer = std::find_if(all.rbegin(), all.rend(), [](const Segment& s) { return !s.is_prompt; });
  const size_t at = answer == all.rend() ? std::string::npos : answer->text.rfind(kAnswerStandIn);
  if (at == std::string::npos) throw std::logic_error("the template rendered no answer segment holding the stand-in");
  std::string end_of_turn = answer->text.substr(at + kAnswerStandIn.size());
  all.erase(std::prev(answer.base()), all.end());
  return {std::move(all), std::move(end_of_turn)};
}

std::string join_segments(const std::vector<Segment>& segments) {
  std::string out;
  for (const auto& s : segments) out += s.text;
  return out;
}

}  // namespace qlora::data
