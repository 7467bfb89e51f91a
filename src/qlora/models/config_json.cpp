#include "qlora/models/config_json.h"

#include <stdexcept>

namespace qlora::models::cfg {

[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& what) {
  throw std::invalid_argument(where + ": config key '" + key + "': " + what);
}

bool present(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

int64_t get_int(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) fail(where, key, "missing (required)");
  const json& v = j.at(key);
  if (!v.is_number_integer()) fail(where, key, "expected an integer, got " + v.dump());
  return v.get<int64_t>();
}
int64_t get_int(const json& j, const char* key, const std::string& where, int64_t dflt) {
  return present(j, key) ? get_int(j, key, where) : dflt;
}
double get_num(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) fail(where, key, "missing (required)");
  const json& v = j.at(key);
  if (!v.is_number()) fail(where, key, "expected a number, got " + v.dump());
  return v.get<double>();
}
double get_num(const json& j, const char* key, const std::string& where, double dflt) {
  return present(j, key) ? get_num(j, key, where) : dflt;
}
bool get_bool(const json& j, const char* key, const std::string& where, bool dflt) {
  if (!present(j, key)) return dflt;
  const json& v = j.at(key);
  if (!v.is_boolean()) fail(where, key, "expected true/false, got " + v.dump());
  return v.get<bool>();
}
std::string get_str(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) fail(where, key, "missing (required)");
  const json& v = j.at(key);
  if (!v.is_string()) fail(where, key, "expected a string, got " + v.dump());
  return v.get<std::string>();
}

std::optional<double> softcap(const json& j, const char* key, const std::string& where, std::optional<double> dflt) {
  if (!j.contains(key)) return dflt;
  if (j.at(key).is_null()) return std::nullopt;
  const double v = get_num(j, key, where);
  if (!(v > 0)) fail(where, key, "must be positive or null, got " + j.at(key).dump());
  return v;
}

}  // namespace qlora::models::cfg
