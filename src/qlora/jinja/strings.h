// Python's str operations on UTF-8 text, as the filters and methods templates use need them.
// Case mappings and character classes are Python's on all of Unicode (ICU's data: full case
// mappings, Final_Sigma, Cased/Case_Ignorable, general categories), since chat templates are
// written for Python and chat text is not ASCII. Ill-formed UTF-8 (no Python str holds it) is one
// character per ill-formed unit, kept as its bytes, of no case and no class.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qlora::jinja {

bool py_isspace(int32_t cp);
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
// str.isupper(), islower(), isalpha(), isdigit(), isalnum(), isspace().
bool py_isupper(std::string_view s);
bool py_islower(std::string_view s);
bool py_isalpha(std::string_view s);
bool py_isdigit(std::string_view s);
bool py_isalnum(std::string_view s);
bool py_isspace(std::string_view s);
int64_t py_count(std::string_view s, std::string_view sub);
// str.find in code points (-1 when absent); from_right: rfind.
int64_t py_find(std::string_view s, std::string_view sub, bool from_right);
std::vector<std::string> py_splitlines(std::string_view s);

}  // namespace qlora::jinja
