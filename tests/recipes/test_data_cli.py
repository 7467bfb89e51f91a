"""`qlora data` end to end, checked against sentencepiece and transformers' own rendering:
  - the embedded default (no model written or loaded): each shown sample's masked text is "<s>" + the
    Alpaca prompt and its trained text the answer + "</s>"; its token and trained-token counts, and
    the data set's totals over all 2000 records, equal what sentencepiece gives for the joined text;
    the histogram adds up to the samples; -n; data.val_fraction and data.val_path sections;
  - a ShareGPT file (human/gpt/system and the aliases user/model) with overrides, the ChatML template
    and a short data.max_seq_len, model.checkpoint_dir pointing at a directory holding only a
    tokenizer: the text equals apply_chat_template's rendering (transformers' jinja renderer with
    OpenHermes' template), the trained spans are the answers, counts, truncated and untrained
    samples (named by line), packing rows and efficiency, all computed independently here;
  - the same conversations under a mapped key (data.messages_field); an instruct config on the
    ShareGPT file names the chat format and data.format; bad -n;
  - preference pairs (configs/tiny_qlora_dpo.toml): each shown pair's prompt is the Alpaca prompt of
    its record and its responses the record's chosen and rejected answers; pair counts of the train
    and validation files; with a short data.max_seq_len, every prompt keeps at most
    dpo.max_prompt_len tokens and the cuts are counted;
  - GRPO prompts (data.format = "prompt"): the rewards line, a string prompt shown as written with
    sentencepiece's token count (+ BOS), a conversation rendered by the Alpaca template up to its
    response header, the other fields shown; a record without the answer reward's field is refused
    naming its line and grpo.rewards[0].field.
Prints "N passed, M failed".

    python tests/recipes/test_data_cli.py --qlora build/qlora [--workdir build/cli_data]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import sentencepiece
from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data")
TOKENIZER = os.path.join(DATA, "tokenizer", "tokenizer.model")
DEFAULT_TOKENIZER = os.path.join(DATA, "tokenizer_chars", "tokenizer.model")  # the embedded default's
CHATML = os.path.join(DATA, "chat_templates", "OpenHermes-2.5-Mistral-7B.jinja")

ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the request."
          "\n\n### Instruction:\n{instruction}\n\n### Response:\n")

HEADER = re.compile(r"^--- sample (\d+)/(\d+) \((.*)\): (\d+) tokens, (\d+) trained(.*)$", re.M)
SECTION = re.compile(r"^(train|validation)[^\n]*: (.*)$", re.M)
RUN = re.compile(r"\[-(.*?)-\]|\{\+(.*?)\+\}", re.S)
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "model": "assistant", "system": "system"}


def parse(out):
    """The shown samples (header fields, masked and trained runs) and the sections' figures."""
    sections = list(SECTION.finditer(out))
    end_of_samples = sections[0].start() if sections else len(out)
    heads = list(HEADER.finditer(out, 0, end_of_samples))
    samples = []
    for k, h in enumerate(heads):
        body = out[h.end() + 1:heads[k + 1].start() if k + 1 < len(heads) else end_of_samples]
        runs = [("masked", m.group(1)) if m.group(1) is not None else ("trained", m.group(2)) for m in RUN.finditer(body)]
        samples.append(dict(origin=h.group(3), tokens=int(h.group(4)), trained=int(h.group(5)),
                            truncated="truncated" in h.group(6), runs=runs))
    stats = []
    for k, s in enumerate(sections):
        text = out[s.end():sections[k + 1].start() if k + 1 < len(sections) else len(out)]
        num = lambda key: int(re.search(r"^  " + key + r" +(\d+)", text, re.M).group(1))  # noqa: E731
        packing = re.search(r"packing +(\d+) rows of (\d+) tokens, ([\d.]+)% real", text)
        eos = re.search(r"^  trained EOS +(\d+) of (\d+) samples end with a trained EOS \(id (\d+)\)(.*)$", text, re.M)
        stats.append(dict(title=s.group(0), samples=num("samples"), tokens=num("tokens"), trained=num("trained tokens"),
                          truncated=num("truncated"), untrained=num("no trained token"),
                          untrained_lines=re.findall(r"^    (.*: line \d+)$", text, re.M),
                          packing=(int(packing.group(1)), int(packing.group(2)), float(packing.group(3))) if packing else None,
                          histogram=[int(c) for c in re.findall(r"^ +[\d-]+ \| #* *(\d+)$", text, re.M)],
                          trained_eos=(int(eos.group(1)), int(eos.group(3)), "pad token is the EOS" in eos.group(4))
                          if eos else None))
    return samples, stats


