// Python's operators on template values: arithmetic (int stays int, / is true division, // and %
// floor), ~ concatenation, subscripts and slices, `in`, and jinja2's attribute lookup (an
// attribute of a dict is its key, unless it names a dict method, as Python's getattr finds first).
#include <cmath>

#include "qlora/jinja/operators.h"

#include "qlora/jinja/budget.h"
#include "qlora/jinja/builtins.h"
#include "qlora/jinja/markup.h"

namespace qlora::jinja {
namespace {

int64_t as_int(const Value& v) { return v.kind == Kind::kInt ? v.i : v.b; }
bool both_int(const Value& a, const Value& b) { return a.kind != Kind::kFloat && b.kind != Kind::kFloat; }

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b) {
  // Python's own wording: str + x and list + x name the left type's rule.
  // (A Markup's + gives NotImplemented instead, so Python words it as any other operator.)
  if (op == "+" && ((a.is_string() && !a.markup) || a.is_sequence()) && !b.is_undefined())
    throw std::runtime_error(std::string("can only concatenate ") + type_name(a) + " (not \"" + type_name(b) + "\") to " +
                             type_name(a));
  throw std::runtime_error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

size_t string_bytes(const List& items) {
  size_t bytes = 0;
  for (const Value& e : items) bytes += e.is_string() ? e.s.size() : 0;
  return bytes;
}

// Paid for before anything is allocated: `'a' * 2000000000` is refused at once.
Value repeat(const Value& seq, int64_t n) {
  if (seq.is_string()) {
    budget_repeat(n, seq.s.size());
    std::string out;
    out.reserve(n > 0 ? seq.s.size() * static_cast<size_t>(n) : 0);
    for (int64_t k = 0; k < n; ++k) out += seq.s;
    Value v = Value::string(out);
    v.markup = seq.markup;
    return v;
  }
  budget_repeat(n, string_bytes(*seq.list), seq.list->size());
  List out;
  for (int64_t k = 0; k < n; ++k) out.insert(out.end(), seq.list->begin(), seq.list->end());
  return seq.kind == Kind::kTuple ? Value::make_tuple(std::move(out)) : Value::make_list(std::move(out));
}

// x ** y for y >= 0 by squaring: log2(y) steps, where a loop of y multiplications would let
// `2 ** 9999999999` run for minutes.
int64_t int_power(int64_t x, int64_t y) {
  int64_t result = 1;
  for (bool first = true; y > 0; y >>= 1, first = false) {
    if (!first && __builtin_mul_overflow(x, x, &x)) throw std::runtime_error("integer overflow: qlora's template integers are 64-bit");
    if ((y & 1) && __builtin_mul_overflow(result, x, &result)) {
      throw std::runtime_error("integer overflow: qlora's template integers are 64-bit");
    }
  }
  return result;
}

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

Value numeric(const std::string& op, const Value& a, const Value& b) {
  if (!a.is_number() || !b.is_number()) unsupported(op, a, b);
  if (op == "/") {
    if (as_double(b) == 0.0) throw std::runtime_error("division by zero");
    return Value::real(as_double(a) / as_double(b));
  }
  if (both_int(a, b)) {
    int64_t x = as_int(a), y = as_int(b);
    int64_t r = 0;
    if ((op == "+" && __builtin_add_overflow(x, y, &r)) || (op == "-" && __builtin_sub_overflow(x, y, &r)) ||
        (op == "*" && __builtin_mul_overflow(x, y, &r))) {
      throw std::runtime_error("integer overflow: qlora's template integers are 64-bit");
    }
    if (op == "+" || op == "-" || op == "*") return Value::integer(r);
    if (op == "//" || op == "%") {
      if (y == 0) throw std::runtime_error("integer division or modulo by zero");
      int64_t q = floor_div(x, y);
      return Value::integer(op == "//" ? q : x - q * y);
    }
    if (op == "**") {
      if (y < 0) return Value::real(std::pow(static_cast<double>(x), static_cast<double>(y)));
      return Value::integer(int_power(x, y));
    }
  }
  double x = as_double(a), y = as_double(b);
  if (op == "+") return Value::real(x + y);
  if (op == "-") return Value::real(x - y);
  if (op == "*") return Value::real(x * y);
  if (op == "**") return Value::real(std::pow(x, y));
  if (y == 0.0) throw std::runtime_error("float floor division by zero");
  double q = std::floor(x / y);
  if (op == "//") return Value::real(q);
  double m = std::fmod(x, y);
  if (m != 0.0 && ((m < 0) != (y < 0))) m += y;
  return Value::real(m);
}

// Python's slice.indices(length).
void slice_indices(int64_t n, const Value& start, const Value& stop, const Value& step, int64_t& b, int64_t& e, int64_t& s) {
  auto as_index = [](const Value& v) {
    if (v.kind != Kind::kInt && v.kind != Kind::kBool) throw std::runtime_error("slice indices must be integers or None");
    return as_int(v);
  };
  s = step.is_none() ? 1 : as_index(step);
  if (s == 0) throw std::runtime_error("slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t fallback) {
    if (v.is_none()) return fallback;
    int64_t k = as_index(v);
    if (k < 0) k += n;
    if (s > 0) return std::min(std::max<int64_t>(k, 0), n);
    return std::min(std::max<int64_t>(k, -1), n - 1);
  };
  b = clamp(start, s > 0 ? 0 : n - 1);
  e = clamp(stop, s > 0 ? n : -1);
}

}  // namespace

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string x = to_str(a), y = to_str(b);
    budget_append(x.size(), y.size());
    return Value::string(x + y);
  }
  if (a.is_undefined()) undefined_error(a);
  if (b.is_undefined()) undefined_error(b);
  if (op == "+") {
    if (a.is_string() && b.is_string() && (a.markup || b.markup)) return markup_concat(a, b);
    if (a.is_string() && b.is_string()) {
      budget_append(a.s.size(), b.s.size());
      return Value::string(a.s + b.s);
    }
    if (a.is_sequence() && a.kind == b.kind) {
      budget_steps(static_cast<int64_t>(a.list->size() + b.list->size()));
      budget_copied(string_bytes(*a.list) + string_bytes(*b.list));
      List out = *a.list;
      out.insert(out.end(), b.list->begin(), b.list->end());
      return a.kind == Kind::kTuple ? Value::make_tuple(std::move(out)) : Value::make_list(std::move(out));
    }
  }
  if (op == "*") {
    if ((a.is_string() || a.is_sequence()) && (b.kind == Kind::kInt || b.kind == Kind::kBool)) return repeat(a, as_int(b));
    if ((b.is_string() || b.is_sequence()) && (a.kind == Kind::kInt || a.kind == Kind::kBool)) return repeat(b, as_int(a));
  }
  if (op == "%" && a.is_string()) throw std::runtime_error("printf-style string formatting is outside the subset");
  return numeric(op, a, b);
}

