#include "qlora/train/rewards.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <stdexcept>

#include "qlora/data/text_regex.h"
#include "qlora/train/reward_command.h"

namespace qlora::train {
namespace {

std::string key_of(size_t i, const char* key) {
  return "grpo.rewards[" + std::to_string(i) + "]." + key;
}

[[noreturn]] void refuse(size_t i, const char* key, const std::string& rule, const std::string& got) {
  throw std::invalid_argument("'" + key_of(i, key) + "' must be " + rule + ", got " + got);
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Trimmed, without a trailing period ("42." ends a sentence).
std::string normalized(std::string_view s) {
  s = trim(s);
  if (!s.empty() && s.back() == '.') s = trim(s.substr(0, s.size() - 1));
  return std::string(s);
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// A "," between digits that separates thousands: exactly three digits follow, then no digit.
bool thousands_comma(std::string_view s, size_t i) {
  if (i == 0 || !is_digit(s[i - 1]) || i + 3 >= s.size()) return false;
  for (size_t k = i + 1; k <= i + 3; ++k)
    if (!is_digit(s[k])) return false;
  return i + 4 == s.size() || !is_digit(s[i + 4]);
}

// The answer as a number: an optional sign, digits (with thousands commas), a decimal part, an
// exponent; a leading "$" and a trailing "%" ignored.
std::optional<double> as_number(std::string_view s) {
  s = trim(s);
  if (!s.empty() && s.back() == '%') s.remove_suffix(1);
  std::string t;
  if (!s.empty() && (s.front() == '-' || s.front() == '+')) t += s.front() == '-' ? "-" : "", s.remove_prefix(1);
  if (!s.empty() && s.front() == '$') s.remove_prefix(1);
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == ',' && thousands_comma(s, i)) continue;
    if (!is_digit(s[i]) && s[i] != '.' && s[i] != 'e' && s[i] != 'E' && s[i] != '-' && s[i] != '+') return std::nullopt;
    t += s[i];
  }
  double v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// The span of the last number in `s` (digits, thousands commas, a decimal part; a sign before it).
std::optional<std::string_view> last_number(std::string_view s) {
  std::optional<std::string_view> last;
  for (size_t i = 0; i < s.size();) {
    if (!is_digit(s[i])) {
      ++i;
      continue;
    }
    size_t b = i;
    if (b > 0 && s[b - 1] == '-' && (b == 1 || !std::isalnum(static_cast<unsigned char>(s[b - 2])))) --b;
    while (i < s.size() && (is_digit(s[i]) || (s[i] == ',' && thousands_comma(s, i)) ||
                            (s[i] == '.' && i + 1 < s.size() && is_digit(s[i + 1]))))
      ++i;
    last = s.substr(b, i - b);
  }
  return last;
}

// The content of the last \boxed{...}, braces balanced; nullopt when there is none or it is cut.
std::optional<std::string_view> last_boxed(std::string_view s) {
  const size_t at = s.rfind("\\boxed{");
  if (at == std::string_view::npos) return std::nullopt;
  const size_t open = at + 7;
  int depth = 1;
  for (size_t i = open; i < s.size(); ++i) {
    depth += s[i] == '{' ? 1 : s[i] == '}' ? -1 : 0;
    if (depth == 0) return s.substr(open, i - open);
  }
  return std::nullopt;
}

// The rest of the line after the last `marker` (ASCII case ignored when `any_case`).
std::optional<std::string_view> after_last(std::string_view s, std::string_view marker, bool any_case) {
  std::string hay(s);
  if (any_case) std::transform(hay.begin(), hay.end(), hay.begin(), [](unsigned char c) { return std::tolower(c); });
  const size_t at = hay.rfind(marker);
  if (at == std::string::npos) return std::nullopt;
  const std::string_view rest = s.substr(at + marker.size());
  return rest.substr(0, rest.find('\n'));
}

}  // namespace

std::vector<std::string> reward_keys(RewardKind kind) {
  switch (kind) {
    case RewardKind::kAnswer: return {"kind", "weight", "field", "tolerance"};
    case RewardKind::kRegex: return {"kind", "weight", "pattern"};
    case RewardKind::kLength: return {"kind", "weight", "target", "max"};
  }
  return {};
}

void validate_rewards(const std::vector<RewardSpec>& specs) {
  for (size_t i = 0; i < specs.size(); ++i) {
    const RewardSpec& s = specs[i];
    if (!std::isfinite(s.weight)) refuse(i, "weight", "a finite number", nlohmann::json(s.weight).dump());
    switch (s.kind) {
      case RewardKind::kAnswer:
        if (s.field.empty()) refuse(i, "field", "the record's field that holds the answer", "\"\"");
        if (!(s.tolerance >= 0 && std::isfinite(s.tolerance)))
          refuse(i, "tolerance", ">= 0 and finite", nlohmann::json(s.tolerance).dump());
        break;
      case RewardKind::kRegex:
        if (s.pattern.empty()) refuse(i, "pattern", "a regular expression the completion must match", "\"\"");
        try {
          data::TextRegex(s.pattern, key_of(i, "pattern"));
        } catch (const std::invalid_argument& e) {
          refuse(i, "pattern", "a valid PCRE2 pattern", nlohmann::json(s.pattern).dump() + " (" + e.what() + ")");
        }
        break;
      case RewardKind::kLength:
        if (s.target < 0) refuse(i, "target", ">= 0 (tokens)", std::to_string(s.target));
        if (s.max <= s.target)
          refuse(i, "max", "above target = " + std::to_string(s.target) + " (tokens)", std::to_string(s.max));
        break;
    }
  }
}

std::string reference_answer(const nlohmann::json& value) {
  if (value.is_number()) return value.dump();
  if (!value.is_string()) throw std::invalid_argument(std::string("is ") + value.type_name() + ", expected a string or a number");
  const std::string& s = value.get_ref<const std::string&>();
  const size_t at = s.rfind("####");
  return normalized(at == std::string::npos ? std::string_view(s) : std::string_view(s).substr(at + 4));
}

std::string final_answer(std::string_view completion, bool numeric_reference) {
  std::optional<std::string_view> a = last_boxed(completion);
  if (!a) a = after_last(completion, "####", false);
  if (!a) a = after_last(completion, "answer:", true);
  if (!a && numeric_reference) a = last_number(completion);
  if (!a) a = completion;
  return normalized(*a);
}

bool answers_equal(const std::string& completion_answer, const std::string& reference, double tolerance) {
  const std::optional<double> x = as_number(completion_answer), y = as_number(reference);
  if (x && y) return std::abs(*x - *y) <= tolerance * std::max(1.0, std::abs(*y));
  return normalized(completion_answer) == normalized(reference);
}

// ---- Rewards -----------------------------------------------------------------------------------

Rewards::Rewards(std::vector<RewardSpec> specs, std::string command, double command_weight, double command_timeout_s)
    : specs_(std::move(specs)), command_(std::move(command)), command_weight_(command_weight),
      command_timeout_s_(command_timeout_s) {
  validate_rewards(specs_);
  for (size_t i = 0; i < specs_.size(); ++i)
    regexes_.push_back(specs_[i].kind == RewardKind::kRegex
                           ? std::make_unique<data::TextRegex>(specs_[i].pattern, key_of(i, "pattern"))
                           : nullptr);
}

Rewards::~Rewards() = default;
Rewards::Rewards(Rewards&&) noexcept = default;
Rewards& Rewards::operator=(Rewards&&) noexcept = default;

std::vector<std::string> Rewards::names() const {
  std::vector<std::string> out;
  for (const RewardSpec& s : specs_) {
    const std::string kind = io::enum_name(kRewardKindNames, s.kind);
    const auto repeats = std::count_if(specs_.begin(), specs_.end(), [&](const RewardSpec& o) { return o.kind == s.kind; });
    const auto before = std::count_if(out.begin(), out.end(), [&](const std::string& n) { return n.rfind(kind, 0) == 0; });
    out.push_back(repeats > 1 ? kind + "_" + std::to_string(before) : kind);
  }
  if (!command_.empty()) out.push_back("command");
  return out;
}

void Rewards::check_record(const nlohmann::json& record, std::string_view origin) const {
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].kind != RewardKind::kAnswer) continue;
    const std::string& field = specs_[i].field;
    const auto it = record.find(field);
    std::string why;
    if (it == record.end()) {
      why = "this record has no field \"" + field + "\"";
    } else {
      try {
        reference_answer(*it);
      } catch (const std::invalid_argument& e) {
        why = "its field \"" + field + "\" " + e.what();
      }
    }
    if (!why.empty())
      throw std::invalid_argument(std::string(origin) + ": " + key_of(i, "field") + " = \"" + field +
                                  "\" names the answer the reward compares with, but " + why);
  }
}

