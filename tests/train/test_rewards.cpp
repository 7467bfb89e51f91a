// GRPO rewards (train/rewards.h): the answer reward's extraction and comparison rules, the format
// (regex) and length rewards, the weighted sum and per-reward values, and refused specs naming
// their key.
#include "qlora/train/rewards.h"

#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <string>

using namespace qlora::train;
using nlohmann::json;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

RewardSpec answer() { return RewardSpec{}; }
RewardSpec regex(std::string pattern) {
  RewardSpec s;
  s.kind = RewardKind::kRegex;
  s.pattern = std::move(pattern);
  return s;
}
RewardSpec length(int64_t target, int64_t max) {
  RewardSpec s;
  s.kind = RewardKind::kLength;
  s.target = target;
  s.max = max;
  return s;
}

double score(const RewardSpec& spec, const json& record, const std::string& completion, int64_t tokens = 1) {
  const Rewards r({spec});
  return r.score_one(0, {record, completion, tokens, "data.jsonl: line 1"});
}

}  // namespace

TEST(Rewards, ReferenceAnswer) {
  EXPECT_EQ(reference_answer(json("42")), "42");
  EXPECT_EQ(reference_answer(json(42)), "42");
  EXPECT_EQ(reference_answer(json(2.5)), "2.5");
  // GSM8K: the worked solution, then "#### 72".
  EXPECT_EQ(reference_answer(json("Natalia sold 48/2 = 24 clips.\n#### 72")), "72");
  EXPECT_EQ(reference_answer(json(" Paris. ")), "Paris");
  EXPECT_CONTAINS(error_of([] { reference_answer(json::array()); }), "is array, expected a string or a number");
}

TEST(Rewards, FinalAnswerRules) {
  // 1. the last \boxed{}, braces balanced; a cut one does not count.
  EXPECT_EQ(final_answer("so \\boxed{3} or rather \\boxed{\\frac{1}{2}}.", true), "\\frac{1}{2}");
  EXPECT_EQ(final_answer("#### 5\n\\boxed{12", true), "5");
  // 2. after the last ####, to the end of its line.
  EXPECT_EQ(final_answer("step 1 #### 4\nthen #### 18 \nbye", true), "18");
  // 3. after the last "answer:", any case.
  EXPECT_EQ(final_answer("Reasoning 7 apples.\nThe Answer: 12.\nDone in 3 steps", true), "12");
  // 4. a numeric reference: the last number, with sign, thousands commas and decimals.
  EXPECT_EQ(final_answer("We get 3 then -1,234.5 in total.", true), "-1,234.5");
  EXPECT_EQ(final_answer("from 3-5 items", true), "5");
  // 5. otherwise the whole completion, trimmed, without a final period.
  EXPECT_EQ(final_answer("  Paris.\n", false), "Paris");
  EXPECT_EQ(final_answer("no digits here", true), "no digits here");
}

TEST(Rewards, AnswersEqualNumericallyOrExactly) {
  EXPECT_TRUE(answers_equal("72", "72", 1e-6));
  EXPECT_TRUE(answers_equal("72.0", "72", 1e-6));
  EXPECT_TRUE(answers_equal("$1,234", "1234", 1e-6));
  EXPECT_TRUE(answers_equal("50%", "50", 1e-6));
  EXPECT_TRUE(answers_equal("+3", "3", 1e-6));
  EXPECT_TRUE(answers_equal("1e3", "1000", 1e-6));
  // Relative above 1, absolute below.
  EXPECT_TRUE(answers_equal("1000000.5", "1000000", 1e-6));
  EXPECT_FALSE(answers_equal("1000002", "1000000", 1e-6));
  EXPECT_TRUE(answers_equal("0.3333", "0.33333", 1e-3));
  EXPECT_FALSE(answers_equal("0.3333", "0.33333", 1e-6));
  // "1,23" is not a thousands separator: not a number, compared as text.
  EXPECT_FALSE(answers_equal("1,23", "123", 1e-6));
  EXPECT_TRUE(answers_equal("inf", "inf", 0));  // not finite: compared as text
  EXPECT_TRUE(answers_equal("Paris", "Paris.", 0));
  EXPECT_FALSE(answers_equal("paris", "Paris", 0));  // exact: case counts
}

TEST(Rewards, AnswerRewardOnRecords) {
  const json gsm = {{"prompt", "q"}, {"answer", "She has 8 + 4 = 12.\n#### 12"}};
  EXPECT_EQ(score(answer(), gsm, "8 + 4 = 12, so the answer is 12"), 1.0);
  EXPECT_EQ(score(answer(), gsm, "The answer: 13"), 0.0);
  EXPECT_EQ(score(answer(), {{"answer", 12}}, "\\boxed{12}"), 1.0);
  EXPECT_EQ(score(answer(), {{"answer", "Paris"}}, "Paris."), 1.0);
  EXPECT_EQ(score(answer(), {{"answer", "Paris"}}, "It is Paris."), 0.0);
  RewardSpec mapped = answer();
  mapped.field = "solution";
  EXPECT_EQ(score(mapped, {{"solution", "7"}}, "answer: 7"), 1.0);
  // A record without the field, or with another type, names the record and the key.
  const std::string missing = error_of([&] { score(mapped, {{"answer", "7"}}, "7"); });
  EXPECT_CONTAINS(missing, "data.jsonl: line 1: grpo.rewards[0].field = \"solution\"");
  EXPECT_CONTAINS(missing, "no field \"solution\"");
  EXPECT_CONTAINS(error_of([&] { score(answer(), {{"answer", {1, 2}}}, "7"); }), "is array, expected a string or a number");
}

