#include "qlora/data/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string_view>

#include "qlora/io/read_file.h"
#include "qlora/jinja/strings.h"
#include "qlora/jinja/template.h"

namespace qlora::data {
namespace {

using ojson = nlohmann::ordered_json;

// transformers' special_tokens_map: the named tokens tokenizer_config.json sets, as strings
// ({"content": ...} objects in newer files); without a config, the tokenizer's own BOS/EOS/unk.
ojson special_tokens(const Tokenizer& tok) {
  ojson out = ojson::object();
  static const char* const kNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                       "pad_token", "cls_token", "mask_token"};
  if (const auto& config = tok.config()) {
    for (const char* name : kNames) {
      if (!config->contains(name)) continue;
      const auto& v = (*config)[name];
      if (v.is_string()) out[name] = v.get<std::string>();
      else if (v.is_object() && v.contains("content") && v["content"].is_string()) out[name] = v["content"];
    }
    return out;
  }
  if (tok.bos_id() >= 0) out["bos_token"] = tok.id_to_piece(tok.bos_id());
  if (tok.eos_id() >= 0) out["eos_token"] = tok.id_to_piece(tok.eos_id());
  if (tok.unk_id() >= 0) out["unk_token"] = tok.id_to_piece(tok.unk_id());
  return out;
}

std::filesystem::path tokenizer_dir(const Tokenizer& tok) {
  const auto dir = std::filesystem::path(tok.path()).parent_path();
  return dir.filename() == "original" ? dir.parent_path() : dir;
}

// tokenizer_config.json's chat_template: a string, or [{name, template}, ...] with a "default".
std::optional<std::string> config_template(const nlohmann::json& config, const std::string& file) {
  if (!config.contains("chat_template") || config["chat_template"].is_null()) return std::nullopt;
  const auto& t = config["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array()) {
    for (const auto& e : t)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
        return e["template"].get<std::string>();
    throw std::invalid_argument(file + ": chat_template lists named templates but none named \"default\"");
  }
  throw std::invalid_argument(file + ": chat_template must be a string or a list of {name, template}");
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

std::string trim_ws(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// The end of the last occurrence, within text[from, to), of the longest tail of `head` that occurs
// there; npos when not even its last character does. (A tail that occurs has every shorter one
// occur at the same end, so the longest is found by bisection.)
size_t after_longest_tail(const std::string& text, size_t from, size_t to, const std::string& head) {
  const std::string_view window = std::string_view(text).substr(from, to - from);
  const auto find = [&](size_t n) { return window.rfind(std::string_view(head).substr(head.size() - n)); };
  size_t lo = 0, hi = std::min(head.size(), window.size());
  while (lo < hi) {
    const size_t mid = (lo + hi + 1) / 2;
    if (find(mid) != std::string_view::npos) lo = mid;
    else hi = mid - 1;
  }
  return lo == 0 ? std::string::npos : from + find(lo) + lo;
}

// Where an answer starts in `full` when `head`, the prompt before it rendered with the generation
// prompt, is no prefix of `full` (the prompt renders differently once an answer follows); `at`:
// where its content renders (npos: nowhere, the template rewrote it).
// - Where `head` and `full` part, if the content follows there or was rewritten (DeepSeek-R1's
//   prompt ends "<｜Assistant｜><think>\n", its answers "<｜Assistant｜>" + the content after its
//   </think>).
// - Else after the longest tail of `head` found before the content (Mistral v0.3 moves the system
//   message into the last user turn: "...[/INST]", then " " + the answer).
size_t answer_start_in(const std::string& full, const std::string& head, const std::string& content, size_t at,
                       size_t cursor, const std::string& where) {
  size_t common = 0;
  while (common < head.size() && common < full.size() && head[common] == full[common]) ++common;
  // ...at the end of a tag, line or word ("<think>" and "<｜end▁of▁sentence｜>" share their "<").
  while (common > 0 && common < head.size() && std::string_view(">] \n").find(head[common - 1]) == std::string::npos)
    --common;
  const size_t text_at = std::min(full.find_first_not_of(" \t\r\n", common), full.size());
  const bool follows = content.empty() ? at != std::string::npos && text_at >= at
                                       : full.compare(text_at, content.size(), content) == 0;
  if (common >= cursor && (follows || at == std::string::npos)) return common;
  if (at == std::string::npos) throw std::invalid_argument("cannot locate " + where + " in the rendered text");
  return std::min(at, after_longest_tail(full, cursor, at, head));
}

// Where an answer that starts at `start` of `full` ends, when a later turn re-renders it (`with`:
// the conversation up to it, rendered alone, is no prefix of `full`): after its content and the
// end-of-turn marker that follows the content in `with`. Where the template rewrote the content
// (Qwen3 drops an earlier answer's <think> block), the first such marker after `start`.
// open_marker(): how the template closes the answer when it is not the last message (gpt-oss's
// harmony: <|end|>, where the last one ends with <|return|>), rendered only where `with`'s marker
// does not follow the content; empty where unknown.
size_t answer_end_in(const std::string& full, const std::string& with, const std::string& head,
                     const std::string& content, size_t start, const std::string& where,
                     const std::function<std::string()>& open_marker) {
  const size_t tail = content.empty() ? after_longest_tail(with, 0, with.size(), head) : with.rfind(content);
  if (tail == std::string::npos) throw std::invalid_argument("cannot locate " + where + " in the rendered text");
  const std::string marker = with.substr(tail + content.size());
  const size_t at = full.find(content, start);
  if (at != std::string::npos) {
    // The marker as far as the full text repeats it: Phi-3.5 ends a last answer with
    // "<|end|>\n" + EOS, an earlier one with "<|end|>\n" before the next turn.
    size_t n = 0;
    const size_t after = at + content.size();
    while (n < marker.size() && after + n < full.size() && full[after + n] == marker[n]) ++n;
    // A partial match ends at a line or a tag, never inside the next turn's "<|user|>".
    while (n > 0 && n < marker.size() && marker[n - 1] != '\n' && marker[n - 1] != '>' && marker[n - 1] != ']') --n;
    if (n > 0 || marker.empty()) return after + n;
    const std::string open = open_marker();
    if (!open.empty() && full.compare(after, open.size(), open) == 0) return after + open.size();
  }
  const size_t next = marker.empty() ? std::string::npos : full.find(marker, start);
  if (next == std::string::npos)
    throw std::invalid_argument("cannot find the end of " + where + " ('" + marker + "') in the rendered text");
  return next + marker.size();
}

}  // namespace

struct ChatTemplate::Rendered {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
};

namespace {

// A message's content as a template reads it: its text, or its parts in transformers' chat format.
ojson content_json(const Message& m) {
  if (m.parts.empty()) return m.content;
  ojson parts = ojson::array();
  for (const ContentPart& p : m.parts)
    parts.push_back(p.image ? ojson{{"type", "image"}} : ojson{{"type", "text"}, {"text", p.text}});
  return parts;
}

}  // namespace

ojson messages_json(const std::vector<Message>& messages) {
  ojson out = ojson::array();
  for (const auto& m : messages) {
    if (!m.reasoning) {
      out.push_back(ojson{{"role", m.role}, {"content", content_json(m)}});
      continue;
    }
    // transformers passes a message's reasoning under both names templates read: "reasoning_content"
    // (Qwen3, DeepSeek-R1) and "thinking" (gpt-oss), in this key order.
    out.push_back(ojson{{"thinking", *m.reasoning}, {"role", m.role}, {"content", content_json(m)},
                        {"reasoning_content", *m.reasoning}});
  }
  return out;
}

ChatTemplate ChatTemplate::from_source(std::string source, std::string origin, const Tokenizer& tokenizer,
                                       ojson kwargs) {
  ChatTemplate t;
  t.source_ = std::move(source);
  t.origin_ = std::move(origin);
  t.kwargs_ = kwargs.is_object() ? std::move(kwargs) : ojson::object();
  t.context_ = special_tokens(tokenizer);
  for (const auto& [k, v] : t.kwargs_.items()) t.context_[k] = v;  // kwargs win, as in transformers
  try {
    t.compiled_ = std::make_shared<const jinja::Template>(jinja::Template::parse(t.source_, t.origin_));
  } catch (const jinja::TemplateError& e) {
    throw std::invalid_argument(e.what());
  }
  return t;
}

std::optional<ChatTemplate> ChatTemplate::find(const Tokenizer& tokenizer, ojson kwargs) {
  const auto dir = tokenizer_dir(tokenizer);
  const auto jinja_file = (dir / "chat_template.jinja").string();
  if (auto text = io::read_file(jinja_file)) return from_source(std::move(*text), jinja_file, tokenizer, kwargs);
  if (!tokenizer.config()) return std::nullopt;
  const auto config_file = (dir / "tokenizer_config.json").string();
  auto text = config_template(*tokenizer.config(), config_file);
  if (!text) return std::nullopt;
  return from_source(std::move(*text), config_file + " (chat_template)", tokenizer, kwargs);
}

ChatTemplate::Rendered ChatTemplate::render_spans(const ojson& messages, bool add_generation_prompt) const {
  ojson context = context_;
  context["messages"] = messages;
  context["add_generation_prompt"] = add_generation_prompt;
  if (!context.contains("tools")) context["tools"] = nullptr;
  if (!context.contains("documents")) context["documents"] = nullptr;
  try {
    auto r = compiled_->render(context);
    return Rendered{std::move(r.text), std::move(r.generation_spans)};
  } catch (const jinja::RaisedError& e) {
    throw std::invalid_argument(origin_ + " raised: " + e.message());
  } catch (const jinja::TemplateError& e) {
    throw std::invalid_argument(e.what());
  }
}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt) const {
  return render_spans(messages, add_generation_prompt).text;
}

std::vector<Segment> ChatTemplate::render_training(const std::vector<Message>& messages) const {
  if (messages.empty() || messages.back().role != "assistant")
    throw std::invalid_argument("a training conversation must end with an assistant message (the part that is trained)");
  const ojson all = messages_json(messages);
  const Rendered full = render_spans(all, false);
  std::vector<std::pair<size_t, size_t>> spans = full.generation;
  if (spans.empty()) {
    size_t cursor = 0;
    for (size_t i = 0; i < messages.size(); ++i) {
      if (messages[i].role != "assistant") continue;
      const ojson before(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(i));
      const std::string head = render_spans(before, true).text;
      const std::string with = render_spans(ojson(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(i + 1)), false).text;
      const std::string where = "assistant message " + std::to_string(i + 1) + " (" + origin_ + ")";
      size_t start = head.size();
      std::string content = trim_ws(messages[i].content);
      // A template that trims as Python's str.strip() does (Qwen3.5's |trim) drops Unicode spaces too.
      if (full.text.find(content, cursor) == std::string::npos)
        content = jinja::py_strip(messages[i].content, std::nullopt, true, true);
      if (!starts_with(full.text, head)) {
        size_t at = full.text.find(content, cursor);
        if (content.empty()) {  // an empty answer: where a stand-in content renders, the text before it the same
          ojson probe = all;
          probe[i]["content"] = "qlora-empty-answer";
          const std::string text = render_spans(probe, false).text;
          at = text.find("qlora-empty-answer");
          if (at != std::string::npos && full.text.compare(0, at, text, 0, at) != 0) at = std::string::npos;
        }
        start = answer_start_in(full.text, head, content, at, cursor, where);
      }
      // The conversation through this answer with a generation prompt after it, that prompt cut off:
      // the answer's closing as an earlier turn (the prompt is what `head` adds to `before`).
      const auto open_marker = [&]() -> std::string {
        const ojson through(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(i + 1));
        const std::string bare = render_spans(before, false).text, open = render_spans(through, true).text;
        if (content.empty() || !starts_with(head, bare) || head.size() == bare.size()) return {};
        const std::string prompt = head.substr(bare.size());
        if (open.size() < prompt.size() || open.compare(open.size() - prompt.size(), prompt.size(), prompt) != 0) return {};
        const size_t tail = open.rfind(content, open.size() - prompt.size());
        if (tail == std::string::npos) return {};
        return open.substr(tail + content.size(), open.size() - prompt.size() - tail - content.size());
      };
      const size_t end = starts_with(full.text, with) && with.size() >= start
                             ? with.size()
                             : answer_end_in(full.text, with, head, content, start, where, open_marker);
      if (start < cursor || end < start) throw std::invalid_argument("cannot locate " + where + " in the rendered text");
      spans.emplace_back(start, end);
      cursor = end;
    }
  }
  std::vector<Segment> out;
  size_t at = 0;
  for (const auto& [b, e] : spans) {
    if (b > at) out.push_back(Segment{full.text.substr(at, b - at), true});
    if (e > b) out.push_back(Segment{full.text.substr(b, e - b), false});
    at = std::max(at, e);
  }
  if (at < full.text.size()) out.push_back(Segment{full.text.substr(at), true});
  return out;
}

std::string ChatTemplate::end_of_turn() const {
  const std::string probe = "qlora-answer";
  const std::vector<Message> m = {{"user", "qlora-question"}, {"assistant", probe}};
  const std::string text = render(messages_json(m), false);
  const size_t at = text.rfind(probe);
  return at == std::string::npos ? "" : trim_ws(text.substr(at + probe.size()));
}

std::pair<std::vector<int64_t>, std::vector<bool>> tokenize_exact(const std::vector<Segment>& segments,
                                                                  const Tokenizer& tokenizer) {
  std::string text;
  std::vector<std::pair<size_t, bool>> bounds;  // (end offset of a segment, trained)
  for (const auto& s : segments) {
    text += s.text;
    bounds.emplace_back(text.size(), !s.is_prompt);
  }
  const std::vector<int64_t> ids = tokenizer.encode(text);
  // Tokens [0, n) of the whole text end at or before byte b, where n is how far the tokens of
  // text[:b] agree with them; when text[:b] has more tokens than that, token n crosses b.
  const auto tokens_before = [&](size_t b) -> std::pair<size_t, bool> {
    if (b >= text.size()) return {ids.size(), false};
    const auto head = tokenizer.encode(std::string_view(text).substr(0, b));
    size_t n = 0;
    while (n < head.size() && n < ids.size() && head[n] == ids[n]) ++n;
    return {n, head.size() > n};
  };
  std::vector<bool> trained(ids.size(), false);
  size_t start = 0, first = 0;
  for (const auto& [end, is_trained] : bounds) {
    const auto [last, crosses] = tokens_before(end);
    // Trained: every token with a byte in [start, end), a token across either boundary included.
    if (is_trained && end > start) {
      const size_t stop = std::min(ids.size(), last + (crosses ? 1 : 0));
      for (size_t k = first; k < stop; ++k) trained[k] = true;
    }
    start = end;
    first = last;
  }
  return {ids, trained};
}

}  // namespace qlora::data
