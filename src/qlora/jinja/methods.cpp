// Python's str, dict and list methods that chat templates call, and transformers' globals.
#include <algorithm>
#include <chrono>
#include <ctime>

#include "qlora/jinja/budget.h"
#include "qlora/jinja/builtins.h"
#include "qlora/jinja/markup.h"
#include "qlora/jinja/strings.h"

namespace qlora::jinja {
namespace {

const Value& arg(Args& a, size_t k, const char* fn) {
  if (k >= a.positional.size()) throw std::runtime_error(std::string(fn) + "() missing a required argument");
  return a.positional[k];
}
std::optional<std::string> opt_str_arg(Args& a, size_t k) {
  if (k >= a.positional.size() || a.positional[k].is_none()) return std::nullopt;
  if (!a.positional[k].is_string()) throw std::runtime_error("expected a string argument");
  return a.positional[k].s;
}
int64_t int_arg(Args& a, size_t k, const char* key, int64_t fallback) {
  const Value* v = k < a.positional.size() ? &a.positional[k] : nullptr;
  for (auto& [name, value] : a.keyword) {
    if (name == key) v = &value;
  }
  if (!v) return fallback;
  if (v->kind != Kind::kInt) throw std::runtime_error(std::string("expected an integer for ") + key);
  return v->i;
}
List strings(const std::vector<std::string>& parts) {
  List out;
  for (const auto& p : parts) out.push_back(Value::string(p));
  return out;
}

// startswith/endswith take a string or a tuple of strings.
bool affix(const std::string& s, const Value& which, bool start) {
  if (which.is_sequence()) {
    List items = *which.list;
    return std::any_of(items.begin(), items.end(), [&](const Value& v) { return affix(s, v, start); });
  }
  if (!which.is_string()) throw std::runtime_error("startswith/endswith need a string or a tuple of strings");
  const std::string& x = which.s;
  if (x.size() > s.size()) return false;
  return start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
}

// str.format with {} / {0} / {name} fields and {{ }} escapes; format specs are refused.
std::string py_format(const std::string& fmt, Args& a) {
  std::string out;
  size_t next = 0;
  for (size_t k = 0; k < fmt.size(); ++k) {
    char c = fmt[k];
    if ((c == '{' || c == '}') && k + 1 < fmt.size() && fmt[k + 1] == c) {
      out += c;
      ++k;
      continue;
    }
    if (c == '}') throw std::runtime_error("Single '}' encountered in format string");
    if (c != '{') {
      out += c;
      continue;
    }
    size_t close = fmt.find('}', k);
    if (close == std::string::npos) throw std::runtime_error("Single '{' encountered in format string");
    std::string field = fmt.substr(k + 1, close - k - 1);
    if (field.find_first_of(":!.[") != std::string::npos) throw std::runtime_error("format specs are outside the subset");
    std::string value;
    if (field.empty()) {
      value = to_str(arg(a, next++, "format"));
    } else if (std::all_of(field.begin(), field.end(), ::isdigit)) {
      value = to_str(arg(a, std::stoul(field), "format"));
    } else {
      auto it = std::find_if(a.keyword.begin(), a.keyword.end(), [&](const auto& kv) { return kv.first == field; });
      if (it == a.keyword.end()) throw std::runtime_error("KeyError: '" + field + "'");
      value = to_str(it->second);
    }
    budget_append(out.size(), value.size());
    out += value;
    k = close;
  }
  return out;
}

Value string_method(const std::string& s, const std::string& name, Args& a) {
  if (name == "startswith" || name == "endswith") return Value::boolean(affix(s, arg(a, 0, name.c_str()), name == "startswith"));
  if (name == "strip") return Value::string(py_strip(s, opt_str_arg(a, 0), true, true));
  if (name == "lstrip") return Value::string(py_strip(s, opt_str_arg(a, 0), true, false));
  if (name == "rstrip") return Value::string(py_strip(s, opt_str_arg(a, 0), false, true));
  if (name == "split" || name == "rsplit") {
    std::optional<std::string> sep = opt_str_arg(a, 0);
    for (auto& [key, value] : a.keyword) {
      if (key == "sep" && !value.is_none()) sep = to_str(value);
    }
    return Value::make_list(strings(py_split(s, sep, int_arg(a, 1, "maxsplit", -1), name == "rsplit")));
  }
  if (name == "replace") {
    return Value::string(py_replace(s, to_str(arg(a, 0, "replace")), to_str(arg(a, 1, "replace")), int_arg(a, 2, "count", -1)));
  }
  if (name == "upper") return Value::string(py_upper(s));
  if (name == "lower") return Value::string(py_lower(s));
  if (name == "title") return Value::string(py_title(s));
  if (name == "capitalize") return Value::string(py_capitalize(s));
  if (name == "find" || name == "rfind") return Value::integer(py_find(s, to_str(arg(a, 0, "find")), name == "rfind"));
  if (name == "count") return Value::integer(py_count(s, to_str(arg(a, 0, "count"))));
  if (name == "format") return Value::string(py_format(s, a));
  if (name == "splitlines") return Value::make_list(strings(py_splitlines(s)));
  if (name == "join") {
    std::string out;
    bool first = true;
    for (const Value& v : iterate(arg(a, 0, "join"))) {
      if (!v.is_string()) throw std::runtime_error("sequence item: expected str instance");
      budget_append(out.size(), (first ? 0 : s.size()) + v.s.size());
      out += (first ? "" : s) + v.s;
      first = false;
    }
    return Value::string(out);
  }
  if (name == "isupper") return Value::boolean(py_isupper(s));
  if (name == "islower") return Value::boolean(py_islower(s));
  if (name == "isdigit") return Value::boolean(py_isdigit(s));
  if (name == "isalpha") return Value::boolean(py_isalpha(s));
  if (name == "isalnum") return Value::boolean(py_isalnum(s));
  if (name == "isspace") return Value::boolean(py_isspace(s));
  throw std::logic_error("unhandled string method " + name);
}

// A Markup's methods (markupsafe): what str's would give, as Markup, after escaping the arguments
// Markup escapes: replace's new text, join's items, format's fields. Predicates are str's own.
Value markup_method(const std::string& s, const std::string& name, Args& a) {
  Args escaped = a;
  if (name == "replace" && escaped.positional.size() > 1) escaped.positional[1] = escape_value(escaped.positional[1]);
  if (name == "join" && !escaped.positional.empty()) {
    List items = iterate(escaped.positional[0]);
    for (Value& e : items) e = escape_value(e);
    escaped.positional[0] = Value::make_list(std::move(items));
  }
  if (name == "format") {
    for (Value& v : escaped.positional) v = escape_value(v);
    for (auto& kv : escaped.keyword) kv.second = escape_value(kv.second);
  }
  return as_markup(string_method(s, name, escaped));
}

Value dict_method(const Value& d, const std::string& name, Args& a) {
  if (name == "items" || name == "keys" || name == "values") {
    budget_steps(static_cast<int64_t>(d.dict->items.size()));
    List out;
    for (const auto& [k, v] : d.dict->items) {
      if (name == "items") out.push_back(Value::make_tuple({Value::string(k), v}));
      if (name == "keys") out.push_back(Value::string(k));
      if (name == "values") out.push_back(v);
    }
    return Value::make_list(std::move(out));
  }
  // get(key, default=None)
  const Value& key = arg(a, 0, "get");
  const Value* found = key.is_string() ? d.dict->find(key.s) : nullptr;
  if (found) return *found;
  return a.positional.size() > 1 ? a.positional[1] : Value::none();
}

const char* const kStringMethods[] = {"startswith", "endswith", "strip", "lstrip", "rstrip", "split", "rsplit",
                                      "replace", "upper", "lower", "title", "capitalize", "find", "rfind",
                                      "count", "format", "splitlines", "join", "isupper", "islower",
                                      "isdigit", "isalpha", "isalnum", "isspace"};
const char* const kDictMethods[] = {"items", "keys", "values", "get"};
// The methods transformers' ImmutableSandboxedEnvironment refuses (jinja2's _mutable_spec).
const char* const kMutating[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
                                 "update", "setdefault", "popitem", "add", "discard"};

template <size_t N>
bool in(const char* const (&names)[N], const std::string& name) {
  return std::find_if(std::begin(names), std::end(names), [&](const char* n) { return name == n; }) != std::end(names);
}

}  // namespace

Value method(const Value& obj, const std::string& name) {
  bool mutable_container = obj.is_sequence() || obj.is_mapping();
  if (mutable_container && in(kMutating, name)) {
    std::string message = "access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.";
    return Value::function(name, [message](Args&) -> Value { throw std::runtime_error(message); });
  }
  if (obj.is_string() && in(kStringMethods, name)) {
    std::string s = obj.s;
    if (obj.markup) return Value::function(name, [s, name](Args& a) { return markup_method(s, name, a); });
    return Value::function(name, [s, name](Args& a) { return string_method(s, name, a); });
  }
  if (obj.is_mapping() && in(kDictMethods, name)) {
    return Value::function(name, [obj, name](Args& a) { return dict_method(obj, name, a); });
  }
  if (obj.is_sequence() && (name == "index" || name == "count")) {
    Value list = obj;
    return Value::function(name, [list, name](Args& a) {
      const Value& x = arg(a, 0, name.c_str());
      budget_steps(static_cast<int64_t>(list.list->size()));
      int64_t n = 0;
      for (size_t k = 0; k < list.list->size(); ++k) {
        if (!equal((*list.list)[k], x)) continue;
        if (name == "index") return Value::integer(static_cast<int64_t>(k));
        ++n;
      }
      if (name == "index") throw std::runtime_error("x not in list");
      return Value::integer(n);
    });
  }
  return Value::undefined("'" + object_type_name(obj) + " object' has no attribute '" + name + "'");
}

namespace {

Value range_fn(Args& a) {
  if (a.positional.empty() || a.positional.size() > 3) throw std::runtime_error("range expected 1 to 3 arguments");
  for (const Value& v : a.positional) {
    if (v.kind != Kind::kInt) throw std::runtime_error("range() needs integers");
  }
  int64_t start = 0, stop, step = 1;
  if (a.positional.size() == 1) {
    stop = a.positional[0].i;
  } else {
    start = a.positional[0].i;
    stop = a.positional[1].i;
    if (a.positional.size() == 3) step = a.positional[2].i;
  }
  if (step == 0) throw std::runtime_error("range() arg 3 must not be zero");
  List out;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
    if (out.size() >= 100000) throw std::runtime_error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    budget_steps(1);
    out.push_back(Value::integer(k));
  }
  return Value::make_list(std::move(out));
}

// namespace(dict?, **kwargs) and dict(dict?, **kwargs).
Value dict_fn(Args& a, bool is_namespace) {
  Value d = is_namespace ? Value::make_namespace() : Value::make_dict();
  if (a.positional.size() > 1) throw std::runtime_error("expected at most 1 positional argument");
  if (!a.positional.empty()) {
    if (!a.positional[0].is_mapping()) throw std::runtime_error("expected a mapping");
    for (const auto& [k, v] : a.positional[0].dict->items) d.dict->set(k, v);
  }
  for (const auto& [k, v] : a.keyword) {
    if (is_namespace && !k.empty() && k[0] == '_') {
      throw std::runtime_error("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + k +
                               "'. Please rename the attribute.");
    }
    d.dict->set(k, v);
  }
  return d;
}

Value strftime_fn(Args& a, std::optional<int64_t> now) {
  std::string format = to_str(arg(a, 0, "strftime_now"));
  std::time_t t = now ? static_cast<std::time_t>(*now) : std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm local{};
  localtime_r(&t, &local);
  if (format.empty()) return Value::string("");
  budget_bytes(format.size() * 8 + 256);
  std::vector<char> buf(format.size() * 8 + 256);
  size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &local);
  return Value::string(std::string(buf.data(), n));
}

}  // namespace

Value make_globals(std::optional<int64_t> now_unix_seconds) {
  Value g = Value::make_dict();
  g.dict->set("range", Value::function("range", range_fn));
  g.dict->set("namespace", Value::function("namespace", [](Args& a) { return dict_fn(a, true); }));
  g.dict->set("dict", Value::function("dict", [](Args& a) { return dict_fn(a, false); }));
  g.dict->set("raise_exception", Value::function("raise_exception", [](Args& a) -> Value {
                throw RaiseSignal{to_str(arg(a, 0, "raise_exception"))};
              }));
  g.dict->set("strftime_now", Value::function("strftime_now", [now_unix_seconds](Args& a) {
                return strftime_fn(a, now_unix_seconds);
              }));
  return g;
}

}  // namespace qlora::jinja
