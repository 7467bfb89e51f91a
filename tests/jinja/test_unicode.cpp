// UTF-8's one home (qlora/jinja/utf8.h, over ICU's macros): what each ill-formed unit reads as;
// and the interpreter's str operations on non-ASCII text, which must be Python's: the expected
// texts are what jinja2 3.1.6 renders on Python 3.11 (transformers' environment), taken from it
// once (tests/conformance/test_jinja_templates.py compares a wider set live).
#include <gtest/gtest.h>

#include <string>

#include "qlora/jinja/template.h"
#include "qlora/jinja/utf8.h"

namespace qlora::jinja {
namespace {

std::string render(const std::string& source, const std::string& context = "{}") {
  return Template::parse(source, "t.jinja").render(nlohmann::ordered_json::parse(context)).text;
}

TEST(Utf8, NextReadsCodePointsAndEachMaximalIllFormedSubpartAsOneUnit) {
  struct Unit {
    const char* bytes;
    std::vector<int32_t> code_points;  // kUtf8Invalid for an ill-formed unit
  };
  const Unit units[] = {
      {"a\xC3\xA9\xE6\x97\xA5\xF0\x9F\x98\x80", {'a', 0xE9, 0x65E5, 0x1F600}},
      {"\xFF" "a", {kUtf8Invalid, 'a'}},
      {"\x80\x80", {kUtf8Invalid, kUtf8Invalid}},           // stray trail bytes: one each
      {"\xE6\x97", {kUtf8Invalid}},                          // truncated: one unit
      {"\xF0\x9F\x98x", {kUtf8Invalid, 'x'}},
      {"\xED\xA0\x80", {kUtf8Invalid, kUtf8Invalid, kUtf8Invalid}},  // a surrogate
      {"\xC0\xAF", {kUtf8Invalid, kUtf8Invalid}},            // overlong
      {"\xF4\x90\x80\x80", {kUtf8Invalid, kUtf8Invalid, kUtf8Invalid, kUtf8Invalid}},  // past U+10FFFF
  };
  for (const Unit& u : units) {
    const std::string s = u.bytes;
    std::vector<int32_t> got;
    for (size_t i = 0; i < s.size();) got.push_back(utf8_next(s, i));
    EXPECT_EQ(got, u.code_points) << s;
    EXPECT_EQ(utf8_length(s), static_cast<int64_t>(u.code_points.size())) << s;
    EXPECT_EQ(static_cast<size_t>(utf8_length(s)), utf8_chars(s).size()) << s;
  }
  const std::string s = "x\xC3\xA9\x80";
  size_t i = s.size();
  EXPECT_EQ(utf8_prev(s, 0, i), kUtf8Invalid);
  EXPECT_EQ(utf8_prev(s, 0, i), 0xE9);
  EXPECT_EQ(i, 1u);
  EXPECT_EQ(utf8_chars("a\xFF\xC3\xA9"), (std::vector<std::string>{"a", "\xFF", "\xC3\xA9"}));
}

TEST(Utf8, AppendWritesScalarValuesAndFffdForWhatUtf8CannotCarry) {
  std::string out;
  for (uint32_t cp : {0x41u, 0xE9u, 0x65E5u, 0x1F600u}) utf8_append(out, cp);
  EXPECT_EQ(out, "A\xC3\xA9\xE6\x97\xA5\xF0\x9F\x98\x80");
  out.clear();
  utf8_append(out, 0xD800);
  utf8_append(out, 0x110000);
  EXPECT_EQ(out, "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_TRUE(utf8_valid("caf\xC3\xA9"));
  EXPECT_FALSE(utf8_valid("caf\xC3"));
  EXPECT_EQ(utf8_replace_invalid("a\xFF" "b\xE6\x97"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
}

struct Case {
  const char* source;
  const char* expected;
};

const Case kCases[] = {
    {"{{ 'straße'|upper }}", "STRASSE"},
    {"{{ 'ΣΑΣ'|lower }}|{{ 'ΌΣΟΣ ΣΊΣΥΦΟΣ'.lower() }}|{{ 'ΑΣ.'|lower }}|{{ 'Σ'|lower }}", "σας|όσος σίσυφος|ας.|σ"},
    {"{{ 'ǆungla'|title }}|{{ 'ǆungla'.title() }}|{{ 'ǆungla'|capitalize }}|{{ 'ǆungla'.capitalize() }}",
     "Ǆungla|ǅungla|ǅungla|ǅungla"},
    {"{{ 'İstanbul'|lower }}|{{ 'ıi'|upper }}", "i\xCC\x87stanbul|II"},
    {"{{ 'привет мир'|title }}|{{ 'ПРИВЕТ'|lower }}", "Привет Мир|привет"},
    {"{{ 'ΑΣ ΣΑ'|title }}|{{ 'ΑΣ ΣΑ'.title() }}", "Ασ Σα|Ας Σα"},
    {"{{ 'ﬁnal-ﬂow'|title }}|{{ 'ﬁnal'.upper() }}|{{ 'ŉ'.upper() }}", "FInal-FLow|FINAL|ʼN"},
    {"{{ 'e\xCC\x81te\xCC\x81'|upper }}|{{ 'e\xCC\x81te\xCC\x81'.title() }}", "E\xCC\x81TE\xCC\x81|E\xCC\x81Te\xCC\x81"},
    {"{{ '日本語'|upper }}|{{ '日本語'.isupper() }}{{ '日本語'.islower() }}{{ '日本語'.isalpha() }}|{{ '日本語' is upper }}",
     "日本語|FalseFalseTrue|False"},
    {"{{ 'ÄB'.isupper() }}{{ 'äb'.islower() }}{{ 'ǅ'.isupper() }}{{ 'ǅ'.islower() }}{{ 'Ä1'.isupper() }}",
     "TrueTrueFalseFalseTrue"},
    {"{{ '١٢٣'.isdigit() }}{{ '²'.isdigit() }}{{ '½'.isdigit() }}{{ '½'.isalnum() }}{{ '一'.isalnum() }}{{ 'é'.isalpha() }}"
     "{{ 'e\xCC\x81'.isalpha() }}",
     "TrueTrueFalseTrueTrueTrueFalse"},
    {"{{ '\u2003\u00a0\u3000'.isspace() }}{{ '\u200b'.isspace() }}{{ '\x1f'.isspace() }}|{{ '\u3000x\u2003'|trim }}",
     "TrueFalseTrue|x"},
    {"{{ 'ÉCOLE' is upper }}{{ 'école' is lower }}{{ 'ΣΑΣ' is upper }}", "TrueTrueTrue"},
    {"{{ ['é\u200b', '\u2028', '\u00a0'] }}", "['é\\u200b', '\\u2028', '\\xa0']"},
    {"{{ 'ß'.title() }}|{{ 'ß'|capitalize }}|{{ 'ﬃ'.title() }}", "Ss|Ss|Ffi"},
};

class UnicodeCase : public ::testing::TestWithParam<Case> {};

TEST_P(UnicodeCase, RendersAsPythonStr) { EXPECT_EQ(render(GetParam().source), GetParam().expected) << GetParam().source; }

INSTANTIATE_TEST_SUITE_P(Jinja2, UnicodeCase, ::testing::ValuesIn(kCases));

TEST(Unicode, CaseMappingIgnoresTheProcessLocale) {
  // Python's str has no locale: a Turkish default locale must not make 'i' upper to 'İ'.
  setenv("LANG", "tr_TR.UTF-8", 1);
  setenv("LC_ALL", "tr_TR.UTF-8", 1);
  EXPECT_EQ(render("{{ 'istanbul'|upper }}|{{ 'I'.lower() }}"), "ISTANBUL|i");
  unsetenv("LC_ALL");
  unsetenv("LANG");
}

// No Python str holds ill-formed UTF-8; in ours each ill-formed unit is one character of no case
// or class, whose bytes pass through untouched (tojson's ASCII form writes it as U+FFFD).
TEST(Unicode, IllFormedUtf8InTheContextPassesThroughAsOneCharacterPerUnit) {
  nlohmann::ordered_json ctx = {{"s", std::string("a\xFF" "b\xE6\x97")}};
  auto t = Template::parse(
      "{{ s|upper }}|{{ s|length }}|{{ s[1] == s[1:2] }}|{{ s.isalpha() }}|{{ s|tojson }}|{{ s|tojson(true) }}",
      "t.jinja");
  EXPECT_EQ(t.render(ctx).text, "A\xFF" "B\xE6\x97|4|True|False|\"a\xFF" "b\xE6\x97\"|\"a\\ufffdb\\ufffd\"");
}

TEST(Unicode, EscapesUtf8CannotCarryAreSyntaxErrors) {
  for (const char* source : {"{{ '\\ud800' }}", "{{ '\\U00110000' }}"}) {
    try {
      render(source);
      ADD_FAILURE() << "no error for " << source;
    } catch (const TemplateError& e) {
      EXPECT_NE(std::string(e.what()).find("t.jinja:1:4: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("surrogate"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace qlora::jinja
