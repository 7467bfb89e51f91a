// Splits a template into text and the tokens of its {{ }} and {% %} tags, applying whitespace
// control as jinja2's lexer does with trim_blocks and lstrip_blocks on (transformers' setting):
// `-` strips all whitespace on that side, `+` keeps it, a block or comment tag alone on its line
// loses the indentation before it (lstrip_blocks) and the newline after it (trim_blocks).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qlora::jinja {

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEnd };

struct Token {
  Tok type;
  std::string text;  // kText: the text; kName/kOp: the spelling; kString: the unescaped value
  int line = 1, col = 1;
  int64_t int_value = 0;
  double float_value = 0.0;
};

// Throws TemplateError naming origin, line and column for a malformed tag or literal.
// The source's newlines are normalised to "\n" and one trailing newline is dropped, as jinja2
// does (keep_trailing_newline=False).
std::vector<Token> tokenize(std::string_view source, const std::string& origin);

}  // namespace qlora::jinja
