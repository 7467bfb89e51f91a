#include "qlora/jinja/value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include <unicode/uchar.h>

#include "qlora/jinja/budget.h"

namespace qlora::jinja {

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(key, std::move(value));
}

Value Value::undefined(std::string name) {
  Value v;
  v.s = std::move(name);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind = Kind::kBool;
  v.b = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind = Kind::kInt;
  v.i = i;
  return v;
}
Value Value::real(double f) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = f;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind = Kind::kString;
  v.s = std::move(s);
  return v;
}
Value Value::make_markup(std::string s) {
  Value v = string(std::move(s));
  v.markup = true;
  return v;
}
Value Value::make_list(List items) {
  Value v;
  v.kind = Kind::kList;
  v.list = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::make_tuple(List items) {
  Value v = make_list(std::move(items));
  v.kind = Kind::kTuple;
  return v;
}
Value Value::make_dict() {
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::make_shared<Dict>();
  return v;
}
Value Value::make_namespace() {
  Value v = make_dict();
  v.kind = Kind::kNamespace;
  return v;
}
Value Value::function(std::string name, std::function<Value(Args&)> call) {
  Value v;
  v.kind = Kind::kFunction;
  v.fn = std::make_shared<Function>(Function{std::move(name), std::move(call)});
  return v;
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return v.markup ? "Markup" : "str";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kNamespace: return "Namespace";
    case Kind::kFunction: return "function";
  }
  return "?";
}

std::string object_type_name(const Value& v) { return v.markup ? "markupsafe.Markup" : type_name(v); }

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return v.b;
    case Kind::kInt: return v.i != 0;
    case Kind::kFloat: return v.f != 0.0;
    case Kind::kString: return !v.s.empty();
    case Kind::kList:
    case Kind::kTuple: return v.generator || !v.list->empty();
    case Kind::kDict: return !v.dict->items.empty();
    case Kind::kNamespace:
    case Kind::kFunction: return true;
  }
  return false;
}

double as_double(const Value& v) {
  if (v.kind == Kind::kFloat) return v.f;
  if (v.kind == Kind::kInt) return static_cast<double>(v.i);
  if (v.kind == Kind::kBool) return v.b ? 1.0 : 0.0;
  throw std::runtime_error(std::string("expected a number, got ") + type_name(v));
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Kind::kFloat && b.kind != Kind::kFloat) return compare(a, b) == 0;  // exact for ints
    return as_double(a) == as_double(b);
  }
  if (a.is_sequence() && b.is_sequence()) {
    if (a.kind != b.kind || a.list->size() != b.list->size()) return false;
    budget_steps(static_cast<int64_t>(a.list->size()));
    for (size_t k = 0; k < a.list->size(); ++k) {
      if (!equal((*a.list)[k], (*b.list)[k])) return false;
    }
    return true;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kString: return a.s == b.s;
    case Kind::kDict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      budget_steps(static_cast<int64_t>(a.dict->items.size()));
      for (const auto& [k, v] : a.dict->items) {
        const Value* other = b.dict->find(k);
        if (!other || !equal(v, *other)) return false;
      }
      return true;
    }
    default: return a.dict == b.dict && a.fn == b.fn;  // identity
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Kind::kFloat && b.kind != Kind::kFloat) {
      int64_t x = a.kind == Kind::kInt ? a.i : a.b, y = b.kind == Kind::kInt ? b.i : b.b;
      return x < y ? -1 : x > y ? 1 : 0;
    }
    double x = as_double(a), y = as_double(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.s.compare(b.s);  // UTF-8 byte order is code point order
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_sequence() && a.kind == b.kind) {
    size_t n = std::min(a.list->size(), b.list->size());
    budget_steps(static_cast<int64_t>(n));
    for (size_t k = 0; k < n; ++k) {
      if (!equal((*a.list)[k], (*b.list)[k])) return compare((*a.list)[k], (*b.list)[k]);
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  throw std::runtime_error(std::string("'<' not supported between instances of '") + type_name(a) +
                           "' and '" + type_name(b) + "'");
}

std::string float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  // Python's repr: the shortest digits that read back as the same double.
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string text(buf);
  size_t e = text.find('e');
  int exponent = std::atoi(text.c_str() + e + 1);
  std::string digits;
  bool negative = text[0] == '-';
  for (size_t k = negative ? 1 : 0; k < e; ++k) {
    if (text[k] != '.') digits += text[k];
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = negative ? "-" : "";
  if (exponent >= 16 || exponent < -4) {  // repr switches to scientific notation here
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    std::snprintf(buf, sizeof buf, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + buf;
  }
  if (exponent < 0) return out + "0." + std::string(-exponent - 1, '0') + digits;
  if (static_cast<int>(digits.size()) <= exponent + 1) {
    return out + digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
  }
  return out + digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
}

namespace {

// Python's str.isprintable(): what repr() leaves unescaped. Not printable: the "Other" general
// categories (controls, format, surrogates, private use, unassigned) and separators but the space.
bool printable(int32_t cp) {
  if (cp == ' ') return true;
  switch (u_charType(cp)) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_SPACE_SEPARATOR:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR: return false;
    default: return true;
  }
}

std::string string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t pos = 0; pos < s.size();) {
    size_t start = pos;
    int32_t cp = utf8_next(s, pos);
    char buf[16];
    if (cp == kUtf8Invalid) {  // no Python str holds one: its bytes pass through as they are
      out.append(s, start, pos - start);
    } else if (cp == '\\' || cp == quote) {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (!printable(cp)) {
      std::snprintf(buf, sizeof buf, cp < 0x100 ? "\\x%02x" : "\\u%04x", cp);
      out += buf;
    } else {
      out.append(s, start, pos - start);
    }
  }
  return out + quote;
}

}  // namespace

