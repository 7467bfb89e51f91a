// jinja2's filters and tests (jinja2/filters.py, jinja2/tests.py semantics) for chat templates.
#include "qlora/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "qlora/jinja/budget.h"
#include "qlora/jinja/markup.h"
#include "qlora/jinja/strings.h"

namespace qlora::jinja {

[[noreturn]] void undefined_error(const Value& v) {
  throw std::runtime_error(v.s.empty() ? std::string("value is undefined") : v.s);
}

namespace {

using FilterFn = Value (*)(const Value&, Args&);
using TestFn = bool (*)(const Value&, Args&);

// Python-style binding of call arguments to named parameters; absent ones are nullopt.
std::vector<std::optional<Value>> bind(Args& args, std::initializer_list<const char*> names, const char* fn) {
  std::vector<std::string> params(names.begin(), names.end());
  if (args.positional.size() > params.size()) throw std::runtime_error(std::string(fn) + "() takes too many arguments");
  std::vector<std::optional<Value>> out(params.size());
  for (size_t k = 0; k < args.positional.size(); ++k) out[k] = args.positional[k];
  for (auto& [key, value] : args.keyword) {
    auto it = std::find(params.begin(), params.end(), key);
    if (it == params.end()) throw std::runtime_error(std::string(fn) + "() got an unexpected keyword argument '" + key + "'");
    out[it - params.begin()] = value;
  }
  return out;
}

Value arg_or(const std::optional<Value>& a, Value fallback) { return a ? *a : std::move(fallback); }
std::optional<std::string> opt_str(const std::optional<Value>& a) {
  if (!a || a->is_none()) return std::nullopt;
  return to_str(*a);
}
int64_t int_arg(const std::optional<Value>& a, int64_t fallback) {
  if (!a || a->is_none()) return fallback;
  if (a->kind != Kind::kInt && a->kind != Kind::kBool) throw std::runtime_error("expected an integer argument");
  return a->kind == Kind::kInt ? a->i : a->b;
}

Value list_of(List items, bool generator = false) {
  Value v = Value::make_list(std::move(items));
  v.generator = generator;
  return v;
}

// jinja2's attribute getter ("a.b.0"): each part looks up an item, a number part indexes.
Value get_path(const Value& obj, const std::string& path) {
  Value cur = obj;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (cur.is_mapping() || cur.kind == Kind::kNamespace) {
      const Value* found = cur.dict->find(part);
      cur = found ? *found : Value::undefined("'dict object' has no attribute '" + part + "'");
    } else if (cur.is_sequence() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      size_t k = std::stoul(part);
      cur = k < cur.list->size() ? (*cur.list)[k] : Value::undefined("list index out of range");
    } else if (cur.is_undefined()) {
      undefined_error(cur);
    } else {
      cur = Value::undefined("'" + object_type_name(cur) + " object' has no attribute '" + part + "'");
    }
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

// Sort and unique compare strings case-insensitively unless told otherwise.
Value sort_key(const Value& v, bool case_sensitive) {
  return v.is_string() && !case_sensitive ? Value::string(py_lower(v.s)) : v;
}

// The filters that call the value's own str method (soft_str(v).upper() ...) keep a Markup one.
Value same_kind(const Value& v, std::string text) {
  Value out = Value::string(std::move(text));
  out.markup = v.is_string() && v.markup;
  return out;
}

Value f_trim(const Value& v, Args& a) {
  auto p = bind(a, {"chars"}, "trim");
  return same_kind(v, py_strip(to_str(v), opt_str(p[0]), true, true));
}

Value f_tojson(const Value& v, Args& a) {
  auto p = bind(a, {"ensure_ascii", "indent", "separators", "sort_keys"}, "tojson");
  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False),
  // where a template usually writes the indent positionally: tojson(4) binds ensure_ascii. Jinja
  // passes positional arguments in order, so keep that binding.
  JsonOptions o;
  o.ensure_ascii = p[0] && truthy(*p[0]);
  if (p[1] && !p[1]->is_none()) {
    o.indent = static_cast<int>(int_arg(p[1], 0));
    o.item_separator = ",";
  }
  if (p[2] && !p[2]->is_none()) {
    List seps = iterate(*p[2]);
    if (seps.size() != 2) throw std::runtime_error("tojson separators must be a pair");
    o.item_separator = to_str(seps[0]);
    o.key_separator = to_str(seps[1]);
  }
  o.sort_keys = p[3] && truthy(*p[3]);
  return Value::string(to_json_text(v, o));
}

Value f_length(const Value& v, Args&) { return Value::integer(length(v)); }

Value f_items(const Value& v, Args&) {
  if (v.is_undefined()) return list_of({}, true);
  if (!v.is_mapping()) throw std::runtime_error("Can only get item pairs from a mapping.");
  List out;
  for (const auto& [k, e] : v.dict->items) out.push_back(Value::make_tuple({Value::string(k), e}));
  return list_of(std::move(out), true);
}

Value f_join(const Value& v, Args& a) {
  auto p = bind(a, {"d", "attribute"}, "join");
  std::string sep = p[0] ? to_str(*p[0]) : "", out;
  bool first = true;
  for (const Value& e : iterate(v)) {
    std::string item = to_str(p[1] && !p[1]->is_none() ? get_path(e, to_str(*p[1])) : e);
    budget_append(out.size(), (first ? 0 : sep.size()) + item.size());
    if (!first) out += sep;
    first = false;
    out += item;
  }
  return Value::string(out);
}

Value f_upper(const Value& v, Args&) { return same_kind(v, py_upper(to_str(v))); }
Value f_lower(const Value& v, Args&) { return same_kind(v, py_lower(to_str(v))); }
Value f_capitalize(const Value& v, Args&) { return same_kind(v, py_capitalize(to_str(v))); }
Value f_title(const Value& v, Args&) { return Value::string(jinja_title(to_str(v))); }  // a str, even of a Markup

Value f_replace(const Value& v, Args& a) {
  auto p = bind(a, {"old", "new", "count"}, "replace");
  if (!p[0] || !p[1]) throw std::runtime_error("replace() needs old and new");
  return Value::string(py_replace(to_str(v), to_str(*p[0]), to_str(*p[1]), int_arg(p[2], -1)));
}

// jinja2's select/reject/map guard their loop with `if seq:`, so none and other falsy values
// give an empty sequence (functionary's template filters a `tools` that is none).
List iterate_truthy(const Value& v) { return truthy(v) ? iterate(v) : List{}; }

// select/reject(seq, test, *args) and selectattr/rejectattr(seq, attr, test, *args).
Value select_impl(const Value& v, Args& a, bool by_attribute, bool keep) {
  std::vector<Value> rest = a.positional;
  std::string attribute;
  if (by_attribute) {
    if (rest.empty()) throw std::runtime_error("selectattr/rejectattr need an attribute");
    attribute = to_str(rest.front());
    rest.erase(rest.begin());
  }
  std::string test;
  if (!rest.empty()) {
    test = to_str(rest.front());
    rest.erase(rest.begin());
    if (!has_test(test)) throw std::runtime_error("no test named '" + test + "'");
  }
  List out;
  for (const Value& e : iterate_truthy(v)) {
    Value item = by_attribute ? get_path(e, attribute) : e;
    Args test_args{rest, {}};
    bool passed = test.empty() ? truthy(item) : apply_test(test, item, test_args);
    if (passed == keep) out.push_back(e);
  }
  return list_of(std::move(out), true);
}
Value f_select(const Value& v, Args& a) { return select_impl(v, a, false, true); }
Value f_reject(const Value& v, Args& a) { return select_impl(v, a, false, false); }
Value f_selectattr(const Value& v, Args& a) { return select_impl(v, a, true, true); }
Value f_rejectattr(const Value& v, Args& a) { return select_impl(v, a, true, false); }

// map(attribute='x', default=d) or map('filter', *args, **kwargs).
Value f_map(const Value& v, Args& a) {
  List out;
  if (a.positional.empty()) {
    auto p = bind(a, {"attribute", "default"}, "map");
    if (!p[0]) throw std::runtime_error("map() needs a filter name or attribute=");
    for (const Value& e : iterate_truthy(v)) {
      Value item = get_path(e, to_str(*p[0]));
      out.push_back(item.is_undefined() && p[1] ? *p[1] : item);
    }
    return list_of(std::move(out), true);
  }
  std::string filter = to_str(a.positional.front());
  if (!has_filter(filter)) throw std::runtime_error("no filter named '" + filter + "'");
  for (const Value& e : iterate_truthy(v)) {
    Args rest{std::vector<Value>(a.positional.begin() + 1, a.positional.end()), a.keyword};
    out.push_back(apply_filter(filter, e, rest));
  }
  return list_of(std::move(out), true);
}

Value f_list(const Value& v, Args&) { return list_of(iterate(v)); }
Value f_first(const Value& v, Args&) {
  List items = iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}
Value f_last(const Value& v, Args&) {
  List items = iterate(v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return v.markup ? as_markup(items.back()) : items.back();  // reversed() indexes: a Markup's item is one
}

Value f_default(const Value& v, Args& a) {
  auto p = bind(a, {"default_value", "boolean"}, "default");
  bool use_default = v.is_undefined() || (p[1] && truthy(*p[1]) && !truthy(v));
  return use_default ? arg_or(p[0], Value::string("")) : v;
}

Value f_string(const Value& v, Args&) { return v.is_string() ? v : Value::string(to_str(v)); }  // soft_str

// Python's int(str): optional sign, digits with single underscores, surrounding whitespace.
std::optional<int64_t> parse_int(const std::string& text, int base) {
  std::string s = py_strip(text, std::nullopt, true, true), digits;
  for (char c : s) {
    if (c != '_') digits += c;
  }
  if (digits.empty()) return std::nullopt;
  char* end = nullptr;
  long long n = std::strtoll(digits.c_str(), &end, base);
  if (*end != '\0' || std::isspace(static_cast<unsigned char>(digits[0]))) return std::nullopt;
  return n;
}
std::optional<double> parse_float(const std::string& text) {
  std::string s = py_strip(text, std::nullopt, true, true);
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (*end != '\0') return std::nullopt;
  return d;
}

Value f_int(const Value& v, Args& a) {
  auto p = bind(a, {"default", "base"}, "int");
  Value fallback = arg_or(p[0], Value::integer(0));
  if (v.kind == Kind::kInt || v.kind == Kind::kBool) return Value::integer(v.kind == Kind::kInt ? v.i : v.b);
  if (v.kind == Kind::kFloat) return std::isfinite(v.f) ? Value::integer(static_cast<int64_t>(v.f)) : fallback;
  if (v.is_string()) {
    if (auto n = parse_int(v.s, static_cast<int>(int_arg(p[1], 10)))) return Value::integer(*n);
    if (auto d = parse_float(v.s); d && std::isfinite(*d)) return Value::integer(static_cast<int64_t>(*d));
  }
  return fallback;
}

Value f_float(const Value& v, Args& a) {
  auto p = bind(a, {"default"}, "float");
  if (v.is_number()) return Value::real(as_double(v));
  if (v.is_string()) {
    if (auto d = parse_float(v.s)) return Value::real(*d);
  }
  return arg_or(p[0], Value::real(0.0));
}

Value f_abs(const Value& v, Args&) {
  if (v.kind == Kind::kFloat) return Value::real(std::fabs(v.f));
  if (v.kind == Kind::kInt || v.kind == Kind::kBool) return Value::integer(std::llabs(v.kind == Kind::kInt ? v.i : v.b));
  throw std::runtime_error(std::string("bad operand type for abs(): '") + type_name(v) + "'");
}

// round(value, precision=0, method='common'): 'common' is Python's round() (correctly rounded,
// ties to even, an int stays an int); 'floor' and 'ceil' give floats.
Value f_round(const Value& v, Args& a) {
  auto p = bind(a, {"precision", "method"}, "round");
  int64_t precision = int_arg(p[0], 0);
  std::string method = p[1] ? to_str(*p[1]) : "common";
  if (!v.is_number()) throw std::runtime_error(std::string("type ") + type_name(v) + " doesn't define __round__");
  if (method == "common") {
    if (v.kind != Kind::kFloat) return Value::integer(v.kind == Kind::kInt ? v.i : v.b);
    char buf[512];
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(std::clamp<int64_t>(precision, 0, 300)), v.f);
    return Value::real(std::strtod(buf, nullptr));
  }
  if (method != "floor" && method != "ceil") throw std::runtime_error("method must be common, ceil or floor");
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = as_double(v) * scale;
  return Value::real((method == "floor" ? std::floor(x) : std::ceil(x)) / scale);
}

// |safe: Markup(v), the text of str(v) (markup.h says what a Markup changes).
Value f_safe(const Value& v, Args& a) {
  bind(a, {}, "safe");
  return Value::make_markup(to_str(v));
}
Value f_escape(const Value& v, Args&) { return escape_value(v); }
Value f_striptags(const Value& v, Args&) { return Value::string(strip_tags(to_str(v))); }

Value f_unique(const Value& v, Args& a) {
  auto p = bind(a, {"case_sensitive", "attribute"}, "unique");
  bool case_sensitive = p[0] && truthy(*p[0]);
  List out, seen;
  for (const Value& e : iterate(v)) {
    Value key = sort_key(p[1] && !p[1]->is_none() ? get_path(e, to_str(*p[1])) : e, case_sensitive);
    budget_steps(static_cast<int64_t>(seen.size()));  // quadratic: each item against those kept
    bool dup = std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, key); });
    if (!dup) {
      seen.push_back(key);
      out.push_back(e);
    }
  }
  return list_of(std::move(out), true);
}