double Rewards::score_one(size_t index, const RewardInput& in) const {
  const RewardSpec& s = specs_.at(index);
  switch (s.kind) {
    case RewardKind::kAnswer: {
      check_record(in.record, in.origin);
      const std::string reference = reference_answer(in.record[s.field]);
      const bool numeric = as_number(reference).has_value();
      return answers_equal(final_answer(in.completion, numeric), reference, s.tolerance) ? 1.0 : 0.0;
    }
    case RewardKind::kRegex: {
      const std::string text = utf8_replace_invalid(in.completion);
      try {
        return regexes_[index]->search(text) ? 1.0 : 0.0;
      } catch (const std::runtime_error& e) {
        throw std::runtime_error(std::string(in.origin) + ": " + e.what() +
                                 " (a pattern that backtracks this much needs rewriting, e.g. without nested repeats)");
      }
    }
    case RewardKind::kLength: {
      if (in.completion_tokens <= s.target) return 0.0;
      if (in.completion_tokens >= s.max) return -1.0;
      return -static_cast<double>(in.completion_tokens - s.target) / static_cast<double>(s.max - s.target);
    }
  }
  return 0.0;
}

RewardScores Rewards::score(const std::vector<RewardInput>& inputs) const {
  RewardScores out;
  out.names = names();
  out.total.assign(inputs.size(), 0.0);
  for (size_t i = 0; i < specs_.size(); ++i) {
    std::vector<double> values;
    for (const RewardInput& in : inputs) values.push_back(score_one(i, in));
    for (size_t k = 0; k < inputs.size(); ++k) out.total[k] += specs_[i].weight * values[k];
    out.each.push_back(std::move(values));
  }
  if (!command_.empty()) {
    std::vector<double> values = run_reward_command(command_, inputs, command_timeout_s_);
    for (size_t k = 0; k < inputs.size(); ++k) out.total[k] += command_weight_ * values[k];
    out.each.push_back(std::move(values));
  }
  return out;
}

}  // namespace qlora::train
