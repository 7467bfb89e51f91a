// The model's own chat template (data.template = "auto"): the Jinja text a checkpoint ships in
// chat_template.jinja or tokenizer_config.json, rendered as transformers' apply_chat_template
// renders it (jinja/: the interpreter), with the trained spans of a conversation derived from it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/templates.h"
#include "qlora/data/tokenizer.h"

namespace qlora::jinja {
class Template;
}

namespace qlora::data {

class ChatTemplate {
 public:
  // The template beside `tokenizer`'s file, as transformers picks it: chat_template.jinja first,
  // else tokenizer_config.json's "chat_template" (a string, or a list of {name, template}: the one
  // named "default"). nullopt when neither has one. Throws std::invalid_argument naming the file,
  // line and column of a construct the interpreter does not support.
  static std::optional<ChatTemplate> find(const Tokenizer& tokenizer, nlohmann::ordered_json kwargs = {});
  // A template given as text; `origin` names it in errors.
  static ChatTemplate from_source(std::string source, std::string origin, const Tokenizer& tokenizer,
                                  nlohmann::ordered_json kwargs = {});

  // apply_chat_template(messages, tokenize=False, add_generation_prompt=...): `messages` is a JSON
  // array of {"role", "content", ...}. Throws std::invalid_argument with the template's own
  // message when it raises (raise_exception), prefixed by its origin.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt) const;

  // A training conversation (ending with an assistant message) as segments: the whole text, cut
  // into prompt and trained pieces. Trained are each assistant message as the template renders it
  // plus its end-of-turn marker: the template's {% generation %} blocks where it has them, else
  // for each assistant message i, from the end of render(messages[:i], add_generation_prompt) to
  // the end of render(messages[:i+1]) or, where a later turn re-renders earlier ones (Qwen3 drops
  // old <think> blocks), to the end of that message's content plus the end-of-turn marker found
  // after it. Throws std::invalid_argument saying which message could not be located.
  std::vector<Segment> render_training(const std::vector<Message>& messages) const;

  // What the template writes after an answer's content ("<|im_end|>\n", "<|eot_id|>", "</s>"):
  // generation stops there, and a run trains on it.
  std::string end_of_turn() const;

  const std::string& source() const { return source_; }
  const std::string& origin() const { return origin_; }
  const nlohmann::ordered_json& kwargs() const { return kwargs_; }

 private:
  std::string source_, origin_;
  nlohmann::ordered_json context_;  // special tokens and kwargs, without messages
  nlohmann::ordered_json kwargs_;
  std::shared_ptr<const jinja::Template> compiled_;
  struct Rendered;
  Rendered render_spans(const nlohmann::ordered_json& messages, bool add_generation_prompt) const;
};

// Messages as the JSON a template reads.
nlohmann::ordered_json messages_json(const std::vector<Message>& messages);

// Ids and labels of a text rendered by the model's template, tokenized whole (so the ids are
// apply_chat_template(tokenize=True)'s): a token is trained when any of its bytes lie in a trained
// segment. Token boundaries come from tokenizing prefixes of the text (any tokenizer, no offsets
// needed): the tokens of text[:b] that agree with the whole text's tokens end before b.
std::pair<std::vector<int64_t>, std::vector<bool>> tokenize_exact(const std::vector<Segment>& segments,
                                                                  const Tokenizer& tokenizer);

}  // namespace qlora::data