Value f_reverse(const Value& v, Args&) {
  List items = iterate(v);
  std::reverse(items.begin(), items.end());
  if (!v.is_string()) return list_of(std::move(items), true);
  std::string out;
  for (const Value& c : items) out += c.s;
  return same_kind(v, out);  // Markup[::-1] is a Markup
}

Value f_sort(const Value& v, Args& a) {
  auto p = bind(a, {"reverse", "case_sensitive", "attribute"}, "sort");
  bool reverse = p[0] && truthy(*p[0]), case_sensitive = p[1] && truthy(*p[1]);
  List items = iterate(v);
  auto key = [&](const Value& e) {
    return sort_key(p[2] && !p[2]->is_none() ? get_path(e, to_str(*p[2])) : e, case_sensitive);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return reverse ? compare(key(y), key(x)) < 0 : compare(key(x), key(y)) < 0;
  });
  return list_of(std::move(items));
}

Value f_dictsort(const Value& v, Args& a) {
  auto p = bind(a, {"case_sensitive", "by", "reverse"}, "dictsort");
  if (!v.is_mapping()) throw std::runtime_error("dictsort needs a mapping");
  bool case_sensitive = p[0] && truthy(*p[0]), reverse = p[2] && truthy(*p[2]);
  int index = p[1] && to_str(*p[1]) == "value" ? 1 : 0;
  List items;
  for (const auto& [k, e] : v.dict->items) items.push_back(Value::make_tuple({Value::string(k), e}));
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    Value kx = sort_key((*x.list)[index], case_sensitive), ky = sort_key((*y.list)[index], case_sensitive);
    return reverse ? compare(ky, kx) < 0 : compare(kx, ky) < 0;
  });
  return list_of(std::move(items));
}