TEST(Rewards, RegexFormatReward) {
  const RewardSpec think = regex(R"(^<think>.*?</think>\s*<answer>.*?</answer>$)");
  EXPECT_EQ(score(think, json::object(), "<think>hm</think> <answer>4</answer>"), 1.0);
  EXPECT_EQ(score(think, json::object(), "<answer>4</answer>"), 0.0);
  // . stops at newlines unless (?s) says otherwise.
  EXPECT_EQ(score(think, json::object(), "<think>a\nb</think><answer>4</answer>"), 0.0);
  EXPECT_EQ(score(regex(R"((?s)^<think>.*</think>)"), json::object(), "<think>a\nb</think>"), 1.0);
  // Found anywhere when not anchored; invalid UTF-8 in a completion is matched as U+FFFD.
  EXPECT_EQ(score(regex("\\d+"), json::object(), "x \xff 12"), 1.0);
  // Catastrophic backtracking stops at PCRE2's match limit, as an error naming the record.
  const std::string e = error_of([] { score(regex("^(a+)+$"), json::object(), std::string(40, 'a') + "b"); });
  EXPECT_CONTAINS(e, "data.jsonl: line 1: grpo.rewards[0].pattern: ");
  EXPECT_CONTAINS(e, "limit");
}

TEST(Rewards, LengthPenalty) {
  const RewardSpec l = length(100, 200);
  EXPECT_EQ(score(l, json::object(), "", 0), 0.0);
  EXPECT_EQ(score(l, json::object(), "", 100), 0.0);
  EXPECT_DOUBLE_EQ(score(l, json::object(), "", 150), -0.5);
  EXPECT_DOUBLE_EQ(score(l, json::object(), "", 101), -0.01);
  EXPECT_EQ(score(l, json::object(), "", 200), -1.0);
  EXPECT_EQ(score(l, json::object(), "", 5000), -1.0);
}

TEST(Rewards, WeightedSumAndPerRewardValues) {
  RewardSpec a = answer();
  a.weight = 2.0;
  RewardSpec f1 = regex("^<answer>"), f2 = regex("</answer>$");
  f2.weight = 0.5;
  RewardSpec l = length(2, 4);
  l.weight = 1.0;
  const Rewards r({a, f1, f2, l});
  EXPECT_EQ(r.names(), (std::vector<std::string>{"answer", "regex_0", "regex_1", "length"}));
  const json rec = {{"prompt", "1+1"}, {"answer", 2}};
  const RewardScores s = r.score({{rec, "<answer>2</answer>", 3, "a"}, {rec, "<answer>3", 8, "b"}, {rec, "2", 1, "c"}});
  ASSERT_EQ(s.each.size(), 4u);
  EXPECT_EQ(s.each[0], (std::vector<double>{1, 0, 1}));
  EXPECT_EQ(s.each[1], (std::vector<double>{1, 1, 0}));
  EXPECT_EQ(s.each[2], (std::vector<double>{1, 0, 0}));
  EXPECT_EQ(s.each[3], (std::vector<double>{-0.5, -1, 0}));
  EXPECT_EQ(s.total, (std::vector<double>{2 + 1 + 0.5 - 0.5, 0 + 1 + 0 - 1, 2 + 0 + 0 + 0}));
  EXPECT_TRUE(Rewards({}).empty());
  EXPECT_FALSE(Rewards({}, "true").empty());
}

TEST(Rewards, RefusedSpecsNameTheirKey) {
  auto refused = [](RewardSpec s, size_t at = 0) {
    std::vector<RewardSpec> specs(at, answer());
    specs.push_back(std::move(s));
    return error_of([&] { validate_rewards(specs); });
  };
  RewardSpec w = answer();
  w.weight = std::nan("");
  EXPECT_CONTAINS(refused(w), "'grpo.rewards[0].weight' must be a finite number");
  RewardSpec f = answer();
  f.field = "";
  EXPECT_CONTAINS(refused(f, 2), "'grpo.rewards[2].field' must be");
  RewardSpec t = answer();
  t.tolerance = -1;
  EXPECT_CONTAINS(refused(t), "'grpo.rewards[0].tolerance' must be >= 0 and finite, got -1");
  EXPECT_CONTAINS(refused(regex(""), 1), "'grpo.rewards[1].pattern' must be a regular expression");
  const std::string bad = refused(regex("(unclosed"), 1);
  EXPECT_CONTAINS(bad, "'grpo.rewards[1].pattern' must be a valid PCRE2 pattern, got \"(unclosed\"");
  EXPECT_CONTAINS(bad, "missing closing parenthesis");
  EXPECT_CONTAINS(refused(length(-1, 5)), "'grpo.rewards[0].target' must be >= 0 (tokens), got -1");
  EXPECT_CONTAINS(refused(length(10, 10)), "'grpo.rewards[0].max' must be above target = 10 (tokens), got 10");
  EXPECT_EQ(reward_keys(RewardKind::kLength), (std::vector<std::string>{"kind", "weight", "target", "max"}));
}
