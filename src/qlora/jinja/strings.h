// Python's str operations on UTF-8 text, as the filters and methods templates use need them.
// Case mapping covers ASCII only (other characters keep their case); whitespace is Python's
// str.isspace() set, Unicode spaces included, since chat content carries them and |trim strips them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qlora::jinja {

bool py_isspace(uint32_t cp);
// str.strip/lstrip/rstrip(chars): chars nullopt strips whitespace.
std::string py_strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
// str.split(sep, maxsplit) / rsplit: sep nullopt splits on runs of whitespace.
std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit,
                                  bool from_right);
std::string py_replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count);
std::string py_upper(std::string_view s);
std::string py_lower(std::string_view s);
std::string py_capitalize(std::string_view s);
std::string py_title(std::string_view s);      // str.title()
std::string jinja_title(std::string_view s);   // jinja2's |title (words split at -, space, brackets)
int64_t py_count(std::string_view s, std::string_view sub);
// str.find in code points (-1 when absent); from_right: rfind.
int64_t py_find(std::string_view s, std::string_view sub, bool from_right);
std::vector<std::string> py_splitlines(std::string_view s);

}  // namespace qlora::jinja