class Expect:
    """A sample as qlora should tokenize it, from sentencepiece on the joined text: BOS, the text
    with trained character spans, EOS (trained); truncation keeps the start and ends with a masked EOS."""

    def __init__(self, sp, text, spans, max_len=0):
        self.text = text
        ids_before = lambda pos: len(sp.encode(text[:pos])) if pos else 0  # noqa: E731
        trained = set()
        for a, b in spans:
            trained.update(range(1 + ids_before(a), 1 + ids_before(b)))
        self.tokens = 1 + len(sp.encode(text)) + 1
        trained.add(self.tokens - 1)
        self.truncated = 0 < max_len < self.tokens
        if self.truncated:
            self.tokens = max_len
            trained = {p for p in trained if p < max_len - 1}
        self.trained = len(trained)


def pack_rows(lengths, seq_len):
    rows, used = 0, seq_len
    for n in lengths:
        if used + n > seq_len:
            rows, used = rows + 1, 0
        used += n
    return rows


def check_pairs(run, expect):
    """`qlora data` on lora_dpo's tiny config: pairs shown and counted, truncation stated and applied."""
    root = os.path.dirname(os.path.dirname(HERE))
    cfg = ["--config", os.path.join(root, "configs", "tiny_qlora_dpo.toml")]
    r = run(*cfg, "-n", "2", cwd=root)
    expect("pairs: runs", r.returncode == 0, r.stderr)
    with open(os.path.join(DATA, "tiny_preferences.jsonl")) as f:
        first = [json.loads(line) for line in f][:2]
    # The prompt spans lines (the Alpaca template's); the responses here are one line each.
    shown = re.findall(r"^--- pair (\d+)/(\d+) .*?\nprompt +(.*?)\nchosen +(.*?)\nrejected +(.*?)\n\n", r.stdout,
                       re.S | re.M)
    expect("pairs: two shown of 512", [(i, n) for i, n, *_ in shown] == [("1", "512"), ("2", "512")], r.stdout[:2000])
    for (_, _, prompt, chosen, rejected), rec in zip(shown, first):
        expect("pairs: the prompt is the record's, masked", prompt.startswith("[-") and rec["prompt"].split("\n")[-1] in prompt, prompt)
        expect("pairs: responses are the record's, scored", chosen.startswith("{+" + rec["chosen"]) and
               rejected.startswith("{+" + rec["rejected"]), (chosen, rejected))
    counts = re.findall(r"^  pairs +(\d+)$", r.stdout, re.M)
    expect("pairs: train and validation counted", counts == ["512", "100"], counts)
    expect("pairs: truncation rule stated", "keeps the prompt's last 32 tokens (dpo.max_prompt_len)" in r.stdout, r.stdout[:400])
    r = run(*cfg, "-n", "40", "data.max_seq_len=24", "dpo.max_prompt_len=12", cwd=root)
    prompts = [int(x) for x in re.findall(r"--- pair \d+/\d+ .*: prompt (\d+) tokens", r.stdout)]
    cut = re.findall(r"^  truncated +(\d+) prompts cut", r.stdout, re.M)
    expect("pairs: prompts keep at most dpo.max_prompt_len tokens, cuts counted", r.returncode == 0 and len(prompts) == 40
           and max(prompts) <= 12 and cut and int(cut[0]) > 0 and "(its start cut)" in r.stdout, (r.stderr, prompts, cut))


