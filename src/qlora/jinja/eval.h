// What template.cpp (statements, expressions) and builtins.cpp (filters, tests, methods, globals)
// share: call arguments and the error helper.
#pragma once

#include <string>
#include <vector>

#include "qlora/jinja/ast.h"
#include "qlora/jinja/template.h"
#include "qlora/jinja/value.h"

namespace qlora::jinja {

// Arguments of a call, filter or test: positional ones, then keyword ones.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  std::string where;  // "origin:line:col", for errors
  // The argument at `index` or named `name`; undefined when absent.
  Value get(size_t index, const char* name) const;
  [[noreturn]] void fail(const std::string& what) const { throw TemplateError(where + ": " + what); }
};

// Filters (value | name(args)), tests (value is name(args)) and methods (value.name(args)).
// Each throws TemplateError naming args.where for an unknown name or wrong argument.
Value apply_filter(const std::string& name, const Value& value, Args& args);
bool apply_test(const std::string& name, const Value& value, Args& args);
// Method `name` of a string, list or dict bound to `self`; undefined when there is none.
Value bound_method(const Value& self, const std::string& name);

// What a for loop or a filter walks: a list, a dict's keys, a string's characters; undefined is
// empty. Throws TemplateError naming `where` for anything else.
List iterate(const Value& v, const std::string& where);

// Python's `a < b` for numbers and strings; throws for other kinds.
bool less_than(const Value& a, const Value& b, const std::string& where);

}  // namespace qlora::jinja
