// GRPO rewards (grpo.rewards, grpo.reward_command): each completion's reward is the weighted sum of
// the built-in rewards below and, when set, the user's reward command (train/reward_command.h).
//   answer  1 when the completion's final answer equals the record's, else 0.
//           The record's answer: its `field` ("answer"), a string or a number; a string holding
//           "####" (GSM8K's solutions) is the text after the last "####".
//           The completion's final answer, the first rule that finds one:
//             1. the content of the last \boxed{...} (braces balanced);
//             2. the text after the last "####", to the end of its line;
//             3. the text after the last "answer:" (any case), to the end of its line;
//             4. when the record's answer is a number: the last number in the completion;
//             5. else the whole completion.
//           Both are trimmed of whitespace, and of a trailing period. When both read as numbers
//           (a sign, digits with optional "," thousands separators, a decimal part, an exponent;
//           a leading "$" and a trailing "%" are ignored) they are equal when
//           |x − y| <= tolerance · max(1, |y|) (y the record's; tolerance 1e-6); otherwise the
//           strings must be equal exactly.
//   regex   1 when `pattern` matches somewhere in the completion (PCRE2, as data::TextRegex:
//           anchor with ^ and $, (?s) lets . match newlines), else 0: format rewards. PCRE2
//           backtracks, so its match limit bounds the work on any completion; a pattern that
//           exceeds it is an error naming the key rather than a silent 0.
//   length  0 up to `target` completion tokens, then falling linearly to −1 at `max` tokens and
//           −1 beyond (DAPO's soft overlong punishment, with target = L_max − L_cache, max = L_max).
// Keys are refused with their path named: grpo.rewards[1].pattern (index from 0).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/io/enum_names.h"

namespace qlora::data {
class TextRegex;
}

namespace qlora::train {

enum class RewardKind { kAnswer, kRegex, kLength };
inline constexpr io::EnumName<RewardKind> kRewardKindNames[] = {
    {RewardKind::kAnswer, "answer"}, {RewardKind::kRegex, "regex"}, {RewardKind::kLength, "length"}};

// One entry of grpo.rewards. Only the keys of its kind are read (and accepted in a config).
struct RewardSpec {
  RewardKind kind = RewardKind::kAnswer;
  double weight = 1.0;
  std::string field = "answer";  // answer: the record's field holding the reference answer
  double tolerance = 1e-6;       // answer: numeric comparison, relative above 1
  std::string pattern;           // regex
  int64_t target = 0;            // length: tokens without penalty
  int64_t max = 0;               // length: −1 from here on (> target)
};

// The TOML keys a kind takes, "kind" and "weight" first.
std::vector<std::string> reward_keys(RewardKind kind);

// std::invalid_argument "'grpo.rewards[i].<key>' must be <rule>, got <value>" for the first bad
// value (the pattern compiled to check it).
void validate_rewards(const std::vector<RewardSpec>& specs);

// The answer reward's two halves, for tests and previews.
std::string reference_answer(const nlohmann::json& value);       // throws std::invalid_argument on other types
std::string final_answer(std::string_view completion, bool numeric_reference);
bool answers_equal(const std::string& completion_answer, const std::string& reference, double tolerance);

// What a reward sees of one completion.
struct RewardInput {
  const nlohmann::json& record;  // the prompt record, every field ("prompt" holds the prompt as read)
  std::string_view completion;   // the decoded completion
  int64_t completion_tokens = 0;
  std::string_view origin;       // "<file>: line N", for errors
};

struct RewardScores {
  std::vector<std::string> names;          // one per reward: its kind, "_<i>" added where a kind repeats; "command"
  std::vector<std::vector<double>> each;   // [reward][completion], unweighted
  std::vector<double> total;               // [completion]: Σ weight · value
};

// The configured rewards, compiled once.
class Rewards {
 public:
  // `specs` validated; `command` empty: none (its weight and timeout then unused).
  Rewards(std::vector<RewardSpec> specs, std::string command = "", double command_weight = 1.0,
          double command_timeout_s = 60.0);
  ~Rewards();
  Rewards(Rewards&&) noexcept;
  Rewards& operator=(Rewards&&) noexcept;

  bool empty() const { return specs_.empty() && command_.empty(); }
  std::vector<std::string> names() const;

  // Every reward on every completion. Throws std::runtime_error naming the reward (and for the
  // command the command and the line) when one cannot be computed.
  RewardScores score(const std::vector<RewardInput>& inputs) const;

  // Throws std::invalid_argument naming `origin` and the key when the record lacks what a reward
  // reads (an answer reward's field, or one that is not a string or a number): checked on every
  // prompt before training, so a bad record is refused before anything is trained.
  void check_record(const nlohmann::json& record, std::string_view origin) const;

  // One built-in reward on one completion (specs index).
  double score_one(size_t index, const RewardInput& input) const;

 private:
  std::vector<RewardSpec> specs_;
  std::vector<std::unique_ptr<data::TextRegex>> regexes_;  // per spec; null where not regex
  std::string command_;
  double command_weight_ = 1.0, command_timeout_s_ = 60.0;
};

}  // namespace qlora::train
