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
The whole pre-training takes ~5 minutes on one thread. tiny_base_prefixes.txt (beside this file) keeps,
per base version and kind of CPU, what an earlier whole run of this test there gave: the sha256 of
model.safetensors after the first STEPS steps and after all of them, and the held-out counts. Where it
has this CPU's line, the script pre-trains only the first STEPS steps (make_tiny_base.sh --prefix: the
whole run's schedule, stopped there; seconds), and when they are that line's bit for bit, 2 and 3 are
checked on the line's whole base: each step runs all of pre-training's code (the data, forward, backward,
clipping, AdamW, the schedule, which spans all the steps) and the prefix is written as the whole base
is, so a change to any of it, or to the kernels, changes those bits. Otherwise (the pre-training or the
kernels changed since the line was written), and with --whole, the whole run as above, which then
prints this CPU's line.
Prints "N passed, M failed"; exit code 1 on any failure.
"""
import hashlib
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from recipe_common import Checks, recipe_args  # noqa: E402

HELDOUT = os.path.join(ROOT, "tests", "data", "tiny_tasks_heldout.jsonl")
SCRIPT = os.path.join(ROOT, "scripts", "make_tiny_base.sh")
PREFIXES = os.path.join(HERE, "tiny_base_prefixes.txt")
FILES = ("config.json", "model.safetensors", "tokenizer.model")
# Pre-training steps a new line of tiny_base_prefixes.txt records: past the 50 warm-up steps, into the
# cosine decay over all 4000 (~15 s on one thread).
PREFIX_STEPS = 200
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


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_prefixes():
    """tiny_base_prefixes.txt: {(version, kind of CPU): {"steps", "prefix", "whole", "heldout"}}, from lines
    "v<N> <vendor> <ISA> <steps> <sha256 after those steps> <sha256 of the whole base> <right/total per
    task of SHIPPED>"."""
    lines = {}
    with open(PREFIXES) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                version, vendor, isa, steps, prefix, whole, *heldout = line.split()
                counts = [tuple(int(x) for x in c.split("/")) for c in heldout]
                lines[(version, f"{vendor} {isa}")] = {"steps": int(steps), "prefix": prefix, "whole": whole,
                                                       "heldout": dict(zip(SHIPPED, counts))}
    return lines


def make(a, out, *args):
    """scripts/make_tiny_base.sh [ARGS] OUT, as a maintainer runs it, with this build's binaries; true when
    it exits 0 having pre-trained anew (to the end, or to the step --prefix STEPS asked for) and written the
    three files."""
    env = {**os.environ, "QLORA_BIN": os.path.abspath(a.qlora), "QLORA_FAULTS_BIN": os.path.abspath(a.qlora_faults)}
    r = subprocess.run(["bash", SCRIPT, *args, out], env=env, capture_output=True, text=True, timeout=3600)
    print(r.stdout[-2000:], r.stderr[-2000:])
    last = re.findall(r"pre-training step (\d+)/(\d+) ", r.stdout)
    stopped = last[-1] if last else (None, None)
    anew = stopped[0] == (args[1] if args else stopped[1])
    return r.returncode == 0 and anew and all(os.path.exists(os.path.join(out, f)) for f in FILES)


def same_bytes(a, b):
    with open(a, "rb") as x, open(b, "rb") as y:
        return x.read() == y.read()


