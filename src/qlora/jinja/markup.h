// jinja2's Markup strings (markupsafe.Markup), as transformers' environment (autoescape off) meets
// them: |safe and |escape make one; printing, ~, |join, |tojson and comparisons see its plain
// text; but `+` and its string methods HTML-escape the plain strings they take in, so Qwen3.5's
// and functionary's tool templates depend on them.
#pragma once

#include <string>

#include "qlora/jinja/value.h"

namespace qlora::jinja {

// markupsafe's escaping of a plain str: & < > ' " become &amp; &lt; &gt; &#39; &#34;.
std::string html_escape(const std::string& s);
// markupsafe.escape(v): a Markup stays as it is; anything else is str()'d, escaped and marked.
Value escape_value(const Value& v);
// Markup's + with a str on either side (Markup.__add__ / __radd__): the plain side is escaped.
Value markup_concat(const Value& a, const Value& b);
// The Markup version of a str method's result: strings, and the strings of a list or tuple.
Value as_markup(Value v);
// Markup.striptags(): comments and tags removed, whitespace collapsed to single spaces, then the
// entities unescaped. html.unescape knows every HTML5 entity; we know the five markupsafe writes
// (and &quot;), and refuse any other '&' that could start one rather than render it differently.
std::string strip_tags(const std::string& s);

}  // namespace qlora::jinja