// jinja2's indent(s, width=4, first=False, blank=False): lines after the first get the
// indentation, blank lines only with blank=True.
Value f_indent(const Value& v, Args& a) {
  auto p = bind(a, {"width", "first", "blank"}, "indent");
  std::string indentation;
  if (p[0] && p[0]->is_string()) {
    indentation = p[0]->s;
  } else {
    const int64_t width = int_arg(p[0], 4);  // " " * width: empty when negative
    budget_repeat(width, 1);
    indentation.assign(static_cast<size_t>(std::max<int64_t>(width, 0)), ' ');
  }
  std::vector<std::string> lines = py_splitlines(to_str(v) + "\n");
  std::string out;
  for (size_t k = 0; k < lines.size(); ++k) {
    bool indent = k > 0 && (!lines[k].empty() || (p[2] && truthy(*p[2])));
    budget_append(out.size(), 1 + (indent ? indentation.size() : 0) + lines[k].size());
    if (k) out += "\n";
    out += (indent ? indentation : "") + lines[k];
  }
  if (p[1] && truthy(*p[1])) {
    budget_append(out.size(), indentation.size());
    out = indentation + out;
  }
  return same_kind(v, out);
}

Value f_wordcount(const Value& v, Args&) {
  int64_t n = 0;
  bool in_word = false;
  for (unsigned char c : to_str(v)) {
    bool word = std::isalnum(c) || c == '_' || c >= 0x80;
    n += word && !in_word;
    in_word = word;
  }
  return Value::integer(n);
}