def main():
    a = recipe_args(("--shipped-only", {"action": "store_true", "help": "score the shipped base only (to pin SHIPPED)"}),
                    ("--whole", {"action": "store_true", "help": "pre-train the whole base (~5 minutes) even where "
                                                                 "tiny_base_prefixes.txt has this CPU's line"}))
    check = Checks()
    version = f"v{base_version()}"
    shipped = os.path.join(ROOT, "src", "qlora", "train", f"tiny_base_{version}")
    ours = heldout_scores(shipped)
    print(f"shipped base {shipped}: held-out {ours}")
    for task, (right, total) in SHIPPED.items():
        got = ours.get(task, (-10, 0))
        check(abs(got[0] - right) <= 1 and got[1] == total,
              f"{task!r}: the shipped base gets {got[0]}/{got[1]} held-out answers right (pinned {right}/{total})")
    if a.shipped_only:
        return check.summary()
    with open(os.path.join(shipped, "made_on")) as f:
        maker = f.read().strip()
    here = cpu_key()
    print(f"shipped base made on {maker!r}; this CPU {here!r}")
    stale = "if not, the pre-training changed since the shipped base was made: run scripts/make_tiny_base.sh"

    def small_files_same(fresh):
        check(all(same_bytes(os.path.join(fresh, f), os.path.join(shipped, f)) for f in ("config.json", "tokenizer.model")),
              "config.json and tokenizer.model equal the shipped ones")

    # 1-3 from the first steps, where this kind of CPU has a line
    line = read_prefixes().get((version, here))
    if line and not a.whole:
        fresh = os.path.join(a.workdir, "prefix")
        if not check(make(a, fresh, "--prefix", str(line["steps"])),
                     f"scripts/make_tiny_base.sh --prefix {line['steps']} exits 0, pre-trains anew up to step "
                     f"{line['steps']} and writes config.json, model.safetensors, tokenizer.model"):
            return check.summary()
        small_files_same(fresh)
        if sha256(os.path.join(fresh, "model.safetensors")) == line["prefix"]:
            print(f"the first {line['steps']} steps are those of tiny_base_prefixes.txt's line for {version} on {here!r}")
            if here == maker:
                check(line["whole"] == sha256(os.path.join(shipped, "model.safetensors")),
                      f"model.safetensors equals the shipped one bit for bit (the same kind of CPU, whose first "
                      f"{line['steps']} steps here are the recorded ones: {stale})")
            for task, (right, total) in line["heldout"].items():
                check(right >= MIN_ACCURACY * total,
                      f"{task!r}: the whole base pre-trained on this kind of CPU gets {right}/{total} held-out answers "
                      f"right (>= {MIN_ACCURACY:.0%}; recorded, its first {line['steps']} steps equal this CPU's)")
            return check.summary()
        print(f"the first {line['steps']} steps differ from those recorded for {version} on {here!r} (the pre-training, "
              "or this CPU's kernels, changed since): pre-training the whole base")

    # 1-3: the whole pre-training
    fresh = os.path.join(a.workdir, "tiny_base")
    if not check(make(a, fresh), "scripts/make_tiny_base.sh exits 0, pre-trains anew (not a copy of a cached or the "
                                 "shipped base) and writes config.json, model.safetensors, tokenizer.model"):
        return check.summary()
    small_files_same(fresh)
    same = same_bytes(os.path.join(fresh, "model.safetensors"), os.path.join(shipped, "model.safetensors"))
    if here == maker or same:
        check(same, f"model.safetensors equals the shipped one bit for bit (the same kind of CPU: {stale})")
        theirs = ours
    else:
        print("another kind of CPU than the maker's: the bits differ; comparing held-out accuracy")
        theirs = heldout_scores(fresh)
        print(f"fresh base: held-out {theirs}")
        for task, (right, total) in SHIPPED.items():
            got = theirs.get(task, (0, 0))
            check(got[1] == total and got[0] >= MIN_ACCURACY * total,
                  f"{task!r}: the fresh base gets {got[0]}/{got[1]} held-out answers right (>= {MIN_ACCURACY:.0%}; "
                  f"shipped {ours[task][0]}/{total})")
    if check.failed == 0:
        prefix = os.path.join(a.workdir, "prefix")
        if make(a, prefix, "--prefix", str(PREFIX_STEPS)):
            counts = " ".join(f"{theirs[t][0]}/{theirs[t][1]}" for t in SHIPPED)
            print(f"this kind of CPU's line for {os.path.relpath(PREFIXES, ROOT)}:\n{version} {here} {PREFIX_STEPS} "
                  f"{sha256(os.path.join(prefix, 'model.safetensors'))} {sha256(os.path.join(fresh, 'model.safetensors'))} "
                  f"{counts}")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
