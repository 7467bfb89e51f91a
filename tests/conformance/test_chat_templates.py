"""Conformance: qlora's chat templates render what transformers' apply_chat_template renders with
each model's own chat template (tests/data/chat_templates/, sources in its README).

For every (qlora template kind, model template) pair and every conversation below (system or not,
multi-turn, unicode and unicode spaces, surrounding whitespace, empty contents, <think> blocks, a
Qwen3 tool response) and instruct record (as the user/assistant pair render_instruct makes of it),
tests/tools/tokenize_tool renders and tokenizes with the kind, and the reference is
PreTrainedTokenizerFast(...).apply_chat_template with the model's template. Checks:
  1. text: our segments joined, BOS first (the dataset's add_bos; never spelled twice) equal the
     reference text exactly;
  2. mask: the trained segments, in order, are exactly the answers as the reference renders them:
     from just after each answer header (also checked to be where add_generation_prompt ends the
     text) through its end-of-turn marker (<|eot_id|>, <|im_end|>\\n, <end_of_turn>\\n, EOS);
  3. ids: with a byte-level BPE tokenizer.json holding the families' special tokens, our tokens equal
     apply_chat_template(tokenize=True) followed by EOS unless the ids already end with it (the
     dataset's add_eos), and exactly the tokens inside the answers (and that EOS) are trained.
     Conversations where a reference token straddles a prompt/answer boundary (an untrimmed answer
     starting with whitespace after ChatML's "\\n") cannot tokenize segment by segment to the same
     ids; they are counted and skipped for this check only.
  Every template is also rendered by qlora itself (data.template = "auto", src/qlora/jinja/), the 8
  above and 8 models qlora has no kind for (Llama-3.2, Phi-3.5, Phi-4, SmolLM2, DeepSeek-R1-Distill,
  Mistral-Nemo, QwQ, Granite 3.3) and Qwen3 with enable_thinking=false (on data without <think>
  blocks): the same checks 1-3, with nothing added (the template writes its
  own BOS/EOS) and the last answer trained through the end of the text, from where the generation
  prompt ends when the text starts with it (TRL's completion mask).
  4. what the kinds deliberately do: Gemma 2's template refuses a system message (gemma folds it as
     Gemma 3 does); Mistral v0.3's drops it from a conversation ending with an answer; llama3-chat
     is Llama-3's template, not Llama-3.1's.

    python tests/conformance/test_chat_templates.py --tool build/tokenize_tool \\
        [--workdir build/conformance_chat_templates]
"""
import argparse
import collections
import functools
import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tokenizer_hf import QWEN2_PATTERN, train_bytelevel  # noqa: E402
from test_tokenizer_tiktoken import run_tool  # noqa: E402

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "chat_templates")


@dataclass
class Family:
    kind: Optional[str]  # qlora's data.template; None: no hand-written kind (data.template = "auto" only)
    template: str        # the model's template, a file in TEMPLATES
    bos: Optional[str]   # the model's bos_token / eos_token (tokenizer_config.json)
    eos: str
    header: str          # what the template writes before each answer
    end: str             # what ends an answer (trained with it)
    system: bool = True  # False: the template refuses a system message
    kwargs: Optional[dict] = None  # template keyword arguments (data.template_kwargs), auto only


