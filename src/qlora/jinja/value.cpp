#include "qlora/jinja/value.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace qlora::jinja {

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

Value* Dict::find(const std::string& key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  if (Value* old = find(key)) *old = std::move(v);
  else items.emplace_back(key, std::move(v));
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return none();
    case nlohmann::json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return Value(j.get<int64_t>());
    case nlohmann::json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      List l;
      for (const auto& e : j) l.push_back(from_json(e));
      return Value(std::move(l));
    }
    case nlohmann::json::value_t::object: {
      Dict d;
      for (const auto& [k, v] : j.items()) d.items.emplace_back(k, from_json(v));
      return Value(std::move(d));
    }
    default: return Value();
  }
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool:
    case Kind::kInt: return int_ != 0;
    case Kind::kFloat: return float_ != 0;
    case Kind::kString: return !str_->empty();
    case Kind::kList: return !list_->empty();
    case Kind::kDict: return namespace_ || !dict_->items.empty();
    case Kind::kCallable: return true;
  }
  return false;
}

std::string python_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // Python's repr: the shortest digits that read back, positional for exponents -4..15, else
  // d.ddde+XX.
  char buf[48];
  for (int p = 0; p <= 16; ++p) {
    std::snprintf(buf, sizeof buf, "%.*e", p, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::string text = buf;
  const size_t e = text.find('e');
  const int exp = std::atoi(text.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (std::isdigit(static_cast<unsigned char>(text[i]))) digits += text[i];
  const std::string sign = d < 0 ? "-" : "";
  if (exp < -4 || exp >= 16) {
    std::string m = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    char ex[16];
    std::snprintf(ex, sizeof ex, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return sign + m + ex;
  }
  if (exp < 0) return sign + "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  const size_t point = static_cast<size_t>(exp) + 1;
  if (digits.size() <= point) return sign + digits + std::string(point - digits.size(), '0') + ".0";
  return sign + digits.substr(0, point) + "." + digits.substr(point);
}

namespace {

std::string python_quote(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == static_cast<unsigned char>(q) || c == '\\') out += '\\', out += static_cast<char>(c);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  return out + q;
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

void dump_json(const Value& v, int indent, bool sort_keys, int depth, std::string& out) {
  const std::string item_sep = indent >= 0 ? "," : ", ";
  const auto newline = [&](int d) {
    if (indent >= 0) out += "\n" + std::string(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
    case Value::Kind::kFloat: {
      const double d = v.as_float();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : python_float(d);
      return;
    }
    case Value::Kind::kString: out += json_quote(v.str()); return;
    case Value::Kind::kList: {
      if (v.list().empty()) return void(out += "[]");
      out += "[";
      for (size_t k = 0; k < v.list().size(); ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        dump_json(v.list()[k], indent, sort_keys, depth + 1, out);
      }
      newline(depth);
      out += "]";
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict().items.empty()) return void(out += "{}");
      auto items = v.dict().items;
      if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.first < b.first; });
      out += "{";
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        out += json_quote(items[k].first) + ": ";
        dump_json(items[k].second, indent, sort_keys, depth + 1, out);
      }
      newline(depth);
      out += "}";
      return;
    }
    case Value::Kind::kCallable: throw std::runtime_error("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string Value::to_json(int indent, bool sort_keys) const {
  std::string out;
  dump_json(*this, indent, sort_keys, 0, out);
  return out;
}

std::string Value::to_str() const {
  switch (kind_) {
    case Kind::kUndefined: return "";
    case Kind::kString: return *str_;
    default: return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::kUndefined: return "";
    case Kind::kNone: return "None";
    case Kind::kBool: return int_ ? "True" : "False";
    case Kind::kInt: return std::to_string(int_);
    case Kind::kFloat: return python_float(float_);
    case Kind::kString: return python_quote(*str_);
    case Kind::kList: {
      std::string out = "[";
      for (size_t k = 0; k < list_->size(); ++k) out += (k ? ", " : "") + (*list_)[k].repr();
      return out + "]";
    }
    case Kind::kDict: {
      if (namespace_) return "<Namespace>";
      std::string out = "{";
      for (size_t k = 0; k < dict_->items.size(); ++k)
        out += (k ? ", " : "") + python_quote(dict_->items[k].first) + ": " + dict_->items[k].second.repr();
      return out + "}";
    }
    case Kind::kCallable: return "<function>";
  }
  return "";
}

const char* Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined: return "undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kDict: return namespace_ ? "Namespace" : "dict";
    case Kind::kCallable: return "function";
  }
  return "?";
}

bool operator==(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.str() == b.str();
    case Value::Kind::kList: return a.list() == b.list();
    case Value::Kind::kDict:
      return a.dict().items.size() == b.dict().items.size() &&
             std::all_of(a.dict().items.begin(), a.dict().items.end(), [&](const auto& kv) {
               const Value* o = b.dict().find(kv.first);
               return o && *o == kv.second;
             });
    default: return a.fn_ == b.fn_;
  }
}

}  // namespace qlora::jinja
