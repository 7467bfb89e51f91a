// Rendering runs under a budget (qlora/jinja/budget.h): the runaway templates of issue 36 end at
// once in an error naming the template's origin and line, and every real chat template of
// tests/data renders far inside the default budget.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "qlora/jinja/template.h"

namespace qlora::jinja {
namespace {

using ojson = nlohmann::ordered_json;

// A conversation as data.template = "auto" renders one: system, turns, a tool call, tools.
ojson conversation(int turns, size_t content_bytes) {
  ojson messages = ojson::array();
  messages.push_back({{"role", "system"}, {"content", "You are a helpful assistant."}});
  for (int k = 0; k < turns; ++k) {
    messages.push_back({{"role", "user"}, {"content", "Question " + std::to_string(k) + " " + std::string(content_bytes, 'q')}});
    messages.push_back({{"role", "assistant"}, {"content", "Answer " + std::to_string(k) + " " + std::string(content_bytes, 'a')}});
  }
  messages.push_back({{"role", "user"}, {"content", "Weather in Paris?"}});
  const ojson tools = ojson::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "description": "Weather in a city.", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])");
  return {{"messages", messages}, {"tools", tools}, {"add_generation_prompt", true}, {"bos_token", "<s>"},
          {"eos_token", "</s>"}, {"documents", nullptr}};
}

std::string read(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// What the real templates use: printed (the numbers budget.h's comment quotes) and held to a
// hundredth of the default budget for a 100-turn conversation (a template that refuses the
// conversation, e.g. for its tools, is skipped).
TEST(Budget, RealTemplatesRenderFarInsideTheDefaultBudget) {
  const char* data = std::getenv("QLORA_TEST_DATA");
  ASSERT_NE(data, nullptr) << "QLORA_TEST_DATA is not set (ctest sets it)";
  const RenderBudget budget;
  int rendered = 0;
  for (int turns : {3, 100}) {
    int64_t max_steps = 0, max_bytes = 0, max_text = 0;
    std::string largest;
    for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(data) / "chat_templates")) {
      if (entry.path().extension() != ".jinja") continue;
      const Template t = Template::parse(read(entry.path()), entry.path().filename().string());
      RenderOptions o;
      o.now_unix_seconds = 0;
      try {
        const Rendered r = t.render(conversation(turns, 200), o);
        ++rendered;
        if (r.steps_used > max_steps) largest = entry.path().filename().string();
        max_steps = std::max(max_steps, r.steps_used);
        max_bytes = std::max(max_bytes, r.bytes_used);
        max_text = std::max(max_text, static_cast<int64_t>(r.text.size()));
      } catch (const TemplateError&) {  // a template that refuses this conversation (its roles)
      }
    }
    std::printf("%d turns: at most %lld steps (%s), %lld bytes of strings, %lld bytes of text\n", turns,
                static_cast<long long>(max_steps), largest.c_str(), static_cast<long long>(max_bytes),
                static_cast<long long>(max_text));
    if (turns == 100) {
      EXPECT_LT(max_steps * 100, budget.max_steps);
      EXPECT_LT(max_bytes * 100, budget.max_bytes);
      EXPECT_LT(max_text * 100, budget.max_string_bytes);
      EXPECT_GT(max_steps, 1000);  // the measurement measured something
    }
  }
  EXPECT_GE(rendered, 30);
}

