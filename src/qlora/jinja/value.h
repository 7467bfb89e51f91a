// The interpreter's value: the Python objects a chat template sees (None, bool, int, float, str,
// list, tuple, insertion-ordered dict, jinja2's namespace and Undefined, callables), with Python's
// truthiness, equality, ordering and str()/repr() text, since templates print them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/jinja/utf8.h"  // Python indexes strings by code point

namespace qlora::jinja {

struct Value;
using List = std::vector<Value>;

// Python dicts keep insertion order, and tojson prints in that order: a vector, looked up linearly
// (chat-template dicts have a handful of keys). Keys are strings: JSON contexts only have those.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);
};

// Arguments of a call: positional then keyword, as written.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A builtin, a bound method or a macro. Errors it throws as std::runtime_error get the call's
// location attached by the evaluator.
struct Function {
  std::string name;
  std::function<Value(Args&)> call;
};

enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict, kNamespace, kFunction };

struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  std::string s;                    // kString; kUndefined: the name that was missing (for errors)
  std::shared_ptr<List> list;       // kList, kTuple (lists are shared, as Python's are)
  std::shared_ptr<Dict> dict;       // kDict, kNamespace
  std::shared_ptr<Function> fn;     // kFunction
  // A kList that jinja2 would hand out as a generator (map, select, selectattr, items...): always
  // truthy, no len(); templates pass it on to |list, |first, |join or a for loop.
  bool generator = false;
  // A kString that jinja2 holds as markupsafe's Markup (from |safe or |escape): it prints as is,
  // but `+` and its methods HTML-escape the plain strings they take in (markup.h).
  bool markup = false;

  static Value undefined(std::string name = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value real(double v);
  static Value string(std::string v);
  static Value make_markup(std::string v);
  static Value make_list(List items = {});
  static Value make_tuple(List items);
  static Value make_dict();
  static Value make_namespace();
  static Value function(std::string name, std::function<Value(Args&)> call);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_sequence() const { return kind == Kind::kList || kind == Kind::kTuple; }
  bool is_mapping() const { return kind == Kind::kDict; }
};

// Python's type name (for error messages as Python words them).
const char* type_name(const Value& v);
// The type as jinja2's Undefined messages name it ("'str object' has no attribute ..."): a Markup's
// type is outside builtins, so it is module-qualified.
std::string object_type_name(const Value& v);
bool truthy(const Value& v);
// Python ==.
bool equal(const Value& a, const Value& b);
// Python's <: -1, 0, 1; throws std::runtime_error for types Python cannot order.
int compare(const Value& a, const Value& b);
// Python str() and repr().
std::string to_str(const Value& v);
std::string to_repr(const Value& v);
std::string float_repr(double v);
// Python's float of an int, bool, or float (numbers only).
double as_double(const Value& v);

// The elements `for x in v` visits: lists and tuples, a dict's keys, a string's characters,
// nothing for undefined; anything else throws.
List iterate(const Value& v);
// Python len(); throws for values without one.
int64_t length(const Value& v);

// nlohmann ordered_json <-> Value (JSON objects keep their key order).
Value from_json(const nlohmann::ordered_json& j);

struct JsonOptions {
  int indent = -1;                  // json.dumps indent=None
  std::string item_separator = ", ";  // json.dumps' defaults for indent=None; ',' with an indent
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
};
// json.dumps(v, ...) as transformers' tojson filter calls it; throws for undefined and functions.
std::string to_json_text(const Value& v, const JsonOptions& options);

}  // namespace qlora::jinja
