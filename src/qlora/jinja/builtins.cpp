// Filters, tests and the str/list/dict methods HF chat templates call, as jinja2 and Python define
// them. An unknown name is an error, never a silent no-op.
#include <algorithm>
#include <cctype>
#include <cmath>

#include "qlora/jinja/eval.h"

namespace qlora::jinja {

Value Args::get(size_t index, const char* name) const {
  if (index < positional.size()) return positional[index];
  for (const auto& [k, v] : keyword)
    if (k == name) return v;
  return Value();
}

List iterate(const Value& v, const std::string& where) {
  if (v.is_list()) return v.list();
  if (v.is_dict()) {
    List keys;
    for (const auto& [k, _] : v.dict().items) keys.push_back(Value(k));
    return keys;
  }
  if (v.is_string()) {  // characters, as Python iterates a str: whole UTF-8 sequences
    List chars;
    for (size_t i = 0, n; i < v.str().size(); i += n) {
      const unsigned char c = static_cast<unsigned char>(v.str()[i]);
      n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      chars.push_back(Value(v.str().substr(i, n)));
    }
    return chars;
  }
  if (v.is_undefined()) return {};  // jinja2 walks an undefined as nothing
  throw TemplateError(where + ": '" + v.type_name() + "' object is not iterable");
}

bool less_than(const Value& a, const Value& b, const std::string& where) {
  if (a.is_number() && b.is_number()) return a.as_float() < b.as_float();
  if (a.is_string() && b.is_string()) return a.str() < b.str();
  throw TemplateError(where + ": '<' not supported between '" + a.type_name() + "' and '" + b.type_name() + "'");
}

namespace {

const char* const kSpace = " \t\n\r\f\v";

std::string strip(const std::string& s, const std::string& chars, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) b = s.find_first_not_of(chars);
  if (b == std::string::npos) return "";
  if (right) e = s.find_last_not_of(chars) + 1;
  return s.substr(b, e - b);
}

std::string chars_arg(const Args& a) {
  const Value v = a.get(0, "chars");
  return v.is_string() ? v.str() : kSpace;
}

std::string map_chars(std::string s, int (*f)(int)) {
  for (char& c : s) c = static_cast<char>(f(static_cast<unsigned char>(c)));
  return s;
}

std::string title_case(const std::string& s) {
  std::string out = s;
  bool start = true;
  for (char& c : out) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(c));
    c = static_cast<char>(start && alpha ? std::toupper(c) : std::tolower(c));
    start = !alpha;
  }
  return out;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out += s.substr(pos, hit - pos) + to;
    pos = hit + from.size();
  }
  return out + s.substr(pos);
}

List split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (!sep.is_string() || sep.is_none()) {  // whitespace runs, no empty parts
    size_t i = s.find_first_not_of(kSpace);
    while (i != std::string::npos) {
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        out.push_back(Value(strip(s.substr(i), kSpace, false, true)));
        break;
      }
      const size_t e = s.find_first_of(kSpace, i);
      out.push_back(Value(s.substr(i, e == std::string::npos ? std::string::npos : e - i)));
      i = e == std::string::npos ? e : s.find_first_not_of(kSpace, e);
    }
    return out;
  }
  const std::string& d = sep.str();
  if (d.empty()) throw TemplateError("split: empty separator");
  size_t pos = 0;
  for (size_t hit; (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) &&
                   (hit = s.find(d, pos)) != std::string::npos;
       pos = hit + d.size())
    out.push_back(Value(s.substr(pos, hit - pos)));
  out.push_back(Value(s.substr(pos)));
  return out;
}