// Renders `source` and expects a TemplateError at `location` that names the budget it ran past;
// returns the seconds it took.
double expect_over_budget(const std::string& source, const std::string& location, const std::string& what,
                          const RenderBudget& budget = {}) {
  const auto start = std::chrono::steady_clock::now();
  try {
    RenderOptions o;
    o.budget = budget;
    Template::parse(source, "tokenizer_config.json (chat_template)").render(ojson::object(), o);
    ADD_FAILURE() << "no error for " << source;
  } catch (const TemplateError& e) {
    const std::string text = e.what();
    EXPECT_EQ(text.rfind("tokenizer_config.json (chat_template):" + location, 0), 0u) << text;
    EXPECT_NE(text.find(what), std::string::npos) << text;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(Budget, HugeStringsAreRefusedBeforeTheyAreAllocated) {
  // Was 52 s and 6.2 GB, then std::bad_alloc.
  EXPECT_LT(expect_over_budget("\n{{ 'a' * 2000000000 }}", "2:", "budget of 32 MiB for one string"), 1.0);
  const char* const refused[] = {
      "{{ 2000000000 * 'ab' }}",
      "{{ 'ab' * 9223372036854775807 }}",  // n * len overflows
      "{% set s = 'a' * 40000000 %}{{ s ~ s }}",
      "{% set s = 'a' * 40000000 %}{{ s + s }}",
      "{{ range(99999)|map('string')|join('y' * 1000) }}",
      "{{ ('a' * 20000000).replace('', 'bb') }}",
      "{{ 'x'|indent(2000000000, first=true) }}",
      "{{ [[[1]]]|tojson(indent=2000000000) }}",
      "{{ '{0}{0}{0}{0}'.format('a' * 30000000) }}",
      "{% for i in range(100) %}{{ 'a' * 1000000 }}{% endfor %}",
  };
  for (const char* source : refused) expect_over_budget(source, "1:", "for one string");
  expect_over_budget("{{ ['x' * 1000000] * 100000 }}", "1:", "of strings built and copied");
}

TEST(Budget, RunawayLoopsAndRecursionStop) {
  // Two nested range(99999) loops ran for over a minute.
  EXPECT_LT(expect_over_budget("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "1:",
                               "budget of 2000000 steps"),
            30.0);
  const RenderBudget small{100000, int64_t{1} << 30, int64_t{64} << 20};
  expect_over_budget("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "1:",
                     "budget of 100000 steps", small);
  expect_over_budget("{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}", "1:", "macro recursion deeper than 200");
  expect_over_budget("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}", "1:",
                     "steps", small);
  expect_over_budget("{% set l = range(99999)|list %}{% for i in l %}{{ l|unique|list|length }}{% endfor %}", "1:",
                     "steps", small);
  expect_over_budget("{% set l = range(99999)|list %}{% for i in l %}{% if l == l %}{% endif %}{% endfor %}", "1:",
                     "steps", small);
  expect_over_budget("{% set s = 'a' * 10000000 %}{% for i in range(99999) %}{{ s|length }}{% endfor %}", "1:",
                     "of strings built and copied");
  expect_over_budget("{{ range(1000000) }}", "1:", "MAX_RANGE");
  EXPECT_LT(expect_over_budget("{{ 2 ** 9999999999 }}", "1:", "integer overflow"), 1.0);
}

TEST(Budget, DeepNestingIsASyntaxErrorNotAStackOverflow) {
  const std::pair<const char*, const char*> nests[] = {{"(", ")"}, {"[", "]"}, {"not ", ""}, {"-", ""}};
  for (const auto& [open, close] : nests) {
    std::string source = "{{ ", tail;
    for (int k = 0; k < 3000; ++k) source += open, tail += close;
    try {
      Template::parse(source + "1" + tail + " }}", "t.jinja");
      ADD_FAILURE() << "no error for " << open;
    } catch (const TemplateError& e) {
      EXPECT_NE(std::string(e.what()).find("nests deeper than 100 levels"), std::string::npos) << e.what();
    }
  }
}

TEST(Budget, ABudgetLeftUnusedChangesNothing) {
  const RenderBudget tight{200, 4096, 64};
  RenderOptions o;
  o.budget = tight;
  const Rendered r = Template::parse("{% for x in xs %}{{ x|upper }}{% endfor %}", "t.jinja")
                         .render(ojson::parse(R"({"xs": ["a", "b"]})"), o);
  EXPECT_EQ(r.text, "AB");
  EXPECT_GT(r.steps_used, 0);
  EXPECT_LE(r.steps_used, 200);
}

}  // namespace
}  // namespace qlora::jinja