Value min_max(const Value& v, Args& a, bool want_max) {
  auto p = bind(a, {"case_sensitive", "attribute"}, want_max ? "max" : "min");
  bool case_sensitive = p[0] && truthy(*p[0]);
  List items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& e) {
    return sort_key(p[1] && !p[1]->is_none() ? get_path(e, to_str(*p[1])) : e, case_sensitive);
  };
  Value best = items.front();
  for (const Value& e : items) {
    int c = compare(key(e), key(best));
    if (want_max ? c > 0 : c < 0) best = e;
  }
  return best;
}
Value f_min(const Value& v, Args& a) { return min_max(v, a, false); }
Value f_max(const Value& v, Args& a) { return min_max(v, a, true); }

Value f_sum(const Value& v, Args& a) {
  auto p = bind(a, {"attribute", "start"}, "sum");
  Value total = arg_or(p[1], Value::integer(0));
  for (const Value& e : iterate(v)) {
    Value item = p[0] && !p[0]->is_none() ? get_path(e, to_str(*p[0])) : e;
    if (!item.is_number() || !total.is_number()) throw std::runtime_error("sum() needs numbers");
    total = total.kind == Kind::kFloat || item.kind == Kind::kFloat
                ? Value::real(as_double(total) + as_double(item))
                : Value::integer(static_cast<int64_t>(as_double(total)) + (item.kind == Kind::kInt ? item.i : item.b));
  }
  return total;
}

