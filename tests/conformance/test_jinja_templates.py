"""Conformance: qlora's Jinja interpreter (src/qlora/jinja/) renders every real chat template in
tests/data/chat_templates/ exactly as transformers' apply_chat_template renders it (its own
jinja2 environment: trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now, tojson).

For each template and each context (conversations with and without a system message, one and
several turns, unicode, empty and whitespace-padded contents, <think> blocks, tools where the
template takes them, with and without add_generation_prompt, Qwen3's enable_thinking true and false,
SmolLM2's default system prompt) the text must be byte-identical; a template that raises must raise
on both sides with the same message. strftime_now runs on a fixed clock on both sides.
Also: {% generation %} spans equal transformers' assistant masks' character spans, and a template
that puts non-ASCII text (German, Greek final sigma, Turkish dotted I, digraphs, Cyrillic,
combining marks, CJK, digits of other scripts, Unicode spaces) through every case filter, string
method and test renders as Python's str does it.

    python tests/conformance/test_jinja_templates.py --tool build/chat_template_tool --workdir build/conformance_jinja
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "chat_templates")
NOW = 1735732800  # 2025-01-01 12:00 UTC: strftime_now's clock on both sides
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
# A tool whose name and description hold the characters Markup + str escapes (functionary's tool list).
HTML_TOOLS = [{"type": "function", "function": {"name": "a<b>&c", "description": "Say 'hi' & \"bye\" <now>.",
                                                "parameters": {"type": "object", "properties": {}}}}]
# An assistant turn calling a tool with dict, list and string arguments (Qwen3.5 renders the first two
# through |tojson|safe), then the tool's answer.
TOOL_CALL_CONV = [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                      "name": "get_weather", "arguments": {"city": "Paris <FR> & 'co'", "opts": {"unit": "C", "days": [1, 2]},
                                                           "tags": ["a", "b&c"]}}}]},
                  {"role": "tool", "content": "18 C & sunny"}]
# Two calls in one turn: arguments with numbers, booleans, null, nested lists and quotes (Qwen3.5 prints
# mappings and lists through |tojson|safe, the rest through |string), then arguments given as a JSON
# string, OpenAI's wire form (Qwen3.5's `arguments|items` refuses it, on both sides).
TOOL_CALL_CONV2 = [{"role": "user", "content": "Plan <it>."},
                   {"role": "assistant", "content": "Sure & done.", "tool_calls": [
                       {"type": "function", "function": {"name": "plan", "arguments": {
                           "n": 3, "ok": True, "none": None, "grid": [[1, "<2>"], []], "q": "say \"hi\" & 'bye'",
                           "deep": {"a": {"b": ["é", "&"]}}}}},
                       {"type": "function", "function": {"name": "echo", "arguments": {"text": "<p>&amp;</p>"}}}]},
                   {"role": "tool", "content": "{\"ok\": true}"}, {"role": "tool", "content": "<p>&amp;</p>"}]
TOOL_CALL_JSON_STRING = [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "f", "arguments": "{\"x\": \"<y>\"}"}}]}]
MARKUP_TEMPLATE = (
    "{{ '<a>'|safe + '<b>' }}|{{ '<x>' + '&'|safe }}|{{ '<'|safe ~ '<' }}|{{ ('a<'|safe)|upper + '>' }}|"
    "{{ ('x'|safe)|string + '&' }}|{{ ('q&'|safe)|length }}|{{ ('\"'|safe)|tojson }}|"
    "{% set m = {'k': '<v>'}|tojson|safe %}{{ m + '<' }}|{{ 5|safe + '&' }}|{{ ('a'|safe) == 'a' }}|"
    "{{ 'a' in ('ab'|safe) }}|{{ (' p '|safe)|trim + \"'\" }}|{{ ('s'|safe).startswith('s') }}"
)


def conversations():
    u, a = "user", "assistant"
    yield [{"role": u, "content": "Hello!"}]
    yield [{"role": u, "content": "Hello!"}, {"role": a, "content": "Hi. How can I help?"}]
    yield [{"role": "system", "content": "You are terse."}, {"role": u, "content": "2+2?"}, {"role": a, "content": "4"}]
    yield [{"role": "system", "content": "  Padded system.  "}, {"role": u, "content": "  spaced  "},
           {"role": a, "content": "\nanswer\n"}, {"role": u, "content": "Ünïcödé ✓ 日本語 — ok?"}]
    yield [{"role": u, "content": "a"}, {"role": a, "content": "b"}, {"role": u, "content": "c"}, {"role": a, "content": "d"},
           {"role": u, "content": "e"}]
    yield [{"role": u, "content": "Think."}, {"role": a, "content": "<think>\nhmm\n</think>\n\nDone."},
           {"role": u, "content": "Again."}, {"role": a, "content": "<think>ok</think>Fine."}]
    yield [{"role": u, "content": ""}, {"role": a, "content": ""}]


# Non-ASCII text for unicode-case.jinja: each string is one context, so a mismatch names it.
UNICODE_STRINGS = [
    "straße", "STRASSE ß", "ΣΑΣ", "ΌΣΟΣ ΣΊΣΥΦΟΣ", "ΑΣ'Σ Σ.Σ", "σς", "ǆungla ǅ Ǆ", "ǈ ǋ", "İstanbul ıi",
    "ﬁnal ﬂow ŉ", "Привет мир ЁЖ", "ὈΔΥΣΣΕΎΣ ᾳ ᾼ", "e\u0301te\u0301 Ä\u0308", "日本語 テスト 한국어",
    "中文ABC abc", "١٢٣ ٤", "²³ ½ Ⅻ 一二", "\u2003\u00a0\u3000 \u2028", "\u200b", "hello-wörld (ça) [ёж] {x} <y>",
    "ǇUDI ǉudi", "Ω ω Å K", "aΣ", "ΣA", "éÉ", "ß", "ﬃ", "İ", "MASSE Maße", "x²", "Ⅷ ⅷ",
]
UNICODE_TEMPLATE = (
    "{% set s = text %}{{ s|upper }}|{{ s|lower }}|{{ s|title }}|{{ s|capitalize }}|{{ s.upper() }}|"
    "{{ s.lower() }}|{{ s.title() }}|{{ s.capitalize() }}|{{ s.isupper() }}|{{ s.islower() }}|"
    "{{ s.isalpha() }}|{{ s.isdigit() }}|{{ s.isspace() }}|{{ s.isalnum() }}|{{ s is upper }}|"
    "{{ s is lower }}|{{ s|trim }}|{{ s.split() }}|{{ s|length }}|{{ s[::-1] }}|{{ [s] }}|"
    "{{ s|tojson }}|{{ s|tojson(true) }}|{{ [s, s|upper]|sort|join(',') }}|"
    "{% for w in s.split() %}{{ w.isupper() }}{{ w.islower() }}{{ w.isalpha() }}{{ w.isdigit() }}{{ w.isalnum() }};{% endfor %}"
)


def contexts(name):
    if name == "unicode-case.jinja":
        for text in UNICODE_STRINGS:
            yield {**SPECIALS, "messages": [{"role": "user", "content": text}], "tools": None,
                   "add_generation_prompt": False, "text": text}
        return
    for conv in conversations():
        for agp in (False, True):
            ctx = {**SPECIALS, "messages": conv, "tools": None, "add_generation_prompt": agp}
            yield ctx
            if "Qwen3" in name:
                yield {**ctx, "enable_thinking": False}
                yield {**ctx, "enable_thinking": True}
    if name == "markup.jinja":
        yield {**SPECIALS, "messages": [], "tools": None, "add_generation_prompt": False}
        return
    if "gpt-oss" in name:  # harmony: reasoning in `thinking`, a developer message, its own template kwargs
        yield from gpt_oss_contexts()
    tool_conv = [{"role": "user", "content": "Weather in Paris?"}]
    yield {**SPECIALS, "messages": tool_conv, "tools": TOOLS, "add_generation_prompt": True}
    yield {**SPECIALS, "messages": tool_conv, "tools": HTML_TOOLS, "add_generation_prompt": True}
    yield {**SPECIALS, "messages": TOOL_CALL_CONV, "tools": TOOLS, "add_generation_prompt": True}
    yield {**SPECIALS, "messages": TOOL_CALL_CONV2, "tools": TOOLS, "add_generation_prompt": False}
    yield {**SPECIALS, "messages": TOOL_CALL_JSON_STRING, "tools": TOOLS, "add_generation_prompt": False}


def gpt_oss_contexts():
    """gpt-oss's template (harmony) beyond the common contexts: assistant turns with their reasoning in
    `thinking` (kept for the last turn only), a developer message, reasoning_effort, model_identity and
    builtin_tools, a tool call with its reasoning, and a final turn after it."""
    thinking = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "thinking": "Add them.", "content": "4"},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "thinking": "Again: 6.", "content": "6"}]
    for agp in (False, True):
        yield {**SPECIALS, "messages": thinking, "tools": None, "add_generation_prompt": agp}
        yield {**SPECIALS, "messages": thinking[:4], "tools": TOOLS, "add_generation_prompt": agp,
               "reasoning_effort": "high", "model_identity": "You are Tiny.", "builtin_tools": ["browser", "python"]}
    yield {**SPECIALS, "messages": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
           "tools": None, "add_generation_prompt": True, "reasoning_effort": "low"}
    call = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "thinking": "Use the tool.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C in Paris."}]
    yield {**SPECIALS, "messages": call, "tools": TOOLS, "add_generation_prompt": False}
    yield {**SPECIALS, "messages": call[:3], "tools": TOOLS, "add_generation_prompt": True}


class FixedClock(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.fromtimestamp(NOW, tz)


chat_template_utils.datetime = FixedClock  # transformers' strftime_now calls datetime.now()


def reference(template, ctx):
    kwargs = {k: v for k, v in ctx.items() if k not in ("messages", "tools", "add_generation_prompt")}
    try:
        out, spans = render_jinja_template(conversations=[ctx["messages"]], tools=ctx.get("tools"), chat_template=template,
                                           add_generation_prompt=ctx["add_generation_prompt"],
                                           return_assistant_tokens_mask=True, **kwargs)
        return {"text": out[0], "spans": [list(s) for s in spans[0]]}
    except Exception as e:  # noqa: BLE001 - the template's own exception is what we compare
        return {"error": str(e), "type": type(e).__name__}


# Templates qlora refuses by name in their tool contexts rather than render something else: none now
# (|safe is modelled: Markup + str escapes the str).
REFUSED = {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    passed = failed = 0
    names = sorted(f for f in os.listdir(TEMPLATES) if f.endswith(".jinja"))
    extra = os.path.join(a.workdir, "generation-blocks.jinja")  # a template with {% generation %}
    with open(extra, "w") as f:
        f.write("{% for m in messages %}<|{{ m.role }}|>\n{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content | trim }}<|end|>{% endgeneration %}{% else %}{{ m.content }}<|end|>{% endif %}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    unicode_case = os.path.join(a.workdir, "unicode-case.jinja")
    with open(unicode_case, "w", encoding="utf-8") as f:
        f.write(UNICODE_TEMPLATE)
    markup = os.path.join(a.workdir, "markup.jinja")  # jinja2's Markup (|safe) rules, one line
    with open(markup, "w", encoding="utf-8") as f:
        f.write(MARKUP_TEMPLATE)
    paths = [os.path.join(TEMPLATES, n) for n in names] + [extra, unicode_case, markup]
    for path in paths:
        name = os.path.basename(path)
        with open(path, encoding="utf-8") as f:
            template = f.read()
        cases = list(contexts(name))
        case_file = os.path.join(a.workdir, name + ".cases.json")
        out_file = os.path.join(a.workdir, name + ".out.json")
        with open(case_file, "w") as f:
            json.dump([{"context": c, "now": NOW} for c in cases], f)
        r = subprocess.run([a.tool, path, case_file, out_file], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL {name}: the interpreter refused the template: {r.stderr.strip()}")
            failed += 1
            continue
        with open(out_file) as f:
            ours = json.load(f)
        bad = []
        for k, (ctx, got) in enumerate(zip(cases, ours)):
            ref = reference(template, ctx)
            if name in REFUSED and "tools" in ctx and ctx["tools"]:
                ok = "error" in got and REFUSED[name] in got["error"]
            elif "error" in ref and ref["type"] == "TemplateError":  # raise_exception: the template's own message
                ok = got.get("raised") and got.get("error") == ref["error"]
            elif "error" in ref:  # jinja2/Python refused (None iterated, undefined used): so must we
                ok = "error" in got and not got.get("raised") and got["error"].endswith(ref["error"])
            else:
                ok = got.get("text") == ref["text"] and (name != "generation-blocks.jinja" or got.get("spans") == ref["spans"])
            if not ok:
                bad.append((k, ref, got))
        if bad:
            failed += 1
            k, ref, got = bad[0]
            print(f"FAIL {name}: {len(bad)}/{len(cases)} contexts differ; first (#{k}):\n  ref  {json.dumps(ref)[:600]}\n"
                  f"  ours {json.dumps(got)[:600]}")
        else:
            passed += 1
            print(f"PASS {name}: {len(cases)} contexts byte-identical to transformers")
    print(f"{passed} passed, {failed} failed ({len(paths)} templates)")
    return 0 if failed == 0 and passed >= 15 else 1


if __name__ == "__main__":
    sys.exit(main())
