// Python's operators on template values (operators.cpp).
#pragma once

#include <string>

#include "qlora/jinja/value.h"

namespace qlora::jinja {

// + - * / // % ** and ~ ; throws std::runtime_error with Python's message for bad operands.
Value binary_op(const std::string& op, const Value& a, const Value& b);
// v[start:stop:step] of a list, tuple or string; absent parts are None.
Value slice_of(const Value& v, const Value& start, const Value& stop, const Value& step);
// v[key] as jinja2's getitem: a missing key or index is undefined.
Value get_item(const Value& obj, const Value& key);
// v.name as jinja2's getattr: methods first, then a dict's key; missing is undefined.
Value get_attr(const Value& obj, const std::string& name);
// Python's `item in container`.
bool contains(const Value& container, const Value& item);

}  // namespace qlora::jinja
