// jinja2's filters and tests, Python's str/dict/list methods, and the globals transformers adds,
// restricted to what chat templates use. Errors are std::runtime_error; the evaluator adds the
// location. raise_exception throws RaiseSignal, which the evaluator turns into RaisedError.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "qlora/jinja/value.h"

namespace qlora::jinja {

struct RaiseSignal {
  std::string message;
};

bool has_filter(const std::string& name);
bool has_test(const std::string& name);
Value apply_filter(const std::string& name, const Value& value, Args& args);
bool apply_test(const std::string& name, const Value& value, Args& args);

// `obj.name` for a method of a str, dict or list: a bound function; undefined when `obj` has no
// such method. List methods that mutate are refused when called, as transformers' immutable
// sandbox refuses them.
Value method(const Value& obj, const std::string& name);

// range, namespace, dict, raise_exception, strftime_now (now: seconds since the epoch or the real
// clock when absent), as a dict of functions.
Value make_globals(std::optional<int64_t> now_unix_seconds);

// The undefined value's error: the evaluator calls it wherever jinja2 raises UndefinedError.
[[noreturn]] void undefined_error(const Value& v);

}  // namespace qlora::jinja
