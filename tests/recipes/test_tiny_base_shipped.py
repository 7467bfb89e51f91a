"""The shipped tiny base (src/qlora/train/tiny_base_v<N>/, what `qlora run lora_finetune` fine-tunes on
every machine, so that none pre-trains) is what scripts/make_tiny_base.sh produces:

1. the script, run here, pre-trains anew (QLORA_NO_SHIPPED_BASE, an empty cache) and writes the three
   files; config.json and tokenizer.model equal the shipped ones byte for byte;
2. model.safetensors equals the shipped one byte for byte on a CPU like the one that made it (the
   shipped made_on: vendor and the ISA ATen dispatches to); pre-training is not reproducible across
   CPUs (MKL's and ATen's kernels differ by ISA: AVX2 and AVX-512 give other bits, tiny_default.cpp),
   so elsewhere the two are compared by what pre-training is for, the held-out accuracy below;
3. held-out accuracy, per task, of each base on its own pre-training format ("Add the numbers.\\n35 + 4\\n"
   -> "39" EOS) over tests/data/tiny_tasks_heldout.jsonl, inputs pre-training never shows: greedy
   exact match, counted as transformers' argmax at every answer position given the right prefix
   (the same verdict as greedy decoding, in one forward). The shipped base's counts are pinned
   (SHIPPED); the fresh base must reach MIN_ACCURACY on each task.
Pre-training takes ~5 minutes on one thread. Prints "N passed, M failed"; exit code 1 on any failure.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from recipe_common import Checks  # noqa: E402

HELDOUT = os.path.join(ROOT, "tests", "data", "tiny_tasks_heldout.jsonl")
FILES = ("config.json", "model.safetensors", "tokenizer.model")
# The shipped v6 base's held-out counts (right, total) on the AMD EPYC (AVX2) that made it. fp32 in
# another order of sums (another CPU's transformers) can flip an argmax that is a near tie: one
# answer of slack, as tests/recipes/test_default_learns.py allows.
SHIPPED = {"Add the numbers.": (50, 50), "Reverse the word.": (50, 50)}
# A fresh base from another kind of CPU (measured so far only on the maker's, 50/50 each): the fine-tuned
# default needs >= 80% per task (test_default_learns.py), and 4000 steps of pre-training gave it 43/50
# sums on both AVX2 and AVX-512 (tiny_default.cpp), so a base below 80% on its own format is broken.
MIN_ACCURACY = 0.8


def base_version():
    with open(os.path.join(ROOT, "src", "qlora", "train", "tiny_default.cpp")) as f:
        return int(re.search(r"^constexpr int kBaseVersion = (\d+);", f.read(), re.M).group(1))


def cpu_key():
    """"<vendor_id> <AVX512|AVX2|DEFAULT>", as scripts/make_tiny_base.sh writes it to made_on."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
    flags = set(info.get("flags", "").split())
    isa = ("AVX512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else
           "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT")
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "")
    if cap == "avx2" and isa == "AVX512":
        isa = "AVX2"
    elif cap == "default":
        isa = "DEFAULT"
    return f"{info.get('vendor_id') or 'unknown'} {isa}"


def heldout_scores(base):
    """{task: (right, total)}: greedy exact match of BOS + prompt -> answer + EOS, as pre-training
    laid the texts out (tiny_default.cpp pretraining_sample: encode_continuation, no dummy prefix)."""
    import sentencepiece
    import torch
    from transformers import LlamaForCausalLM
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(base, "tokenizer.model"))
    nl = sp.encode("\n")

    def continuation(text):  # Tokenizer::encode_continuation: encode "\n" + text, drop the "\n"'s ids
        ids = sp.encode("\n" + text)
        assert ids[:len(nl)] == nl, text
        return ids[len(nl):]

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with open(HELDOUT) as f:
        records = [json.loads(line) for line in f if line.strip()]
    scores = {}
    with torch.no_grad():
        for r in records:
            prompt = [sp.bos_id()] + continuation(f"{r['instruction']}\n{r['input']}\n")
            answer = continuation(r["output"]) + [sp.eos_id()]
            logits = model(torch.tensor([prompt + answer[:-1]])).logits[0]  # [seq, vocab]
            got = logits[len(prompt) - 1:].argmax(-1).tolist()
            right, total = scores.get(r["instruction"], (0, 0))
            scores[r["instruction"]] = (right + (got == answer), total + 1)
    return scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True, help="the qlora binary make_tiny_base.sh runs")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--shipped-only", action="store_true", help="score the shipped base only (to pin SHIPPED)")
    a = ap.parse_args()
    check = Checks()
    shipped = os.path.join(ROOT, "src", "qlora", "train", f"tiny_base_v{base_version()}")
    ours = heldout_scores(shipped)
    print(f"shipped base {shipped}: held-out {ours}")
    for task, (right, total) in SHIPPED.items():
        got = ours.get(task, (-10, 0))
        check(abs(got[0] - right) <= 1 and got[1] == total,
              f"{task!r}: the shipped base gets {got[0]}/{got[1]} held-out answers right (pinned {right}/{total})")
    if a.shipped_only:
        return check.summary()

    # 1. the script, as a maintainer runs it, with this build's qlora
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    fresh = os.path.join(a.workdir, "tiny_base")
    env = {**os.environ, "QLORA_BIN": os.path.abspath(a.qlora)}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "make_tiny_base.sh"), fresh], env=env,
                       capture_output=True, text=True, timeout=3600)
    print(r.stdout[-2000:], r.stderr[-2000:])
    if not check(r.returncode == 0 and all(os.path.exists(os.path.join(fresh, f)) for f in FILES),
                 "scripts/make_tiny_base.sh exits 0 and writes config.json, model.safetensors, tokenizer.model"):
        return check.summary()
    check(re.search(r"pre-training step (\d+)/\1 ", r.stdout), "the script pre-trained anew (not a copy of a cached or the shipped base)")
    same = {}
    for f in FILES:
        with open(os.path.join(fresh, f), "rb") as x, open(os.path.join(shipped, f), "rb") as y:
            same[f] = x.read() == y.read()
    check(same["config.json"] and same["tokenizer.model"], "config.json and tokenizer.model equal the shipped ones")

    # 2 + 3. bit for bit where the CPU is the maker's kind, else by held-out accuracy
    with open(os.path.join(shipped, "made_on")) as f:
        maker = f.read().strip()
    here = cpu_key()
    print(f"shipped base made on {maker!r}; this CPU {here!r}")
    if here == maker or same["model.safetensors"]:
        check(same["model.safetensors"], "model.safetensors equals the shipped one bit for bit (the same kind of CPU: "
              "if not, the pre-training changed since the shipped base was made: run scripts/make_tiny_base.sh)")
        return check.summary()
    print("another kind of CPU than the maker's: the bits differ; comparing held-out accuracy")
    theirs = heldout_scores(fresh)
    print(f"fresh base: held-out {theirs}")
    for task, (right, total) in SHIPPED.items():
        got = theirs.get(task, (0, 0))
        check(got[1] == total and got[0] >= MIN_ACCURACY * total,
              f"{task!r}: the fresh base gets {got[0]}/{got[1]} held-out answers right (>= {MIN_ACCURACY:.0%}; "
              f"shipped {ours[task][0]}/{total})")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