const std::map<std::string, FilterFn>& filters() {
  static const std::map<std::string, FilterFn> table = {
      {"trim", f_trim}, {"tojson", f_tojson}, {"length", f_length}, {"count", f_length}, {"items", f_items},
      {"join", f_join}, {"upper", f_upper}, {"lower", f_lower}, {"capitalize", f_capitalize}, {"title", f_title},
      {"replace", f_replace}, {"select", f_select}, {"reject", f_reject}, {"selectattr", f_selectattr},
      {"rejectattr", f_rejectattr}, {"map", f_map}, {"list", f_list}, {"first", f_first}, {"last", f_last},
      {"default", f_default}, {"d", f_default}, {"string", f_string}, {"int", f_int}, {"float", f_float},
      {"abs", f_abs}, {"round", f_round}, {"safe", f_safe}, {"escape", f_escape}, {"e", f_escape},
      {"striptags", f_striptags}, {"unique", f_unique}, {"reverse", f_reverse},
      {"sort", f_sort}, {"dictsort", f_dictsort}, {"indent", f_indent}, {"wordcount", f_wordcount},
      {"min", f_min}, {"max", f_max}, {"sum", f_sum}};
  return table;
}

// --- tests -------------------------------------------------------------------------------------
Value one_arg(Args& a, const char* test) {
  if (a.positional.size() != 1 || !a.keyword.empty()) throw std::runtime_error(std::string(test) + " takes one argument");
  return a.positional[0];
}
bool is_int(const Value& v) { return v.kind == Kind::kInt; }

