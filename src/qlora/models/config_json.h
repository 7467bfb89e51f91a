// Reading config.json values: typed getters that name the file and key in every error, shared by
// the config parser (decoder_config.cpp) and the families' own keys (families/).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace qlora::models::cfg {

using nlohmann::json;

// std::invalid_argument "<where>: config key '<key>': <what>".
[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& what);

// HF writes null for "use the default" (e.g. head_dim: null), so null counts as absent.
bool present(const json& j, const char* key);

// The value of `key`; without a default, an absent key is an error.
int64_t get_int(const json& j, const char* key, const std::string& where);
int64_t get_int(const json& j, const char* key, const std::string& where, int64_t dflt);
double get_num(const json& j, const char* key, const std::string& where);
double get_num(const json& j, const char* key, const std::string& where, double dflt);
bool get_bool(const json& j, const char* key, const std::string& where, bool dflt);
std::string get_str(const json& j, const char* key, const std::string& where);

// A soft-cap key: absent means the family's default, null means none.
std::optional<double> softcap(const json& j, const char* key, const std::string& where, std::optional<double> dflt);

}  // namespace qlora::models::cfg
