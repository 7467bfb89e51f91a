// A Jinja interpreter for Hugging Face chat templates: renders what transformers'
// apply_chat_template renders (jinja2 ImmutableSandboxedEnvironment with trim_blocks,
// lstrip_blocks, loopcontrols and the {% generation %} tag; globals raise_exception,
// strftime_now, namespace, dict, range; the tojson filter is json.dumps(ensure_ascii=False)).
//
//   auto t = qlora::jinja::Template::parse(text, "tokenizer_config.json:chat_template");
//   nlohmann::ordered_json ctx = {{"messages", msgs}, {"add_generation_prompt", true},
//                                 {"bos_token", "<s>"}, {"eos_token", "</s>"}, {"tools", nullptr}};
//   qlora::jinja::Rendered r = t.render(ctx);   // r.text, r.generation_spans
//
// The context is what transformers passes: messages, tools, documents (null when absent),
// add_generation_prompt, the tokenizer's special tokens (bos_token, eos_token, ...) and any
// template kwargs (enable_thinking, ...). JSON objects keep their key order (tojson prints it).
//
// The subset: statements for (else, if filter, tuple targets), if/elif/else, set (also block set
// and ns.attr), macro, call, filter, raw, break, continue, generation; expressions as Python's
// with jinja2's filters and tests that templates use. Anything else is a TemplateError naming the
// origin, line and column, never silently different output. Differences from jinja2 that stay:
// none known; case mappings and character classes are Python's on all of Unicode (ICU's data).
// Rendering runs under a budget (budget.h): a template that runs away ends in a TemplateError.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/jinja/budget.h"

namespace qlora::jinja {

// A syntax or evaluation error: "<origin>:<line>:<col>: <what>".
class TemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The template called raise_exception(message): `message` is the template's own text (what
// transformers' jinja2.TemplateError carries); what() also names the location.
class RaisedError : public TemplateError {
 public:
  RaisedError(const std::string& where, std::string message)
      : TemplateError(where + ": " + message), message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

struct RenderOptions {
  // strftime_now's clock: seconds since the epoch, formatted in local time as Python's
  // datetime.fromtimestamp does; nullopt: the real clock (datetime.now()).
  std::optional<int64_t> now_unix_seconds;
  // Steps and bytes the render may use (budget.h): far above what any real chat template needs.
  RenderBudget budget;
};

struct Rendered {
  std::string text;
  // [start, end) byte offsets in text of each {% generation %} block's output, in render order
  // (transformers reports the same spans in characters as its generation indices).
  std::vector<std::pair<size_t, size_t>> generation_spans;
  // What the render used of its budget (RenderOptions::budget).
  int64_t steps_used = 0, bytes_used = 0;
};

struct Program;  // the parsed template (ast.h)

class Template {
 public:
  // Throws TemplateError for a syntax error or a construct outside the subset.
  static Template parse(std::string_view source, std::string origin);
  // Throws RaisedError for raise_exception, TemplateError for any other error.
  Rendered render(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;
  const std::string& origin() const { return origin_; }

 private:
  std::shared_ptr<const Program> program_;
  std::string origin_;
};

}  // namespace qlora::jinja