LLAMA3_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
FAMILIES = [
    Family("llama3-chat", "Meta-Llama-3-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", LLAMA3_HEADER, "<|eot_id|>"),
    Family("llama3.1-chat", "Llama-3.3-70B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", LLAMA3_HEADER, "<|eot_id|>"),
    Family("chatml", "OpenHermes-2.5-Mistral-7B.jinja", "<s>", "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n"),
    Family("qwen2.5", "Qwen2.5-7B-Instruct.jinja", None, "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n"),
    Family("qwen3", "Qwen3-0.6B.jinja", None, "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n"),
    Family("gemma", "gemma-3-1b-it.jinja", "<bos>", "<eos>", "<start_of_turn>model\n", "<end_of_turn>\n"),
    Family("gemma", "gemma-2-2b-it.jinja", "<bos>", "<eos>", "<start_of_turn>model\n", "<end_of_turn>\n", system=False),
    Family("mistral-v0.3", "Mistral-7B-Instruct-v0.3.jinja", "<s>", "</s>", "[/INST]", "</s>"),
    # Models qlora has no kind for: only their own templates (data.template = "auto").
    Family(None, "meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", LLAMA3_HEADER, "<|eot_id|>"),
    Family(None, "microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>", "<|assistant|>\n", "<|end|>\n"),
    Family(None, "Phi-4.jinja", "<|endoftext|>", "<|im_end|>", "<|im_start|>assistant<|im_sep|>", "<|im_end|>"),
    Family(None, "SmolLM2-135M-Instruct.jinja", "<|im_start|>", "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n"),
    Family(None, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "<｜begin▁of▁sentence｜>",
           "<｜end▁of▁sentence｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    Family(None, "mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", "[/INST]", "</s>"),
    Family(None, "Qwen3-0.6B.jinja", None, "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n",
           kwargs={"enable_thinking": False}),
    Family(None, "QwQ-32B.jinja", None, "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n"),
    # Qwen3.5 renders the last answer after an empty <think></think> block (thinking off), as its
    # generation prompt ends: the block is masked, the answer from there trained.
    Family(None, "Qwen3.5-9B.jinja", None, "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n",
           kwargs={"enable_thinking": False}),
    Family(None, "granite-3.3-2b-instruct.jinja", "<|end_of_text|>", "<|end_of_text|>",
           "<|start_of_role|>assistant<|end_of_role|>", "<|end_of_text|>\n"),
    # gpt-oss (harmony): each answer is a final-channel message after "<|start|>assistant" (where the
    # generation prompt ends), an earlier one closed by <|end|>, the last by <|return|> (its EOS).
    Family(None, "openai-gpt-oss-20b.jinja", "<|startoftext|>", "<|return|>", "<|start|>assistant", "<|end|>"),
]
SPECIALS = ["<s>", "</s>", "<bos>", "<eos>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>",
            "<end_of_turn>", "[INST]", "[/INST]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|im_sep|>",
            "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>", "<|start_of_role|>", "<|end_of_role|>", "<|startoftext|>", "<|start|>",
            "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
ADDED = ["<think>", "</think>"]  # Qwen3's, not special


def chat(*pairs, system=None):
    messages = [{"role": "system", "content": system}] if system is not None else []
    for user, answer in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages


CONVERSATIONS = [
    chat(("Hi", "Hello!")),
    chat(("Add 12 + 7.", "19"), system="Be brief."),
    chat(("Café? 日本語 😀", "Oui.\n\nNon."), ("Why don't you say\nmore", "I'M done.")),
    chat(("  leading and trailing  ", "\n answer with spaces \t\n"), system="  padded system \n"),
    chat(("\u3000全角\u00a0", "\u2003em-spaced\u205f"), ("zero\u200bwidth", "\u200bkept")),
    chat(("", ""), system=""),
    chat(("Tu es là ?", "Oui 🇫🇷"), system="Réponds en français.\nSois poli."),
    chat(("q1", "<think>\nr1\n</think>\n\na1"), ("q2", "<think>\nreason two\n</think>\n\nanswer two")),
    chat(("q", "<think>r</think>a"), ("<tool_response>\nx\n</tool_response>", "done")),
    chat(("one", "1"), ("two", "2"), ("three", "3"), ("four", "4\r\nend")),
    chat(("code?", "def f(x):\n    return x * 2  # doubled\n")),
]
RECORDS = [
    {"instruction": "Add the numbers.", "input": "12 + 7", "output": "19"},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
    {"instruction": "Traduis : chat", "input": "", "output": "  cat  "},
]


def record_messages(r):
    """The conversation render_instruct makes of a record (templates.h)."""
    user = r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")
    return chat((user, r["output"]))


def template_text(f: Family):
    with open(os.path.join(TEMPLATES, f.template)) as t:
        return t.read()


def rendered_corpus():
    """Every conversation as each template renders it: the tokenizer then merges across the markers'
    neighbours ("\n\n", "assistant\n"), which is where segment-wise tokenization can go wrong."""
    corpus = []
    for f in FAMILIES:
        convs = [c for c in CONVERSATIONS + [record_messages(r) for r in RECORDS] if f.system or c[0]["role"] != "system"]
        corpus += render_jinja_template(conversations=convs, chat_template=template_text(f), bos_token=f.bos or "",
                                        eos_token=f.eos)[0]
    return corpus


def family_dir(workdir, tokenizer_json, f: Family):
    """A checkpoint-like directory: the shared tokenizer.json, the model's special tokens."""
    d = os.path.join(workdir, f.template.replace(".jinja", ""))
    os.makedirs(d, exist_ok=True)
    with open(tokenizer_json) as src, open(os.path.join(d, "tokenizer.json"), "w") as dst:
        dst.write(src.read())
    with open(os.path.join(d, "tokenizer_config.json"), "w") as out:
        json.dump({"bos_token": f.bos, "eos_token": f.eos}, out)
    ref = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, bos_token=f.bos, eos_token=f.eos)
    ref.chat_template = template_text(f)
    if f.kwargs:
        ref.apply_chat_template = functools.partial(ref.apply_chat_template, **f.kwargs)
    return d, ref


def answer_spans(f: Family, text, messages, ref, counts, auto=False):
    """(start, end) of each answer in the reference text: after its header, through its end marker;
    auto: the last answer through the end of the text, as TRL's completion mask trains a prompt's
    completion (Phi-3.5 writes EOS after it). Where the text up to the answer is what
    add_generation_prompt renders, the start must be its end."""
    spans, at = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = text.index(f.header, at) + len(f.header)
        end = len(text) if auto and k == len(messages) - 1 else text.index(f.end, start) + len(f.end)
        prompt = ref.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        if text.startswith(prompt) and auto:
            start = len(prompt)  # TRL's completion: QwQ's generation prompt ends inside the answer ("<think>\n")
        elif text.startswith(prompt):
            counts["generation_prompt"] += 1
            assert start == len(prompt), f"{f.template}: answer {k} starts at {start}, generation prompt ends at {len(prompt)}"
        spans.append((start, end))
        at = end
    return spans


def check_text_and_mask(f: Family, ref, messages, got, failures, auto=False):
    """Checks 1 and 2; returns the reference text and answer spans (None when it refused). auto: qlora
    rendered with the model's own template (data.template = "auto"), which adds no BOS or EOS."""
    text = ref.apply_chat_template(messages, tokenize=False)
    segs = got["segments"]
    ours = "".join((f.bos if s["bos_before"] else "") + s["text"] + (f.eos if s["eos_after"] else "") for s in segs)
    framed = ours if auto else (f.bos or "") + ours  # the dataset's add_bos
    want = text if auto or not f.bos or text.startswith(f.bos) else f.bos + text  # a template writing no BOS gets add_bos's
    kind = "auto" if auto else f.kind
    if framed != want:
        failures.append(f"{kind} vs {f.template} text of {messages!r}:\n  qlora {framed!r}\n  ref   {want!r}")
        return None
    spans = answer_spans(f, text, messages, ref, COUNTS, auto)
    trained = [s["text"] + (f.eos if s["eos_after"] else "") for s in segs if not s["prompt"]]
    if trained != [text[a:b] for a, b in spans]:
        failures.append(f"{kind} vs {f.template} mask of {messages!r}: trained {trained!r}, "
                        f"answers {[text[a:b] for a, b in spans]!r}")
    return text, spans


def check_ids(f: Family, ref, messages, text, spans, got, failures, auto=False):
    """Check 3 (auto: the ids exactly apply_chat_template's, nothing added)."""
    enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = ref.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert ids == enc["input_ids"], "apply_chat_template(tokenize=True) is not the text's ids"
    offsets = list(enc["offset_mapping"])
    if any(a < edge < b for a, b in offsets for span in spans for edge in span):
        COUNTS["ids_boundary_skipped"] += 1
        return
    trained = [any(sa <= a and b <= sb for sa, sb in spans) for a, b in offsets]
    if not auto and f.bos and ids[:1] != [ref.bos_token_id]:
        ids, trained = [ref.bos_token_id] + ids, [False] + trained  # the dataset's add_bos
    if not auto and ids[-1:] != [ref.eos_token_id]:
        ids, trained = ids + [ref.eos_token_id], trained + [True]  # add_eos, trained
    labels = [i if t else -100 for i, t in zip(ids, trained)]
    COUNTS["ids_compared"] += 1
    if got["tokens"] != ids or got["labels"] != labels:
        failures.append(f"{'auto' if auto else f.kind} vs {f.template} ids of {messages!r}:\n  qlora {got['tokens']} {got['labels']}\n"
                        f"  ref   {ids} {labels}")


def check_family(f: Family, tool, workdir, tokenizer_json, failures, auto=False):
    """The family's kind, or (auto) the model's own template interpreted by qlora, against transformers."""
    d, ref = family_dir(workdir, tokenizer_json, f)
    cases = [{"messages": m} for m in CONVERSATIONS] + [{"instruct": r} for r in RECORDS]
    cases = [c for c in cases if f.system or c.get("messages", [{}])[0].get("role") != "system"]
    if f.kwargs and f.kwargs.get("enable_thinking") is False:  # data for a non-thinking run has no <think> blocks
        cases = [c for c in cases if "<think>" not in json.dumps(c)]
    own = {"template": "auto", "chat_template": template_text(f), "template_kwargs": f.kwargs or {}}
    requests = {"chat": [dict(c, **own) if auto else dict(c, template=f.kind) for c in cases]}
    got = run_tool(tool, d, requests, workdir, f.template.replace(".jinja", ""))["chat"]
    for case, sample in zip(cases, got):
        messages = case.get("messages") or record_messages(case["instruct"])
        if "error" in sample:
            failures.append(f"{f.kind} refused {messages!r}: {sample['error']}")
            continue
        COUNTS["rendered_auto" if auto else "rendered"] += 1
        checked = check_text_and_mask(f, ref, messages, sample, failures, auto)
        if checked:
            check_ids(f, ref, messages, *checked, sample, failures, auto)


def check_deliberate(workdir, tokenizer_json, failures):
    """Check 4: what the kinds do where a model's template refuses, drops or differs."""
    refs = {f.template: family_dir(workdir, tokenizer_json, f)[1] for f in FAMILIES if not f.kwargs}
    with_system = CONVERSATIONS[1]
    try:
        refs["gemma-2-2b-it.jinja"].apply_chat_template(with_system, tokenize=False)
        failures.append("Gemma 2's template rendered a system message; expected it to refuse")
    except Exception as e:  # jinja2's TemplateError from raise_exception
        COUNTS["deliberate"] += 1
        print(f"Gemma 2's template refuses a system message ({e}); gemma folds it as Gemma 3 does")
    mistral = refs["Mistral-7B-Instruct-v0.3.jinja"]
    if mistral.apply_chat_template(with_system, tokenize=False) != mistral.apply_chat_template(with_system[1:], tokenize=False):
        failures.append("Mistral v0.3's template kept the system message of a conversation ending with an answer")
    COUNTS["deliberate"] += 1
    llama31 = refs["Llama-3.3-70B-Instruct.jinja"].apply_chat_template(CONVERSATIONS[0], tokenize=False)
    if llama31 == refs["Meta-Llama-3-8B-Instruct.jinja"].apply_chat_template(CONVERSATIONS[0], tokenize=False):
        failures.append("Llama-3 and Llama-3.1 templates render alike; llama3.1-chat would be needless")
    COUNTS["deliberate"] += 1


COUNTS = {"rendered": 0, "rendered_auto": 0, "generation_prompt": 0, "ids_compared": 0, "ids_boundary_skipped": 0, "deliberate": 0}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", required=True, help="tests/tools/tokenize_tool")
    parser.add_argument("--workdir", default="build/conformance_chat_templates")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    # A byte-level BPE (Qwen2's pre-tokenizer) over the rendered texts, holding every family's specials.
    added = [AddedToken(t, special=False, normalized=False) for t in ADDED]
    tokenizer_json = train_bytelevel(rendered_corpus() * 5, QWEN2_PATTERN, False, args.workdir, "tokenizer",
                                     specials=SPECIALS, added=added, vocab_size=3000)
    failures = []
    for f in FAMILIES:
        if f.kind:
            check_family(f, args.tool, args.workdir, tokenizer_json, failures)
        check_family(f, args.tool, args.workdir, tokenizer_json, failures, auto=True)
    check_deliberate(args.workdir, tokenizer_json, failures)
    print(json.dumps(COUNTS))
    for line in failures[:20]:
        print("FAIL", line)
    if failures:
        kinds = collections.Counter(" ".join(line.split()[:4]) for line in failures)
        print(f"{len(failures)} failures: " + "; ".join(f"{k} x{n}" for k, n in kinds.items()))
        return 1
    print(f"chat templates: {len(FAMILIES)} model templates, {COUNTS['rendered']} renderings of qlora's kinds and "
          f"{COUNTS['rendered_auto']} of the templates themselves (data.template = auto) equal to transformers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