bool t_defined(const Value& v, Args&) { return !v.is_undefined(); }
bool t_undefined(const Value& v, Args&) { return v.is_undefined(); }
bool t_none(const Value& v, Args&) { return v.is_none(); }
bool t_string(const Value& v, Args&) { return v.is_string(); }
bool t_mapping(const Value& v, Args&) { return v.is_mapping(); }
bool t_iterable(const Value& v, Args&) {
  return v.is_string() || v.is_sequence() || v.is_mapping() || v.is_undefined();
}
bool t_sequence(const Value& v, Args&) { return v.is_string() || (v.is_sequence() && !v.generator) || v.is_mapping(); }
bool t_number(const Value& v, Args&) { return v.is_number(); }
bool t_integer(const Value& v, Args&) { return is_int(v); }
bool t_float(const Value& v, Args&) { return v.kind == Kind::kFloat; }
bool t_boolean(const Value& v, Args&) { return v.kind == Kind::kBool; }
bool t_true(const Value& v, Args&) { return v.kind == Kind::kBool && v.b; }
bool t_false(const Value& v, Args&) { return v.kind == Kind::kBool && !v.b; }
int64_t int_value(const Value& v, const char* test) {
  if (v.kind == Kind::kInt) return v.i;
  if (v.kind == Kind::kBool) return v.b;
  throw std::runtime_error(std::string(test) + " needs an integer");
}
bool t_even(const Value& v, Args&) { return int_value(v, "even") % 2 == 0; }
bool t_odd(const Value& v, Args&) { return int_value(v, "odd") % 2 != 0; }
bool t_divisibleby(const Value& v, Args& a) {
  int64_t d = int_value(one_arg(a, "divisibleby"), "divisibleby");
  if (d == 0) throw std::runtime_error("integer division or modulo by zero");
  return int_value(v, "divisibleby") % d == 0;
}
bool t_eq(const Value& v, Args& a) { return equal(v, one_arg(a, "eq")); }
bool t_ne(const Value& v, Args& a) { return !equal(v, one_arg(a, "ne")); }
bool t_lt(const Value& v, Args& a) { return compare(v, one_arg(a, "lt")) < 0; }
bool t_le(const Value& v, Args& a) { return compare(v, one_arg(a, "le")) <= 0; }
bool t_gt(const Value& v, Args& a) { return compare(v, one_arg(a, "gt")) > 0; }
bool t_ge(const Value& v, Args& a) { return compare(v, one_arg(a, "ge")) >= 0; }
bool t_in(const Value& v, Args& a) {
  Value container = one_arg(a, "in");
  if (container.is_string()) return v.is_string() && container.s.find(v.s) != std::string::npos;
  List items = iterate(container);
  return std::any_of(items.begin(), items.end(), [&](const Value& e) { return equal(e, v); });
}
bool t_callable(const Value& v, Args&) { return v.kind == Kind::kFunction; }
// jinja2: str(value).islower() / isupper().
bool t_lower(const Value& v, Args&) { return py_islower(to_str(v)); }
bool t_upper(const Value& v, Args&) { return py_isupper(to_str(v)); }
bool t_sameas(const Value& v, Args& a) {
  Value other = one_arg(a, "sameas");
  if (v.kind != other.kind) return false;
  if (v.kind == Kind::kNone || v.kind == Kind::kUndefined) return true;
  if (v.kind == Kind::kBool) return v.b == other.b;
  return v.list == other.list && v.dict == other.dict && v.fn == other.fn && v.is_sequence() + v.is_mapping() > 0;
}

const std::map<std::string, TestFn>& tests() {
  static const std::map<std::string, TestFn> table = {
      {"defined", t_defined}, {"undefined", t_undefined}, {"none", t_none}, {"string", t_string},
      {"mapping", t_mapping}, {"iterable", t_iterable}, {"sequence", t_sequence}, {"number", t_number},
      {"integer", t_integer}, {"float", t_float}, {"boolean", t_boolean}, {"true", t_true}, {"false", t_false},
      {"even", t_even}, {"odd", t_odd}, {"divisibleby", t_divisibleby}, {"equalto", t_eq}, {"eq", t_eq},
      {"==", t_eq}, {"ne", t_ne}, {"!=", t_ne}, {"lt", t_lt}, {"lessthan", t_lt}, {"<", t_lt}, {"le", t_le},
      {"<=", t_le}, {"gt", t_gt}, {"greaterthan", t_gt}, {">", t_gt}, {"ge", t_ge}, {">=", t_ge},
      {"in", t_in}, {"callable", t_callable}, {"lower", t_lower}, {"upper", t_upper}, {"sameas", t_sameas}};
  return table;
}

}  // namespace

bool has_filter(const std::string& name) { return filters().count(name) > 0; }
bool has_test(const std::string& name) { return tests().count(name) > 0; }

Value apply_filter(const std::string& name, const Value& value, Args& args) {
  auto it = filters().find(name);
  if (it == filters().end()) throw std::runtime_error("no filter named '" + name + "'");
  // jinja2's filters read an undefined operand as empty (length 0, "" for text); |default and
  // |tojson see it as it is (tojson then fails, as json.dumps does).
  return it->second(value, args);
}

bool apply_test(const std::string& name, const Value& value, Args& args) {
  auto it = tests().find(name);
  if (it == tests().end()) throw std::runtime_error("no test named '" + name + "'");
  return it->second(value, args);
}

}  // namespace qlora::jinja