std::string to_repr(const Value& v) {
  switch (v.kind) {
    case Kind::kString: return v.markup ? "Markup(" + string_repr(v.s) + ")" : string_repr(v.s);
    case Kind::kList:
    case Kind::kTuple: {
      bool tuple = v.kind == Kind::kTuple;
      std::string out = tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        std::string item = to_repr((*v.list)[k]);
        budget_append(out.size(), item.size() + 2);
        if (k) out += ", ";
        out += item;
      }
      if (tuple && v.list->size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      std::string out = v.kind == Kind::kNamespace ? "<Namespace {" : "{";
      for (size_t k = 0; k < v.dict->items.size(); ++k) {
        if (k) out += ", ";
        out += string_repr(v.dict->items[k].first) + ": " + to_repr(v.dict->items[k].second);
      }
      return out + (v.kind == Kind::kNamespace ? "}>" : "}");
    }
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "";
    case Kind::kNone: return "None";
    case Kind::kBool: return v.b ? "True" : "False";
    case Kind::kInt: return std::to_string(v.i);
    case Kind::kFloat: return float_repr(v.f);
    case Kind::kString: return v.s;
    case Kind::kFunction: return "<function " + v.fn->name + ">";
    default: return to_repr(v);
  }
}

List iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return {};
    case Kind::kList:
    case Kind::kTuple: {
      size_t bytes = 0;
      for (const Value& e : *v.list) bytes += e.is_string() ? e.s.size() : 0;
      budget_steps(static_cast<int64_t>(v.list->size()));
      budget_copied(bytes);  // the copy below
      return *v.list;
    }
    case Kind::kDict: {
      budget_steps(static_cast<int64_t>(v.dict->items.size()));
      List keys;
      for (const auto& item : v.dict->items) keys.push_back(Value::string(item.first));
      return keys;
    }
    case Kind::kString: {
      budget_steps(static_cast<int64_t>(v.s.size()));
      budget_copied(v.s.size());
      List chars;
      for (auto& c : utf8_chars(v.s)) chars.push_back(Value::string(std::move(c)));
      return chars;
    }
    default: throw std::runtime_error(std::string("'") + type_name(v) + "' object is not iterable");
  }
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return 0;
    case Kind::kString: return utf8_length(v.s);
    case Kind::kList:
    case Kind::kTuple:
      if (v.generator) throw std::runtime_error("object of type 'generator' has no len()");
      return static_cast<int64_t>(v.list->size());
    case Kind::kDict: return static_cast<int64_t>(v.dict->items.size());
    default: throw std::runtime_error(std::string("object of type '") + type_name(v) + "' has no len()");
  }
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      for (const auto& e : j) items.push_back(from_json(e));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::make_dict();
      for (const auto& [k, e] : j.items()) d.dict->items.emplace_back(k, from_json(e));
      return d;
    }
    default: throw std::runtime_error("unsupported JSON value in the template context");
  }
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t pos = 0; pos < s.size();) {
    size_t start = pos;
    int32_t cp = utf8_next(s, pos);
    char buf[16];
    // No Python str holds ill-formed UTF-8: its bytes pass through, or as ASCII, U+FFFD.
    if (cp == kUtf8Invalid && !ensure_ascii) {
      out.append(s, start, pos - start);
      continue;
    }
    if (cp == kUtf8Invalid) cp = 0xFFFD;
    switch (cp) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (cp < 0x20 || (ensure_ascii && cp >= 0x7F)) {
          if (cp >= 0x10000) {  // a surrogate pair, as json.dumps writes it
            uint32_t u = cp - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (u >> 10), 0xDC00 + (u & 0x3FF));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", cp);
          }
          out += buf;
        } else {
          out.append(s, start, pos - start);
        }
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, const JsonOptions& o, int depth) {
  auto newline = [&](int level) {
    if (o.indent < 0) return;
    budget_append(out.size(), 1 + static_cast<size_t>(o.indent) * level);
    out += '\n';
    out.append(static_cast<size_t>(o.indent) * level, ' ');
  };
  switch (v.kind) {
    case Kind::kNone: out += "null"; return;
    case Kind::kBool: out += v.b ? "true" : "false"; return;
    case Kind::kInt: out += std::to_string(v.i); return;
    case Kind::kFloat:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : float_repr(v.f);
      return;
    case Kind::kString: json_string(out, v.s, o.ensure_ascii); return;
    case Kind::kList:
    case Kind::kTuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += o.item_separator;
        newline(depth + 1);
        json_value(out, (*v.list)[k], o, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      auto items = v.dict->items;
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      }
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += o.item_separator;
        newline(depth + 1);
        json_string(out, items[k].first, o.ensure_ascii);
        out += o.key_separator;
        json_value(out, items[k].second, o, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    default:
      throw std::runtime_error(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json_text(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

}  // namespace qlora::jinja