Value slice_of(const Value& v, const Value& start, const Value& stop, const Value& step) {
  if (v.is_undefined()) undefined_error(v);
  if (!v.is_string() && !v.is_sequence()) throw std::runtime_error(std::string("'") + type_name(v) + "' object is not subscriptable");
  List items = iterate(v);
  int64_t b, e, s;
  slice_indices(static_cast<int64_t>(items.size()), start, stop, step, b, e, s);
  List out;
  for (int64_t k = b; s > 0 ? k < e : k > e; k += s) out.push_back(items[k]);
  if (v.is_string()) {
    std::string text;
    for (const Value& c : out) text += c.s;
    Value sliced = Value::string(text);
    sliced.markup = v.markup;  // Markup.__getitem__
    return sliced;
  }
  return v.kind == Kind::kTuple ? Value::make_tuple(std::move(out)) : Value::make_list(std::move(out));
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.is_mapping() || obj.kind == Kind::kNamespace) {
    const Value* found = key.is_string() ? obj.dict->find(key.s) : nullptr;
    if (found) return *found;
    return Value::undefined("'dict object' has no attribute " + to_repr(key));
  }
  if ((obj.is_sequence() || obj.is_string()) && (key.kind == Kind::kInt || key.kind == Kind::kBool)) {
    static const List kNone;
    List chars = obj.is_string() ? iterate(obj) : kNone;  // a list is indexed where it is, not copied
    const List& items = obj.is_string() ? chars : *obj.list;
    int64_t n = static_cast<int64_t>(items.size()), k = as_int(key);
    if (k < 0) k += n;
    if (k < 0 || k >= n) return Value::undefined("'" + object_type_name(obj) + " object' has no element " + to_str(key));
    return obj.markup ? as_markup(items[k]) : items[k];
  }
  if (key.is_string()) return get_attr(obj, key.s);
  return Value::undefined("'" + object_type_name(obj) + " object' has no element " + to_repr(key));
}

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.kind == Kind::kNamespace) {
    const Value* found = obj.dict->find(name);
    return found ? *found : Value::undefined("'Namespace object' has no attribute '" + name + "'");
  }
  Value m = method(obj, name);
  if (!m.is_undefined() || !obj.is_mapping()) return m;
  const Value* found = obj.dict->find(name);
  return found ? *found : Value::undefined("'dict object' has no attribute '" + name + "'");
}

bool contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) throw std::runtime_error(std::string("'in <string>' requires string as left operand, not ") + type_name(item));
    return container.s.find(item.s) != std::string::npos;
  }
  if (container.is_mapping()) return item.is_string() && container.dict->find(item.s) != nullptr;
  for (const Value& e : iterate(container)) {
    if (equal(e, item)) return true;
  }
  return false;
}

}  // namespace qlora::jinja