Value string_method(const std::string& s, const std::string& name, Args& a) {
  if (name == "strip") return Value(strip(s, chars_arg(a), true, true));
  if (name == "lstrip") return Value(strip(s, chars_arg(a), true, false));
  if (name == "rstrip") return Value(strip(s, chars_arg(a), false, true));
  if (name == "upper") return Value(map_chars(s, ::toupper));
  if (name == "lower") return Value(map_chars(s, ::tolower));
  if (name == "title") return Value(title_case(s));
  if (name == "capitalize") return Value(s.empty() ? s : std::string(1, static_cast<char>(std::toupper(s[0]))) + map_chars(s.substr(1), ::tolower));
  if (name == "startswith" || name == "endswith") {
    const Value p = a.get(0, "prefix");
    List options = p.is_list() ? p.list() : List{p};
    for (const auto& o : options) {
      if (!o.is_string()) a.fail(name + " expects a string");
      const std::string& x = o.str();
      const bool hit = x.size() <= s.size() &&
                       (name == "startswith" ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0);
      if (hit) return Value(true);
    }
    return Value(false);
  }
  if (name == "split") {
    const Value m = a.get(1, "maxsplit");
    return Value(split(s, a.get(0, "sep"), m.is_int() ? m.as_int() : -1));
  }
  if (name == "replace") {
    const Value c = a.get(2, "count");
    return Value(replace_all(s, a.get(0, "old").to_str(), a.get(1, "new").to_str(), c.is_int() ? c.as_int() : -1));
  }
  if (name == "find") {
    const size_t at = s.find(a.get(0, "sub").to_str());
    return Value(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(at));
  }
  if (name == "count") {
    const std::string sub = a.get(0, "sub").to_str();
    int64_t n = 0;
    for (size_t p = s.find(sub); !sub.empty() && p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
    return Value(n);
  }
  if (name == "join") {
    const Value items = a.get(0, "iterable");
    std::string out;
    if (items.is_list())
      for (size_t k = 0; k < items.list().size(); ++k) out += (k ? s : "") + items.list()[k].to_str();
    return Value(out);
  }
  if (name == "isdigit" || name == "isalpha" || name == "isspace") {
    const auto pred = name == "isdigit" ? ::isdigit : name == "isalpha" ? ::isalpha : ::isspace;
    return Value(!s.empty() && std::all_of(s.begin(), s.end(), [&](char c) { return pred(static_cast<unsigned char>(c)) != 0; }));
  }
  a.fail("str has no method '" + name + "' in qlora's chat-template interpreter");
}

Value list_method(const Value& self, const std::string& name, Args& a) {
  List& l = self.list();
  if (name == "append") {
    l.push_back(a.get(0, "object"));
    return Value::none();
  }
  if (name == "pop") {
    if (l.empty()) a.fail("pop from an empty list");
    const Value i = a.get(0, "index");
    int64_t k = i.is_int() ? i.as_int() : static_cast<int64_t>(l.size()) - 1;
    if (k < 0) k += static_cast<int64_t>(l.size());
    if (k < 0 || k >= static_cast<int64_t>(l.size())) a.fail("pop index out of range");
    Value v = l[static_cast<size_t>(k)];
    l.erase(l.begin() + k);
    return v;
  }
  if (name == "index") {
    const auto it = std::find(l.begin(), l.end(), a.get(0, "value"));
    if (it == l.end()) a.fail("value is not in the list");
    return Value(static_cast<int64_t>(it - l.begin()));
  }
  if (name == "count") return Value(static_cast<int64_t>(std::count(l.begin(), l.end(), a.get(0, "value"))));
  a.fail("list has no method '" + name + "' in qlora's chat-template interpreter");
}

Value dict_method(const Value& self, const std::string& name, Args& a) {
  const Dict& d = self.dict();
  if (name == "get") {
    const Value k = a.get(0, "key");
    const Value* v = k.is_string() ? d.find(k.str()) : nullptr;
    if (v) return *v;
    const Value dflt = a.get(1, "default");
    return dflt.is_undefined() ? Value::none() : dflt;
  }
  if (name == "items" || name == "keys" || name == "values") {
    List out;
    for (const auto& [k, v] : d.items) {
      if (name == "items") out.push_back(Value(List{Value(k), v}));
      else out.push_back(name == "keys" ? Value(k) : v);
    }
    return Value(std::move(out));
  }
  a.fail("dict has no method '" + name + "' in qlora's chat-template interpreter");
}

// A value's attribute for sort/selectattr/map: dotted paths, integer parts as indices.
Value attr_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t pos = 0;
  while (pos <= path.size()) {
    const size_t dot = path.find('.', pos);
    const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (cur.is_dict()) {
      const Value* next = cur.dict().find(part);
      cur = next ? *next : Value();
    } else if (cur.is_list() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      const size_t i = std::stoul(part);
      cur = i < cur.list().size() ? cur.list()[i] : Value();
    } else {
      return Value();
    }
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

List as_list(const Value& v, const Args& a) { return iterate(v, a.where); }

// selectattr/rejectattr/select/reject: items whose attribute (or the item) passes the test.
Value select(const Value& v, Args& a, bool by_attr, bool keep) {
  List out;
  const std::string attr = by_attr ? a.get(0, "attribute").to_str() : "";
  const size_t test_at = by_attr ? 1 : 0;
  const Value test = a.get(test_at, "test");
  Args test_args;
  test_args.where = a.where;
  for (size_t k = test_at + 1; k < a.positional.size(); ++k) test_args.positional.push_back(a.positional[k]);
  // jinja2 walks a falsy value (None) as nothing here.
  for (const auto& item : v.truthy() ? as_list(v, a) : List{}) {
    const Value x = by_attr ? attr_path(item, attr) : item;
    const bool pass = test.is_undefined() ? x.truthy() : apply_test(test.str(), x, test_args);
    if (pass == keep) out.push_back(item);
  }
  return Value(std::move(out));
}

int64_t length_of(const Value& v, const Args& a) {
  if (v.is_string()) {  // characters, not bytes
    return std::count_if(v.str().begin(), v.str().end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
  }
  if (v.is_list()) return static_cast<int64_t>(v.list().size());
  if (v.is_dict()) return static_cast<int64_t>(v.dict().items.size());
  if (v.is_undefined()) return 0;
  a.fail(std::string("object of type '") + v.type_name() + "' has no len()");
}

}  // namespace

Value bound_method(const Value& self, const std::string& name) {
  static const char* const kString[] = {"strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize",
                                        "startswith", "endswith", "split", "replace", "find", "count", "join",
                                        "isdigit", "isalpha", "isspace"};
  static const char* const kList[] = {"append", "pop", "index", "count"};
  static const char* const kDict[] = {"get", "items", "keys", "values"};
  const auto known = [&](const auto& names) {
    return std::find(std::begin(names), std::end(names), name) != std::end(names);
  };
  // An unknown name is no method: on a dict it is a missing key, i.e. undefined, as in jinja2.
  if (!(self.is_string() && known(kString)) && !(self.is_list() && known(kList)) && !(self.is_dict() && known(kDict)))
    return Value();
  return Value(Callable([self, name](Args& a) -> Value {
    if (self.is_string()) return string_method(self.str(), name, a);
    if (self.is_list()) return list_method(self, name, a);
    return dict_method(self, name, a);
  }));
}

Value apply_filter(const std::string& name, const Value& v, Args& a) {
  if (name == "trim") return Value(strip(v.to_str(), chars_arg(a), true, true));
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize")
    return string_method(v.to_str(), name, a);
  if (name == "length" || name == "count") return Value(length_of(v, a));
  if (name == "string") return Value(v.to_str());
  if (name == "safe" || name == "e" || name == "escape")  // Markup: its + escapes HTML in the other operand
    a.fail("the '" + name + "' filter (HTML Markup) is not supported by qlora's chat-template interpreter");
  if (name == "tojson") {
    const Value indent = a.get(0, "indent"), sort = a.get(1, "sort_keys");
    for (const auto& [k, _] : a.keyword)
      if (k != "indent" && k != "sort_keys" && k != "ensure_ascii") a.fail("tojson: unsupported argument '" + k + "'");
    return Value(v.to_json(indent.is_int() ? static_cast<int>(indent.as_int()) : -1, sort.truthy()));
  }
  if (name == "default" || name == "d") {
    const bool boolean = a.get(1, "boolean").truthy();
    const bool use = v.is_undefined() || (boolean && !v.truthy());
    return use ? a.get(0, "default_value") : v;
  }
  if (name == "join") {
    const std::string sep = a.get(0, "d").is_undefined() ? "" : a.get(0, "d").to_str();
    const Value attr = a.get(1, "attribute");
    std::string out;
    const List items = as_list(v, a);
    for (size_t k = 0; k < items.size(); ++k)
      out += (k ? sep : "") + (attr.is_string() ? attr_path(items[k], attr.str()) : items[k]).to_str();
    return Value(out);
  }
  if (name == "replace") return string_method(v.to_str(), "replace", a);
  if (name == "items") {
    if (!v.is_dict()) a.fail("items: expected a dict");
    return dict_method(v, "items", a);
  }
  if (name == "list") return Value(as_list(v, a));
  if (name == "first" || name == "last") {
    const List l = as_list(v, a);
    if (l.empty()) return Value();
    return name == "first" ? l.front() : l.back();
  }
  if (name == "reverse") {
    if (v.is_string()) return Value(std::string(v.str().rbegin(), v.str().rend()));
    List l = as_list(v, a);
    std::reverse(l.begin(), l.end());
    return Value(std::move(l));
  }
  if (name == "unique") {
    List out;
    for (const auto& x : as_list(v, a))
      if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
    return Value(std::move(out));
  }
  if (name == "sort" || name == "dictsort") {
    List l = name == "dictsort" ? dict_method(v, "items", a).list() : as_list(v, a);
    const Value attr = a.get(name == "sort" ? 2 : 99, "attribute");
    const bool reverse = a.get(name == "sort" ? 0 : 99, "reverse").truthy();
    const auto key = [&](const Value& x) {
      if (name == "dictsort") return x.list()[0];
      return attr.is_string() ? attr_path(x, attr.str()) : x;
    };
    std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
      return reverse ? less_than(key(y), key(x), a.where) : less_than(key(x), key(y), a.where);
    });
    return Value(std::move(l));
  }
  if (name == "selectattr" || name == "rejectattr") return select(v, a, true, name == "selectattr");
  if (name == "select" || name == "reject") return select(v, a, false, name == "select");
  if (name == "map") {
    const Value attr = a.get(99, "attribute");
    List out;
    if (!v.truthy()) return Value(std::move(out));
    if (attr.is_string()) {
      for (const auto& x : as_list(v, a)) out.push_back(attr_path(x, attr.str()));
      return Value(std::move(out));
    }
    const Value filter = a.get(0, "filter");
    if (!filter.is_string()) a.fail("map: give a filter name or attribute=");
    Args rest;
    rest.where = a.where;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    for (const auto& x : as_list(v, a)) out.push_back(apply_filter(filter.str(), x, rest));
    return Value(std::move(out));
  }
  if (name == "int") {
    if (v.is_number()) return Value(v.as_int());
    try {
      return Value(static_cast<int64_t>(std::stoll(strip(v.to_str(), kSpace, true, true))));
    } catch (const std::exception&) {
      return a.get(0, "default").is_undefined() ? Value(int64_t{0}) : a.get(0, "default");
    }
  }
  if (name == "float") {
    if (v.is_number()) return Value(v.as_float());
    try {
      return Value(std::stod(v.to_str()));
    } catch (const std::exception&) {
      return Value(0.0);
    }
  }
  if (name == "abs") {
    if (!v.is_number()) a.fail("abs: expected a number");
    return v.kind() == Value::Kind::kFloat ? Value(std::fabs(v.as_float())) : Value(static_cast<int64_t>(std::llabs(v.as_int())));
  }
  if (name == "round") {
    const Value p = a.get(0, "precision");
    const double scale = std::pow(10.0, p.is_int() ? static_cast<double>(p.as_int()) : 0.0);
    return Value(std::nearbyint(v.as_float() * scale) / scale);
  }
  if (name == "indent") {
    const Value w = a.get(0, "width");
    const std::string pad = w.is_string() ? w.str() : std::string(w.is_int() ? static_cast<size_t>(w.as_int()) : 4, ' ');
    const bool first = a.get(1, "first").truthy(), blank = a.get(2, "blank").truthy();
    std::string out;
    const std::string s = v.to_str();
    size_t pos = 0;
    for (bool is_first = true; pos <= s.size(); is_first = false) {
      const size_t nl = s.find('\n', pos);
      const std::string line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      if ((!is_first || first) && (blank || !line.empty())) out += pad;
      out += line;
      if (nl == std::string::npos) break;
      out += '\n';
      pos = nl + 1;
    }
    return Value(out);
  }
  if (name == "wordcount") return Value(static_cast<int64_t>(split(v.to_str(), Value(), -1).size()));
  a.fail("filter '" + name + "' is not supported by qlora's chat-template interpreter");
}

