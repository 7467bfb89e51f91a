// The Jinja interpreter: each construct of the chat-template subset, whitespace control,
// errors with line and column, raise_exception, strftime_now on a fixed clock, generation spans.
// The expected texts of the table are what jinja2 renders in transformers' environment
// (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks), taken from it once.
#include <gtest/gtest.h>

#include <string>

#include "qlora/jinja/template.h"

namespace qlora::jinja {
namespace {

constexpr int64_t kNow = 1721995200;  // 2024-07-26 12:00:00 UTC

std::string render(const std::string& source, const std::string& context = "{}") {
  RenderOptions options;
  options.now_unix_seconds = kNow;
  return Template::parse(source, "t.jinja").render(nlohmann::ordered_json::parse(context), options).text;
}

struct Case {
  const char* name;
  const char* source;
  const char* context;
  const char* expected;
};

// Generated from jinja2 3.1.6 as transformers 5.23 configures it (the strftime_now case with the
// clock above in the local time zone of the generating machine, UTC).
const Case kCases[] = {
    {"text_only", "hello", R"json({})json", "hello"},
    {"print_values", "{{ 1 }}|{{ 1.5 }}|{{ 1/2 }}|{{ 7//2 }}|{{ -7//2 }}|{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 2**10 }}|{{ 1 + 2.0 }}|{{ True }}|{{ none }}|{{ 1e20 }}|{{ 0.1 + 0.2 }}", R"json({})json", "1|1.5|0.5|3|-4|1|2|1024|3.0|True|None|1e+20|0.30000000000000004"},
    {"print_containers", "{{ ['a', 1, none, true, 2.5] }}|{{ {'k': 'v', 'n': [1, 2]} }}|{{ (1,) }}|{{ ('a', \"it's\") }}", R"json({})json", "['a', 1, None, True, 2.5]|{'k': 'v', 'n': [1, 2]}|(1,)|('a', \"it's\")"},
    {"string_ops", "{{ 'ab' ~ 1 ~ none }}|{{ 'ab' * 2 }}|{{ 'abc'[1] }}|{{ 'abc'[-1] }}|{{ 'hello'[1:3] }}|{{ 'hello'[::-1] }}|{{ 'h\xc3""\xa9""llo'[1:] }}", R"json({})json", "ab1None|abab|b|c|el|olleh|\xc3""\xa9""llo"},
    {"list_slices", "{{ xs[1:] }}|{{ xs[:-1] }}|{{ xs[::2] }}|{{ xs[::-1] }}|{{ xs[-2:] }}|{{ xs[5:] }}", R"json({"xs": [1, 2, 3, 4]})json", "[2, 3, 4]|[1, 2, 3]|[1, 3]|[4, 3, 2, 1]|[3, 4]|[]"},
    {"escapes", "{{ 'a\\nb\\tc\\\\d\\'e\\u00e9\\x41' }}", R"json({})json", "a\nb\tc\\d'e\xc3""\xa9""A"},
    {"compare_logic", "{{ 1 < 2 < 3 }}|{{ 1 == 1.0 }}|{{ 'a' in 'cat' }}|{{ 2 not in [1, 3] }}|{{ not 0 }}|{{ 0 or 'x' }}|{{ 'y' and 0 }}|{{ [] or 'empty' }}", R"json({})json", "True|True|True|True|True|x|0|empty"},
    {"condexpr", "{{ 'yes' if flag else 'no' }}|{{ 'only' if not flag }}|", R"json({"flag": true})json", "yes||"},
    {"if_elif_else", "{% for n in [1, 2, 3] %}{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %}{% endfor %}", R"json({})json", "onetwomany"},
    {"for_loop_vars", "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('o', 'e') }};{% endfor %}", R"json({"xs": ["a", "b", "c"]})json", "1032TrueFalse3bo;2121FalseFalse3ace;3210FalseTrue3bo;"},
    {"for_else_filter", "{% for x in xs if x > 1 %}{{ x }}{% else %}none{% endfor %}|{% for x in [] %}{{ x }}{% else %}empty{% endfor %}", R"json({"xs": [1, 2, 3]})json", "23|empty"},
    {"for_unpack_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d|items %}{{ k }}{% endfor %}{% for k in d %}{{ k }}{% endfor %}", R"json({"d": {"b": 1, "a": 2}})json", "b=1;a=2;baba"},
    {"break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", R"json({})json", "0134"},
    {"scoping", "{% set y = 1 %}{% for x in [1, 2] %}{{ y }}{% set y = 5 %}{{ y }}{% endfor %}{{ y }}", R"json({})json", "15151"},
    {"namespace", "{% set ns = namespace(count=0, found=false) %}{% for x in [1, 2, 3] %}{% set ns.count = ns.count + x %}{% endfor %}{{ ns.count }}{{ ns.found }}", R"json({})json", "6False"},
    {"block_set", "{% set body %}Hi {{ name }}!{% endset %}[{{ body }}]", R"json({"name": "Bo"})json", "[Hi Bo!]"},
    {"set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}", R"json({})json", "12"},
    {"macro_call", "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% if caller %}({{ caller() }}){% endif %}{% endmacro %}{{ greet('A') }}|{{ greet('B', punct='?') }}|{% call greet('C') %}inner{% endcall %}", R"json({})json", "Hello A!|Hello B?|Hello C!(inner)"},
    {"filter_block", "{% filter upper %}shout {{ 'it' }}{% endfilter %}", R"json({})json", "SHOUT IT"},
    {"raw", "{% raw %}{{ not evaluated }}{% endraw %}", R"json({})json", "{{ not evaluated }}"},
    {"tests", "{{ x is defined }}{{ y is undefined }}{{ none is none }}{{ 's' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 's' is sequence }}{{ 1.5 is number }}{{ 1 is integer }}{{ 1.0 is integer }}{{ true is boolean }}{{ true is true }}{{ false is false }}{{ 2 is even }}{{ 3 is odd }}{{ 9 is divisibleby 3 }}{{ 'a' is equalto 'a' }}{{ 'a' is eq 'b' }}{{ 2 is in [1, 2] }}{{ x is not none }}", R"json({"x": 1})json", "TrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueFalseTrueTrue"},
    {"filters_text", "{{ '  pad  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'Hi'|upper }}{{ 'Hi'|lower }}|{{ 'hELLO wORLD'|capitalize }}|{{ 'hello big-world'|title }}|{{ 'aaa'|replace('a', 'b', 2) }}|{{ 'one two  three'|wordcount }}|{{ 'x'|string }}", R"json({})json", "pad|hi|HIhi|Hello world|Hello Big-World|bba|3|x"},
    {"filters_numbers", "{{ '42'|int }}|{{ '3.7'|int }}|{{ 'x'|int(5) }}|{{ 3.9|int }}|{{ '2.5'|float }}|{{ -3|abs }}|{{ 2.5|round }}|{{ 3.14159|round(2) }}|{{ 2.1|round(0, 'ceil') }}|{{ 7|round }}", R"json({})json", "42|3|5|3|2.5|3|2.0|3.14|3.0|7"},
    {"filters_lists", "{{ xs|length }}|{{ xs|count }}|{{ xs|join(', ') }}|{{ xs|first }}|{{ xs|last }}|{{ xs|reverse|list }}|{{ xs|sort }}|{{ xs|sort(reverse=true) }}|{{ ['b', 'A', 'a']|unique|list }}|{{ xs|min }}{{ xs|max }}{{ xs|sum }}", R"json({"xs": [3, 1, 2]})json", "3|3|3, 1, 2|3|2|[2, 1, 3]|[1, 2, 3]|[3, 2, 1]|['b', 'A']|136"},
    {"filters_on_none", "{{ xs|selectattr('type', 'equalto', 'c')|list }}|{{ xs|reject|list|length }}|{{ xs|map(attribute='a')|list }}|{{ xs|select|list }}", R"json({"xs": null})json", "[]|0|[]|[]"},
    {"filters_attr", "{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(',') }}|{{ ms|rejectattr('role', 'eq', 'user')|list|length }}|{{ ms|map(attribute='missing', default='-')|join }}|{{ ms|selectattr('flag')|list|length }}|{{ ms|sort(attribute='content')|map(attribute='content')|list }}", R"json({"ms": [{"role": "user", "content": "b", "flag": true}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "c"}]})json", "b,c|1|---|1|['a', 'b', 'c']"},
    {"filters_dict", "{{ d|dictsort }}|{{ d|items|list }}|{{ d|length }}", R"json({"d": {"b": 1, "a": 2}})json", "[('a', 2), ('b', 1)]|[('b', 1), ('a', 2)]|2"},
    {"default", "{{ missing|default('dflt') }}|{{ missing|d('d2') }}|{{ ''|default('empty', true) }}|{{ 0|default(5) }}", R"json({})json", "dflt|d2|empty|0"},
    {"tojson", "{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ '\xc3""\xa9""\"\\n'|tojson }}|{{ [1.0, none, true]|tojson }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|{{ {}|tojson(indent=2) }}", R"json({"d": {"name": "f", "args": {"x": [1, 2], "y": "z"}}})json", "{\"name\": \"f\", \"args\": {\"x\": [1, 2], \"y\": \"z\"}}|{\n  \"name\": \"f\",\n  \"args\": {\n    \"x\": [\n      1,\n      2\n    ],\n    \"y\": \"z\"\n  }\n}|\"\xc3""\xa9""\\\"\\n\"|[1.0, null, true]|{\"a\": 2, \"b\": 1}|{}"},
    {"indent", "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, first=true) }}|{{ 'a\\n\\nb'|indent(2, blank=true) }}", R"json({})json", "a\n  b\n\n  c|  a\n  b|a\n  \n  b"},
    {"string_methods", "{{ 'Hello'.startswith('He') }}{{ 'Hello'.endswith(('x', 'lo')) }}|{{ '  s  '.strip() }}|{{ 'xxsxx'.lstrip('x') }}|{{ 'xxsxx'.rstrip('x') }}|{{ 'a,b,c'.split(',') }}|{{ 'a b  c'.split() }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ 'aXa'.replace('a', 'b') }}|{{ 'ab'.upper() }}{{ 'AB'.lower() }}|{{ 'hello world'.title() }}|{{ 'hello'.capitalize() }}|{{ 'hello'.find('l') }}{{ 'hello'.count('l') }}|{{ '{} and {x}'.format(1, x=2) }}", R"json({})json", "TrueTrue|s|sxx|xxs|['a', 'b', 'c']|['a', 'b', 'c']|['a', 'b,c']|['a,b', 'c']|bXb|ABab|Hello World|Hello|22|1 and 2"},
    {"dict_methods", "{{ d.keys()|list }}{{ d.values()|list }}{{ d.get('a') }}{{ d.get('zz') }}{{ d.get('zz', 7) }}|{{ d.a }}{{ d['b'] }}|[{{ d.missing }}]", R"json({"d": {"a": 1, "b": 2}})json", "['a', 'b'][1, 2]1None7|12|[]"},
    {"undefined", "[{{ nope }}][{{ nope|length }}][{{ nope ~ 'x' }}][{{ 'yes' if nope else 'no' }}][{% for x in nope %}{{ x }}{% endfor %}][{{ d.x is defined }}]", R"json({"d": {}})json", "[][0][x][no][][False]"},
    {"whitespace_control", "a  {{- ' b ' -}}  c\n  {%- if true -%}\n  d  \n{%- endif %}\ne {#- comment -#} f", R"json({})json", "a b cdef"},
    {"trim_lstrip_blocks", "<ul>\n    {% for x in xs %}\n    <li>{{ x }}</li>\n    {% endfor %}\n</ul>\n", R"json({"xs": [1, 2]})json", "<ul>\n    <li>1</li>\n    <li>2</li>\n</ul>"},
    {"lstrip_plus_minus", "a\n    {%+ if true %}b{% endif +%}\nc\n  {# note #}\nd\n", R"json({})json", "a\n    b\nc\nd"},
    {"strftime_now", "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d') }}", R"json({})json", "26 Jul 2024|2024-07-26"},
    {"generation", "<s>{% for m in ms %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}", R"json({"ms": [{"role": "user", "content": "é"}, {"role": "assistant", "content": "ab"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "dé"}]})json", "<s>\xc3""\xa9""|ab|c|d\xc3""\xa9""|"},
};

class JinjaCase : public ::testing::TestWithParam<Case> {};

TEST_P(JinjaCase, RendersAsJinja2) {
  const Case& c = GetParam();
  if (std::string(c.name) == "strftime_now") setenv("TZ", "UTC", 1), tzset();
  EXPECT_EQ(render(c.source, c.context), c.expected) << c.source;
}

INSTANTIATE_TEST_SUITE_P(Constructs, JinjaCase, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// jinja2's Markup (|safe, |escape): printed as its text, but + and its methods escape plain
// strings, and each filter keeps or drops the mark as markupsafe's methods do. Expected texts from
// jinja2 3.1.6 / markupsafe 3.0.4 in transformers 5.23's environment, with this python:
//   from transformers.utils.chat_template_utils import _compile_jinja_template
//   _compile_jinja_template(source).render(s="<x & 'y'>", d={"k": "<v>"})
constexpr const char* kMarkupContext = R"json({"s": "<x & 'y'>", "d": {"k": "<v>"}})json";
const Case kMarkupCases[] = {
    {"markup_prints_as_text", "{{ s|safe }}|{{ s|safe ~ s }}|{{ (s|safe)|length }}|{{ (s|safe) == s }}|{{ 'x' in (s|safe) }}|{{ (s|safe) is string }}", kMarkupContext,
     "<x & 'y'>|<x & 'y'><x & 'y'>|9|True|True|True"},
    {"markup_plus_escapes_plain", "{{ (s|safe) + s }}|{{ s + (s|safe) }}|{{ (s|safe) + (s|safe) }}|{{ ((s|safe) ~ s) + s }}|{{ (5|safe) + '&' }}|{{ (none|safe) + '<' }}", kMarkupContext,
     "<x & 'y'>&lt;x &amp; &#39;y&#39;&gt;|&lt;x &amp; &#39;y&#39;&gt;<x & 'y'>|<x & 'y'><x & 'y'>|<x & 'y'><x & 'y'><x & 'y'>|5&amp;|None&lt;"},
    {"markup_tojson_safe", "{% set m = d|tojson|safe %}{{ m }}|{{ m + '<' }}|{{ (s|safe)|tojson + s }}|{{ [s|safe]|tojson }}", kMarkupContext,
     "{\"k\": \"<v>\"}|{\"k\": \"<v>\"}&lt;|\"<x & 'y'>\"<x & 'y'>|[\"<x & 'y'>\"]"},
    {"markup_repr", "{{ [s|safe, 'a'|e] }}|{{ {'k': s|safe} }}|{{ (s|safe).split('x') }}", kMarkupContext,
     "[Markup(\"<x & 'y'>\"), Markup('a')]|{'k': Markup(\"<x & 'y'>\")}|[Markup('<'), Markup(\" & 'y'>\")]"},
    {"escape_filter", "{{ s|e }}|{{ s|escape|e }}|{{ (s|e) + s }}|{{ (s|e) ~ s }}|{{ none|e }}|{{ d|e }}|{{ missing|e }}|{{ (s|safe)|e + s }}", kMarkupContext,
     "&lt;x &amp; &#39;y&#39;&gt;|&lt;x &amp; &#39;y&#39;&gt;|&lt;x &amp; &#39;y&#39;&gt;&lt;x &amp; &#39;y&#39;&gt;|&lt;x &amp; &#39;y&#39;&gt;<x & 'y'>|None|{&#39;k&#39;: &#39;&lt;v&gt;&#39;}||<x & 'y'>&lt;x &amp; &#39;y&#39;&gt;"},
    {"markup_filters_keep", "{{ (s|safe)|string + s }}|{{ (s|safe)|upper + s }}|{{ (s|safe)|trim('<') + s }}|{{ (s|safe)|capitalize + s }}|{{ (s|safe)|reverse + s }}|{{ (s|safe)|indent(2, true) + s }}|{{ (s|safe)|default('z') + s }}|{{ (s|safe)|last + s }}", kMarkupContext,
     "<x & 'y'>&lt;x &amp; &#39;y&#39;&gt;|<X & 'Y'>&lt;x &amp; &#39;y&#39;&gt;|x & 'y'>&lt;x &amp; &#39;y&#39;&gt;|<x & 'y'>&lt;x &amp; &#39;y&#39;&gt;|>'y' & x<&lt;x &amp; &#39;y&#39;&gt;|  <x & 'y'>&lt;x &amp; &#39;y&#39;&gt;|<x & 'y'>&lt;x &amp; &#39;y&#39;&gt;|>&lt;x &amp; &#39;y&#39;&gt;"},
    {"markup_filters_drop", "{{ (s|safe)|title + s }}|{{ (s|safe)|replace('x', '<') + s }}|{{ [s|safe, s]|join(s|safe) + s }}|{{ (s|safe)|first + s }}|{{ (s|safe)|list|first + s }}", kMarkupContext,
     "<X & 'y'><x & 'y'>|<< & 'y'><x & 'y'>|<x & 'y'><x & 'y'><x & 'y'><x & 'y'>|<<x & 'y'>|<<x & 'y'>"},
    {"markup_index_slice_repeat", "{{ (s|safe)[0] + s }}|{{ (s|safe)[1:3] + s }}|{{ (s|safe) * 2 + '&' }}|{{ 2 * ('a'|safe) + '&' }}|{% for c in 'a<'|safe %}{{ c + '&' }}{% endfor %}", kMarkupContext,
     "<&lt;x &amp; &#39;y&#39;&gt;|x &lt;x &amp; &#39;y&#39;&gt;|<x & 'y'><x & 'y'>&amp;|aa&amp;|a&<&"},
    {"markup_methods", "{{ (s|safe).upper() + s }}|{{ (s|safe).strip('<') + s }}|{{ (s|safe).replace('x', '<') + s }}|{{ (s|safe).split()[0] + s }}|{{ (','|safe).join([s, 1, s|safe]) }}|{{ ('{}-{k}'|safe).format(s, k=s|safe) }}|{{ (s|safe).startswith('<') }}{{ (s|safe).find('x') }}", kMarkupContext,
     "<X & 'Y'>&lt;x &amp; &#39;y&#39;&gt;|x & 'y'>&lt;x &amp; &#39;y&#39;&gt;|<&lt; & 'y'>&lt;x &amp; &#39;y&#39;&gt;|<x&lt;x &amp; &#39;y&#39;&gt;|&lt;x &amp; &#39;y&#39;&gt;,1,<x & 'y'>|&lt;x &amp; &#39;y&#39;&gt;-<x & 'y'>|True1"},
    {"markup_set_block_macro", "{% set x %}{{ s|safe }}{% endset %}{{ x + s }}|{% macro m() %}{{ s|safe }}{% endmacro %}{{ m() + s }}|{% set ns = namespace(v=s|safe) %}{{ ns.v + s }}", kMarkupContext,
     "<x & 'y'><x & 'y'>|<x & 'y'><x & 'y'>|<x & 'y'>&lt;x &amp; &#39;y&#39;&gt;"},
    {"striptags", "{{ '<b>a</b>  &amp; c'|striptags }}|{{ 'a<!-- c -->b <x\\n>c  \\n d'|striptags }}|{{ 'a < b & c'|striptags }}|{{ (s|e|striptags) + s }}|{{ 'x <b'|striptags }}", kMarkupContext,
     "a & c|ab c d|a < b & c|<x & 'y'><x & 'y'>|x <b"},
};

INSTANTIATE_TEST_SUITE_P(Markup, JinjaCase, ::testing::ValuesIn(kMarkupCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(Jinja, GenerationSpansAreByteOffsetsOfEachBlock) {
  const char* source =
      "<s>{% for m in ms %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
      "{% else %}{{ m.content }}{% endif %}|{% endfor %}";
  auto ctx = nlohmann::ordered_json::parse(
      R"({"ms": [{"role": "user", "content": "é"}, {"role": "assistant", "content": "ab"},
                 {"role": "user", "content": "c"}, {"role": "assistant", "content": "dé"}]})");
  Rendered r = Template::parse(source, "t.jinja").render(ctx);
  ASSERT_EQ(r.generation_spans.size(), 2u);
  // transformers reports (5, 7) and (10, 13) in characters; "é" is two bytes.
  EXPECT_EQ(r.generation_spans[0], std::make_pair(size_t{6}, size_t{8}));
  EXPECT_EQ(r.generation_spans[1], std::make_pair(size_t{11}, size_t{14}));
  EXPECT_EQ(r.text.substr(11, 3), "dé");
}

TEST(Jinja, RaiseExceptionCarriesTheTemplatesMessage) {
  try {
    render("line one\n{% if true %}\n  {{ raise_exception('Conversation roles must alternate') }}{% endif %}");
    FAIL() << "no exception";
  } catch (const RaisedError& e) {
    EXPECT_EQ(e.message(), "Conversation roles must alternate");
    EXPECT_NE(std::string(e.what()).find("t.jinja:3:"), std::string::npos) << e.what();
  }
}

// Asserts that rendering fails with a TemplateError (not a RaisedError) whose text starts with
// the location and contains `what`.
void expect_error(const std::string& source, const std::string& location, const std::string& what,
                  const std::string& context = "{}") {
  try {
    render(source, context);
    ADD_FAILURE() << "no error for " << source;
  } catch (const RaisedError& e) {
    ADD_FAILURE() << "raise_exception error for " << source << ": " << e.what();
  } catch (const TemplateError& e) {
    std::string text = e.what();
    EXPECT_EQ(text.rfind(location, 0), 0u) << text;
    EXPECT_NE(text.find(what), std::string::npos) << text;
  }
}

TEST(Jinja, SyntaxErrorsNameLineAndColumn) {
  expect_error("ok\n  {% unknown_tag %}", "t.jinja:2:6: ", "unknown tag 'unknown_tag'");
  expect_error("{% for x in xs recursive %}{% endfor %}", "t.jinja:1:16: ", "recursive");
  expect_error("{{ x|no_such_filter }}", "t.jinja:1:6: ", "no filter named 'no_such_filter'");
  expect_error("{{ x is no_such_test }}", "t.jinja:1:9: ", "no test named 'no_such_test'");
  expect_error("{% if x %}never closed", "t.jinja:1:23: ", "'endif'");
  expect_error("{{ 'unterminated }}", "t.jinja:1:4: ", "string literal");
  expect_error("{% break %}", "t.jinja:1:4: ", "outside of a loop");
  expect_error("{{ f(*args) }}", "t.jinja:1:6: ", "*args");
  expect_error("{# open comment", "t.jinja:1:1: ", "Missing end of comment tag");
}

TEST(Jinja, EvaluationErrorsNameLineAndColumn) {
  expect_error("\n\n   {{ missing.attr }}", "t.jinja:3:", "'missing' is undefined");
  expect_error("{{ 1 + 'a' }}", "t.jinja:1:6: ", "unsupported operand type(s) for +: 'int' and 'str'");
  expect_error("{{ 1 / 0 }}", "t.jinja:1:6: ", "division by zero");
  expect_error("{% set xs = [] %}{{ xs.append(1) }}", "t.jinja:1:", "'append' of 'list' object is unsafe");
  expect_error("{{ 'a' + {} }}", "t.jinja:1:", "can only concatenate str (not \"dict\") to str");
  // What of jinja2's Markup is not modelled is refused by name (jinja2 renders these).
  expect_error("{{ {'k'|safe: 1} }}", "t.jinja:1:", "Markup (|safe, |escape) dict keys are outside the subset");
  expect_error("{{ ('%s'|safe) % 'a' }}", "t.jinja:1:", "printf-style string formatting is outside the subset");
  expect_error("{{ 'a &copy; b'|striptags }}", "t.jinja:1:", "striptags of text with the HTML entity '&copy; b...'");
  expect_error("{{ ('a'|safe) + 1 }}", "t.jinja:1:", "unsupported operand type(s) for +: 'Markup' and 'int'");
  expect_error("{{ undefined_thing|tojson }}", "t.jinja:1:", "not JSON serializable");
  expect_error("{% set x = 1 %}{% set x.attr = 2 %}", "t.jinja:1:", "non-namespace");
  expect_error("{{ xs|map(attribute='a') }}", "t.jinja:1:", "generator", R"({"xs": []})");
}

TEST(Jinja, StrftimeNowUsesTheInjectedClock) {
  setenv("TZ", "UTC", 1);
  tzset();
  EXPECT_EQ(render("{{ strftime_now('%Y-%m-%d %H:%M') }}"), "2024-07-26 12:00");
  RenderOptions later;
  later.now_unix_seconds = kNow + 86400;
  auto t = Template::parse("{{ strftime_now('%d %b %Y') }}", "t.jinja");
  EXPECT_EQ(t.render(nlohmann::ordered_json::object(), later).text, "27 Jul 2024");
}

TEST(Jinja, ContextOverridesAndKeepsKeyOrder) {
  EXPECT_EQ(render("{{ d|tojson }}", R"({"d": {"z": 1, "a": {"y": 2, "b": 3}}})"), R"({"z": 1, "a": {"y": 2, "b": 3}})");
  EXPECT_EQ(render("{{ range(3)|list }}"), "[0, 1, 2]");
  EXPECT_EQ(render("{{ range }}", R"({"range": "mine"})"), "mine");  // the context shadows globals
}

TEST(Jinja, TrailingNewlineOfTheSourceIsDropped) {
  EXPECT_EQ(render("a\n"), "a");
  EXPECT_EQ(render("a\n\n"), "a\n");
  EXPECT_EQ(render("a\r\nb"), "a\nb");
}

}  // namespace
}  // namespace qlora::jinja
