// markupsafe's Markup semantics (markup.h); checked against markupsafe 3.0 as jinja2 3.1 uses it.
#include "qlora/jinja/markup.h"

#include <stdexcept>

#include "qlora/jinja/budget.h"
#include "qlora/jinja/strings.h"

namespace qlora::jinja {

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '\'': out += "&#39;"; break;
      case '"': out += "&#34;"; break;
      default: out += c;
    }
  }
  budget_bytes(out.size());
  return out;
}

Value escape_value(const Value& v) {
  if (v.is_string() && v.markup) return v;
  return Value::make_markup(html_escape(to_str(v)));
}

Value markup_concat(const Value& a, const Value& b) {
  std::string x = escape_value(a).s, y = escape_value(b).s;
  budget_append(x.size(), y.size());
  return Value::make_markup(x + y);
}

Value as_markup(Value v) {
  if (v.is_string()) {
    v.markup = true;
  } else if (v.is_sequence()) {
    List items = *v.list;  // a fresh list: the method's result may share nothing with its input
    for (Value& e : items) e = as_markup(std::move(e));
    return v.kind == Kind::kTuple ? Value::make_tuple(std::move(items)) : Value::make_list(std::move(items));
  }
  return v;
}

namespace {

// html.unescape on text without tags: the entities markupsafe's escape writes, and '&' where
// html.unescape's pattern cannot start an entity (end of text, space, '<', '&', ';').
std::string unescape_known(const std::string& s) {
  static const std::pair<const char*, const char*> kEntities[] = {
      {"amp;", "&"}, {"lt;", "<"}, {"gt;", ">"}, {"quot;", "\""}, {"#39;", "'"}, {"#34;", "\""}};
  std::string out;
  for (size_t k = 0; k < s.size(); ++k) {
    if (s[k] != '&') {
      out += s[k];
      continue;
    }
    bool done = false;
    for (const auto& [name, text] : kEntities) {
      if (s.compare(k + 1, std::char_traits<char>::length(name), name) == 0) {
        out += text;
        k += std::char_traits<char>::length(name);
        done = true;
        break;
      }
    }
    if (done) continue;
    if (k + 1 < s.size() && std::string(" <&;").find(s[k + 1]) == std::string::npos) {
      throw std::runtime_error("striptags of text with the HTML entity '" + s.substr(k, 12) +
                              "...' is not supported (only &amp; &lt; &gt; &quot; &#39; &#34;)");
    }
    out += '&';
  }
  return out;
}

}  // namespace

std::string strip_tags(const std::string& s) {
  std::string kept;
  size_t pos = 0, start;
  while ((start = s.find('<', pos)) != std::string::npos) {
    bool comment = s.compare(start, 4, "<!--") == 0;
    size_t end = comment ? s.find("-->", start + 4) : s.find('>', start);
    if (end == std::string::npos) break;  // unclosed: the rest stays as text
    kept.append(s, pos, start - pos);
    pos = end + (comment ? 3 : 1);
  }
  kept.append(s, pos, std::string::npos);
  std::string collapsed;
  for (const std::string& word : py_split(kept, std::nullopt, -1, false)) {
    if (!collapsed.empty()) collapsed += ' ';
    collapsed += word;
  }
  return unescape_known(collapsed);
}

}  // namespace qlora::jinja
