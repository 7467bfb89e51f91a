// One spelling table per enum. The component that owns an enum lists each value's name once (its
// TOML / command-line spelling); parsing, printing and the "expected one of" lists of errors all
// read that table, so a name cannot differ between what is accepted and what is written.
#pragma once

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace qlora::io {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

// "?" for a value the table lacks.
template <class E, size_t N>
const char* enum_name(const EnumName<E> (&table)[N], E value) {
  for (const auto& e : table)
    if (e.value == value) return e.name;
  return "?";
}

template <class E, size_t N>
std::optional<E> enum_value(const EnumName<E> (&table)[N], std::string_view name) {
  for (const auto& e : table)
    if (name == e.name) return e.value;
  return std::nullopt;
}

// The names in table order: "a, b, c".
template <class E, size_t N>
std::string enum_names(const EnumName<E> (&table)[N]) {
  std::string out;
  for (const auto& e : table) out += (out.empty() ? "" : ", ") + std::string(e.name);
  return out;
}

// enum_value, or std::invalid_argument "unknown <what> '<name>'; expected one of a, b, c".
template <class E, size_t N>
E enum_from_name(const EnumName<E> (&table)[N], std::string_view name, const char* what) {
  if (const auto v = enum_value(table, name)) return *v;
  throw std::invalid_argument("unknown " + std::string(what) + " '" + std::string(name) +
                              "'; expected one of " + enum_names(table));
}

}  // namespace qlora::io
