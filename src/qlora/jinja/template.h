// A Jinja interpreter scoped to Hugging Face chat templates: it renders what transformers'
// apply_chat_template renders (jinja2's ImmutableSandboxedEnvironment with trim_blocks,
// lstrip_blocks, loop controls and the {% generation %} tracker; the globals raise_exception and
// strftime_now; tojson as json.dumps with ensure_ascii=False).
//
// Supported: for (tuple targets, `if` filter, else, loop.*), if/elif/else, set (names, tuples,
// ns.attr, block set), macro with defaults, break/continue, generation, raw, comments,
// whitespace control; literals, list/dict/tuple, attribute/subscript/slice, calls, filters, tests,
// arithmetic, comparison, `in`, `~`, `and`/`or`/`not`, conditional expressions; namespace(),
// range(), dict(); the string, list and dict methods templates call. Anything else is a
// TemplateError naming the origin, line and column: never output that might be wrong.
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

namespace qlora::jinja {

class TemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// raise_exception(message) in the template; message() is the template's own text.
class RaisedError : public TemplateError {
 public:
  RaisedError(const std::string& where, std::string message)
      : TemplateError(where + ": " + message), message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

struct RenderOptions {
  // strftime_now's clock in seconds since the epoch (local time, as Python's datetime.now());
  // nullopt: the real clock. Tests fix it.
  std::optional<int64_t> now_unix_seconds;
};

struct Rendered {
  std::string text;
  // [begin, end) byte offsets of each {% generation %} block's output.
  std::vector<std::pair<size_t, size_t>> generation_spans;
};

struct Stmt;

class Template {
 public:
  static Template parse(std::string_view source, std::string origin);
  // `context`: the template's variables (messages, add_generation_prompt, bos_token, ...).
  Rendered render(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;
  const std::string& origin() const { return origin_; }

 private:
  std::string origin_;
  std::shared_ptr<const std::vector<std::shared_ptr<const Stmt>>> body_;
};

}  // namespace qlora::jinja