def check_prompts(run, expect, work, sp):
    """`qlora data` on GRPO prompt records with an answer reward."""
    path = os.path.join(work, "prompts.jsonl")
    recs = [{"prompt": "Add the numbers.\n35 + 4\n", "answer": 39, "level": 1},
            {"prompt": [{"role": "user", "content": "Reverse the word.\n\nkite"}], "answer": "etik"}]
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    over = ["data.format=prompt", f"data.path={path}", "data.template=alpaca", 'grpo.rewards=[{kind="answer", weight=2}]']
    r = run(*over)
    expect("prompts: runs", r.returncode == 0, r.stderr)
    expect("prompts: the rewards", "rewards: 2 x answer\n" in r.stdout, r.stdout[:500])
    shown = re.findall(r"^--- prompt (\d+)/(\d+) \((.*?)\): (\d+) tokens\n\[-(.*?)-\]\nfields +([^\n]*)$", r.stdout, re.S | re.M)
    expect("prompts: both shown", [(i, n) for i, n, *_ in shown] == [("1", "2"), ("2", "2")], r.stdout[:1500])
    if len(shown) == 2:
        text = recs[0]["prompt"]
        expect("prompts: a string as written, BOS + its tokens", shown[0][4] == text and
               int(shown[0][3]) == len(sp.encode(text)) + 1, shown[0])
        expect("prompts: the other fields", json.loads(shown[0][5]) == {"answer": 39, "level": 1}, shown[0][5])
        expect("prompts: a conversation up to the response header",
               shown[1][4] == ALPACA.format(instruction="Reverse the word.\n\nkite"), shown[1][4])
    expect("prompts: counted", re.search(r"^  prompts +2$", r.stdout, re.M), r.stdout[-600:])
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "x", "solution": 3}) + "\n")
    r = run(*over)
    expect("prompts: a record without the answer is named", r.returncode != 0 and
           f"{path}: line 3: grpo.rewards[0].field = \"answer\"" in r.stderr, r.stderr)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", default="cli_data")
    args = ap.parse_args()
    qlora = os.path.abspath(args.qlora)
    work = os.path.abspath(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    sp = sentencepiece.SentencePieceProcessor(model_file=TOKENIZER)
    sp_default = sentencepiece.SentencePieceProcessor(model_file=DEFAULT_TOKENIZER)
    results = []

    def expect(name, ok, detail=""):
        results.append(bool(ok))
        if not ok:
            print(f"FAIL {name}: {detail}")

    def run(*extra, cwd=work):
        return subprocess.run([qlora, "data", *extra], capture_output=True, text=True, encoding="utf-8", cwd=cwd)

    # ---- the embedded default, in a fresh directory: nothing is written, no model is loaded
    fresh = os.path.join(work, "fresh")
    os.makedirs(fresh)
    r = run(cwd=fresh)
    expect("default runs", r.returncode == 0, r.stderr)
    expect("default writes nothing (no tiny base, no model)", os.listdir(fresh) == [], os.listdir(fresh))
    samples, stats = parse(r.stdout)
    with open(os.path.join(DATA, "tiny_tasks.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    want = []
    for rec in records:
        prompt = (ALPACA_INPUT if rec.get("input") else ALPACA).format(**rec)
        want.append(Expect(sp_default, prompt + rec["output"], [(len(prompt), len(prompt) + len(rec["output"]))]))
    expect("default shows 3 samples", len(samples) == 3, r.stdout[:2000])
    for k, s in enumerate(samples):
        rec = records[k]
        masked = "".join(t for kind, t in s["runs"] if kind == "masked")
        trained = "".join(t for kind, t in s["runs"] if kind == "trained")
        expect(f"default sample {k + 1} masked text is BOS + the prompt", masked == "<s>" + want[k].text[:-len(rec["output"])], masked)
        expect(f"default sample {k + 1} trained text is the answer + EOS", trained == rec["output"] + "</s>", trained)
        expect(f"default sample {k + 1} counts", (s["tokens"], s["trained"]) == (want[k].tokens, want[k].trained),
               (s, want[k].tokens, want[k].trained))
        expect(f"default sample {k + 1} origin", s["origin"].endswith(f"tiny_tasks.jsonl: line {k + 1}"), s["origin"])
    expect("default: train and its bundled held-out file", len(stats) == 2 and stats[1]["samples"] == 100 and
           "tiny_tasks_heldout.jsonl" in stats[1]["title"], stats)
    st = stats[0]
    expect("default totals", (st["samples"], st["tokens"], st["trained"], st["truncated"], st["untrained"]) ==
           (2000, sum(w.tokens for w in want), sum(w.trained for w in want), 0, 0), st)
    expect("default histogram adds up to the samples", sum(st["histogram"]) == 2000 and len(st["histogram"]) >= 2, st["histogram"])
    expect("default says no model was loaded", "no model loaded" in r.stdout, r.stdout[-300:])

    r = run("-n", "0", "data.val_fraction=0.1", cwd=fresh)
    samples, stats = parse(r.stdout)
    expect("-n 0 shows no sample", r.returncode == 0 and samples == [], r.stderr)
    expect("val_fraction: train and validation sections", [s["samples"] for s in stats] == [1800, 200], stats)
    expect("val_fraction: tokens split between them", sum(s["tokens"] for s in stats) == sum(w.tokens for w in want), stats)
    expect("val_fraction: histograms add up", [sum(s["histogram"]) for s in stats] == [1800, 200], stats)
    val_file = os.path.join(work, "val.jsonl")
    with open(val_file, "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records[:7])
    r = run("-n", "0", f"data.val_path={val_file}", cwd=fresh)
    samples, stats = parse(r.stdout)
    expect("val_path: its own section", [s["samples"] for s in stats] == [2000, 7] and val_file in stats[1]["title"],
           (stats, r.stderr))
    for bad in (["-n"], ["-n", "x"], ["--samples", "-1"]):
        r = run(*bad, cwd=fresh)
        expect(f"bad {' '.join(bad)}", r.returncode == 1 and bad[0] in r.stderr, r.stderr)

    # ---- ShareGPT with overrides, the ChatML template, a tokenizer-only model directory
    tok_only = os.path.join(work, "tokenizer_only")
    os.makedirs(tok_only)
    shutil.copy(TOKENIZER, tok_only)
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    convs = [
        [("system", "Be brief."), ("human", "Hi there"), ("gpt", "Hello, how can I help?")],
        [("human", "Add 2 and 3."), ("gpt", "5"), ("human", "And 4 more?"), ("gpt", "9")],
        [("user", "Reverse kite."), ("model", "etik")],
        [("human", long_text), ("gpt", "ok")],             # the answer falls beyond max_seq_len: untrained
        [("human", "Tell a story."), ("gpt", long_text)],  # truncated, still trained
    ]
    max_len = 160
    sharegpt = os.path.join(work, "sharegpt.jsonl")
    dialog = os.path.join(work, "dialog.jsonl")
    with open(sharegpt, "w") as f, open(dialog, "w") as g:
        for c in convs:
            turns = [{"from": who, "value": text} for who, text in c]
            f.write(json.dumps({"conversations": turns}) + "\n")
            g.write(json.dumps({"id": 1, "dialog": turns}) + "\n")
    with open(CHATML) as f:
        chatml = f.read()
    want = []
    for c in convs:
        messages = [{"role": SPEAKERS[who], "content": text} for who, text in c]
        text = render_jinja_template(conversations=[messages], chat_template=chatml)[0][0]
        spans, pos = [], 0
        for m in messages:
            turn = "<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>\n"
            if m["role"] == "assistant":
                spans.append((pos + len("<|im_start|>assistant\n"), pos + len(turn)))
            pos += len(turn)
        want.append(Expect(sp, text, spans, max_len))
    overrides = ["data.format=chat", "data.template=chatml", f"data.max_seq_len={max_len}", f"model.checkpoint_dir={tok_only}"]
    r = run("--samples", "5", f"data.path={sharegpt}", *overrides)
    expect("sharegpt runs with a tokenizer-only model directory", r.returncode == 0, r.stderr)
    samples, stats = parse(r.stdout)
    expect("sharegpt shows 5 samples", len(samples) == 5, r.stdout[:3000])
    for k, (s, w) in enumerate(zip(samples, want)):
        expect(f"sharegpt sample {k + 1} counts", (s["tokens"], s["trained"], s["truncated"]) == (w.tokens, w.trained, w.truncated),
               (s["tokens"], s["trained"], s["truncated"], w.tokens, w.trained, w.truncated))
        if w.truncated:
            continue
        joined = "".join(t for _, t in s["runs"])
        expect(f"sharegpt sample {k + 1} is apply_chat_template's text", joined == "<s>" + w.text + "</s>", (joined, w.text))
        answers = [t for kind, t in s["runs"] if kind == "trained"]
        expect(f"sharegpt sample {k + 1} trains the answers",
               "".join(answers).removesuffix("</s>") == "".join(
                   content + "<|im_end|>\n" for who, content in convs[k] if SPEAKERS[who] == "assistant"), answers)
    st = stats[0]
    expect("sharegpt totals", (st["samples"], st["tokens"], st["trained"]) ==
           (5, sum(w.tokens for w in want), sum(w.trained for w in want)), (st, [(w.tokens, w.trained) for w in want]))
    expect("sharegpt truncated and untrained", (st["truncated"], st["untrained"]) == (2, 1), st)
    expect("sharegpt names the untrained sample", st["untrained_lines"] == [f"{sharegpt}: line 4"], st["untrained_lines"])
    expect("sharegpt histogram adds up", sum(st["histogram"]) == 5, st["histogram"])
    # This sentencepiece model has no pad piece, so its pad is its EOS (</s>, id 2): the EOS closing
    # each untruncated sample is still trained (truncation ends a sample with a masked EOS).
    expect("sharegpt: pad = EOS, and the closing EOS is trained", st["trained_eos"] ==
           (sum(1 for w in want if not w.truncated), sp.eos_id(), sp.pad_id() < 0), st["trained_eos"])

    r = run("-n", "0", f"data.path={sharegpt}", "data.packing=true", *overrides)
    st = parse(r.stdout)[1][0]
    rows = pack_rows([w.tokens for w in want], max_len)
    expect("packing rows and efficiency", st["packing"] is not None and st["packing"][:2] == (rows, max_len) and
           abs(st["packing"][2] - 100.0 * sum(w.tokens for w in want) / (rows * max_len)) < 0.051, (st["packing"], rows))

    r = run("-n", "0", f"data.path={dialog}", "data.messages_field=dialog", *overrides)
    st2 = parse(r.stdout)[1]
    expect("mapped messages_field reads the same", r.returncode == 0 and st2 and
           (st2[0]["tokens"], st2[0]["trained"]) == (st["tokens"], st["trained"]), (r.stderr, st2))
    r = run("-n", "0", f"data.path={dialog}", *overrides)
    expect("unmapped key names data.messages_field", r.returncode == 1 and f"{dialog}: line 1" in r.stderr and
           "data.messages_field" in r.stderr, r.stderr)
    r = run(f"data.path={sharegpt}", "data.format=instruct", f"model.checkpoint_dir={tok_only}")
    expect("instruct config on a ShareGPT file", r.returncode == 1 and
           f"{sharegpt}: line 1: this looks like a chat file (key 'conversations'); set data.format = \"chat\"" in r.stderr,
           r.stderr)

    check_pairs(run, expect)
    check_prompts(run, expect, work, sp_default)

    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