bool apply_test(const std::string& name, const Value& v, Args& a) {
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "sequence") return v.is_list() || v.is_string() || v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_string() || v.is_dict();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.kind() == Value::Kind::kInt;
  if (name == "float") return v.kind() == Value::Kind::kFloat;
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "callable") return v.is_callable();
  if (name == "lower" || name == "upper") {
    const std::string s = v.to_str();
    return s == string_method(s, name, a).str();
  }
  if (name == "even" || name == "odd") {
    if (!v.is_int()) a.fail(name + ": expected an integer");
    return (v.as_int() % 2 == 0) == (name == "even");
  }
  if (name == "divisibleby") {
    const Value d = a.get(0, "num");
    if (!v.is_int() || !d.is_int() || d.as_int() == 0) a.fail("divisibleby: expected integers");
    return v.as_int() % d.as_int() == 0;
  }
  if (name == "equalto" || name == "eq" || name == "==") return v == a.get(0, "other");
  if (name == "ne" || name == "!=") return !(v == a.get(0, "other"));
  if (name == "in") {
    const Value c = a.get(0, "seq");
    if (c.is_string()) return v.is_string() && c.str().find(v.str()) != std::string::npos;
    if (c.is_list()) return std::find(c.list().begin(), c.list().end(), v) != c.list().end();
    if (c.is_dict()) return v.is_string() && c.dict().find(v.str()) != nullptr;
    a.fail("in: expected a container");
  }
  a.fail("test '" + name + "' is not supported by qlora's chat-template interpreter");
}

}  // namespace qlora::jinja
