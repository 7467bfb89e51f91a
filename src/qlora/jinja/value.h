// The values a chat template computes with, as Python/Jinja2 sees them: undefined, None, bool,
// int, float, str, list, dict (insertion-ordered, string keys), namespace and callables.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace qlora::jinja {

class Value;
using List = std::vector<Value>;

// Insertion-ordered string-keyed map (Python's dict as templates use it).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(const std::string& key) const;
  Value* find(const std::string& key);
  void set(const std::string& key, Value v);
};

struct Args;  // positional and keyword arguments of a call (template.cpp)
using Callable = std::function<Value(Args&)>;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };

  Value() = default;  // undefined
  static Value none() { Value v; v.kind_ = Kind::kNone; return v; }
  Value(bool b) : kind_(Kind::kBool), int_(b) {}
  Value(int64_t i) : kind_(Kind::kInt), int_(i) {}
  Value(int i) : kind_(Kind::kInt), int_(i) {}
  Value(double d) : kind_(Kind::kFloat), float_(d) {}
  Value(std::string s) : kind_(Kind::kString), str_(std::make_shared<std::string>(std::move(s))) {}
  Value(const char* s) : Value(std::string(s)) {}
  Value(List l) : kind_(Kind::kList), list_(std::make_shared<List>(std::move(l))) {}
  Value(Dict d, bool is_namespace = false)
      : kind_(Kind::kDict), dict_(std::make_shared<Dict>(std::move(d))), namespace_(is_namespace) {}
  Value(Callable f) : kind_(Kind::kCallable), fn_(std::make_shared<Callable>(std::move(f))) {}
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt || kind_ == Kind::kBool; }  // Python: bool is an int
  bool is_number() const { return is_int() || kind_ == Kind::kFloat; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return namespace_; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return kind_ == Kind::kFloat ? static_cast<int64_t>(float_) : int_; }
  double as_float() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& str() const { return *str_; }
  List& list() const { return *list_; }
  Dict& dict() const { return *dict_; }
  const Callable& fn() const { return *fn_; }

  bool truthy() const;
  // Python's str(): what {{ value }} prints ("True", "None", "['a', 1]"); undefined prints "".
  std::string to_str() const;
  // Python's repr() (strings quoted as Python quotes them).
  std::string repr() const;
  // json.dumps(value, ensure_ascii=False, indent=indent (< 0: None), separators=None, sort_keys).
  std::string to_json(int indent, bool sort_keys) const;
  // The type's name in errors ("str", "list", "undefined").
  const char* type_name() const;

  friend bool operator==(const Value& a, const Value& b);

 private:
  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<std::string> str_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> fn_;
  bool namespace_ = false;
};

// Python's float repr: the shortest text that reads back ("0.5", "1.0", "1e-05").
std::string python_float(double d);

}  // namespace qlora::jinja
