"""`qlora generate` with the template the run trained with, and what an export records.

1. A real run of the embedded default (alpaca, instruct), started in another working directory with
   a relative output_dir: the export's qlora.json records format, template, train_on_input and
   BOS/EOS; adapter_config.json's base_model_name_or_path is absolute and is where peft's
   AutoPeftModelForCausalLM finds the base from this directory; with model.name=org/x it is "org/x".
2. --instruction/--input --print-prompt: the text is Stanford Alpaca's prompt, the ids are
   sentencepiece's of it with BOS; generating from it gives the same text as --prompt with the
   alpaca prompt written by hand.
3. Every chat kind (qlora.json rewritten to name it): --message/--system --print-prompt text is
   transformers' render of the model's own template (tests/data/chat_templates/) with
   add_generation_prompt=True (BOS and EOS are ids, not text: rendered as ""), multi-turn too; the
   ids of a single-turn prompt are BOS + sentencepiece's ids of that text. llama2-chat against
   Meta's format written out.
4. A real chat run (chatml): qlora.json says so, and --message generates.
5. Errors: no qlora.json (an older export), a plain-text run, --prompt with a template flag, a flag
   the template cannot render (alpaca multi-turn), an even number of --message, --system with
   mistral-v0.3, a malformed qlora.json, a template past its render budget; the usage follows the
   command line's errors, never those of the model's files.

    python tests/recipes/test_generate_cli.py --qlora build/qlora --qlora-faults build/qlora_faults --workdir build/cli_generate
"""
import json
import os
import shutil
import subprocess
import sys

import sentencepiece
from transformers.utils.chat_template_utils import render_jinja_template

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recipe_common import Checks, recipe_args, run_recipe  # noqa: E402

DATA = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data"))
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\nReverse the word.\n\n### Input:\nkite\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\n{}\n\n### Response:\n")
# qlora kind -> the model's template (tests/data/chat_templates/); gemma-2's refuses a system message.
CHAT_KINDS = {"llama3-chat": "Meta-Llama-3-8B-Instruct", "llama3.1-chat": "Llama-3.3-70B-Instruct",
              "chatml": "OpenHermes-2.5-Mistral-7B", "qwen2.5": "Qwen2.5-7B-Instruct", "qwen3": "Qwen3-0.6B",
              "gemma": "gemma-3-1b-it", "mistral-v0.3": "Mistral-7B-Instruct-v0.3"}
CONVERSATIONS = [
    (None, ["Add 12 + 7."]),
    ("Be brief.", ["Reverse kite."]),
    (None, ["Hi", "Hello!", "  Café?  "]),
    ("Réponds en français.", ["one", "1", "two", " 2 ", "three"]),
]


def qlora(exe, *args, cwd=None):
    return subprocess.run([exe, "generate", *args], capture_output=True, text=True, cwd=cwd)


def print_prompt(exe, ckpt, *args):
    r = qlora(exe, "--checkpoint", ckpt, "--print-prompt", *args)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr}


def fake_export(src, dst, prompt):
    """An export's config and tokenizer with a qlora.json of our choosing (prompt None: no qlora.json)."""
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "tokenizer.model"):
        shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    path = os.path.join(dst, "qlora.json")
    if prompt is None:
        if os.path.exists(path):
            os.remove(path)
        return dst
    with open(path, "w") as f:
        json.dump({"format": "qlora-export-v1", "prompt": prompt}, f)
    return dst


def chat_prompt(kind):
    return {"format": "chat", "template": kind, "train_on_input": False, "add_bos": True, "add_eos": True}


def message_args(system, turns):
    return (["--system", system] if system is not None else []) + [a for t in turns for a in ("--message", t)]


def reference_text(model, system, turns):
    with open(os.path.join(DATA, "chat_templates", model + ".jinja")) as f:
        template = f.read()
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True,
                                        bos_token="", eos_token="")
    return rendered[0]


def check_export_records(check, exe, wd):
    """Part 1; returns the epoch directory of the run."""
    cwd = os.path.join(wd, "elsewhere")
    os.makedirs(cwd, exist_ok=True)
    r = subprocess.run([exe, "run", "lora_finetune", "checkpoint.output_dir=run", "training.epochs=1",
                        "training.max_steps_per_epoch=20", "logging.progress=plain"], capture_output=True, text=True, cwd=cwd)
    check(r.returncode == 0, "the default run trains from another working directory" + ("" if r.returncode == 0 else r.stderr[-2000:]))
    epoch = os.path.join(cwd, "run", "epoch_0")
    with open(os.path.join(epoch, "qlora.json")) as f:
        rec = json.load(f)
    check(rec == {"format": "qlora-export-v1", "prompt": {"format": "instruct", "template": "alpaca",
                                                          "train_on_input": False, "add_bos": True, "add_eos": True}},
          f"qlora.json records the run's data format and template: {rec}")
    with open(os.path.join(epoch, "adapter", "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    check(os.path.isabs(base) and os.path.isfile(os.path.join(base, "config.json")),
          f"base_model_name_or_path is absolute and holds the base: {base}")
    try:
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained(os.path.join(epoch, "adapter"))
        check(model is not None, "peft loads the adapter and its base from another working directory")
    except Exception as e:  # noqa: BLE001 - any failure to load is the failed check
        check(False, f"peft loads the adapter and its base from another working directory: {e}")
    named = os.path.join(wd, "named")
    r = run_recipe(exe, named, "training.epochs=1", "training.max_steps_per_epoch=2", "model.name=org/x",
                   "checkpoint.adapter_only=true", "logging.progress=plain")
    with open(os.path.join(named, "epoch_0", "adapter", "adapter_config.json")) as f:
        check(r.returncode == 0 and json.load(f)["base_model_name_or_path"] == "org/x", "model.name=org/x is recorded as given")
    return epoch


def check_alpaca(check, exe, epoch, sp):
    got = print_prompt(exe, epoch, "--instruction", "Reverse the word.", "--input", "kite")
    check(got.get("text") == ALPACA and got.get("ids") == [sp.bos_id()] + sp.encode(ALPACA),
          f"--instruction/--input: the alpaca prompt and its ids: {got}")
    got = print_prompt(exe, epoch, "--message", "Say hi.")
    check(got.get("text") == ALPACA_NO_INPUT.format("Say hi."), f"--message with alpaca: the no-input prompt: {got}")
    templated = qlora(exe, "--checkpoint", epoch, "--instruction", "Reverse the word.", "--input", "kite",
                      "--max-new-tokens", "12")
    raw = qlora(exe, "--checkpoint", epoch, "--prompt", ALPACA, "--max-new-tokens", "12")
    check(templated.returncode == 0 and raw.returncode == 0 and templated.stdout == raw.stdout and
          templated.stdout.strip(), f"--instruction generates what --prompt with the prompt by hand does: "
          f"{templated.stdout!r} vs {raw.stdout!r} {templated.stderr[-500:]}")


def check_chat_kinds(check, exe, epoch, sp, wd):
    for kind, model in CHAT_KINDS.items():
        ckpt = fake_export(epoch, os.path.join(wd, "kinds", kind), chat_prompt(kind))
        for system, turns in CONVERSATIONS:
            if system is not None and kind == "mistral-v0.3":
                continue  # refused: see check_errors
            got = print_prompt(exe, ckpt, *message_args(system, turns))
            want = reference_text(model, system, turns)
            ok = got.get("text") == want
            if len(turns) == 1:
                ok = ok and got.get("ids") == [sp.bos_id()] + sp.encode(want)
            check(ok, f"{kind} ({model}) prompt of system={system!r} {turns!r}" +
                  ("" if ok else f":\n  qlora {got}\n  ref   {want!r}"))
    ckpt = fake_export(epoch, os.path.join(wd, "kinds", "llama2-chat"), chat_prompt("llama2-chat"))
    got = print_prompt(exe, ckpt, "--system", "Be brief.", "--message", "Hi")
    want = "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]"
    check(got.get("text") == want and got.get("ids") == [sp.bos_id()] + sp.encode(want), f"llama2-chat prompt ({got})")


def check_chat_run(check, exe, wd):
    records = [{"messages": [{"role": "user", "content": f"Reverse {w}."}, {"role": "assistant", "content": w[::-1]}]}
               for w in ["kite", "book", "lamp", "tree", "stone", "river", "cloud", "apple", "bird", "fish"]]
    path = os.path.join(wd, "chat.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    out = os.path.join(wd, "chat_run")
    r = run_recipe(exe, out, f"data.path={path}", "data.format=chat", "data.template=chatml", "training.batch_size=4",
                   "training.epochs=1", "training.max_steps_per_epoch=2", "logging.progress=plain")
    epoch = os.path.join(out, "epoch_0")
    with open(os.path.join(epoch, "qlora.json")) as f:
        check(r.returncode == 0 and json.load(f)["prompt"] == chat_prompt("chatml"), "a chatml run records chat/chatml")
    got = print_prompt(exe, epoch, "--message", "Reverse kite.")
    check(got.get("text") == reference_text(CHAT_KINDS["chatml"], None, ["Reverse kite."]), f"chatml run prompt: {got}")
    g = qlora(exe, "--checkpoint", epoch, "--message", "Reverse kite.", "--max-new-tokens", "4")
    check(g.returncode == 0, f"--message generates: {g.stderr[-500:]}")


def check_errors(check, exe, epoch, wd):
    def fails(what, args, *needles, ckpt=epoch, usage=False):
        """An error naming `needles`; the usage follows an error in the command line only."""
        r = qlora(exe, "--checkpoint", ckpt, *args)
        check(r.returncode == 1 and all(n in r.stderr for n in needles) and ("usage:" in r.stderr) == usage,
              f"{what} ({'with' if usage else 'without'} the usage): {r.stderr.strip()[:300]}")

    old = fake_export(epoch, os.path.join(wd, "errors", "old"), None)
    fails("no qlora.json", ["--instruction", "x"], "qlora.json", "--prompt", ckpt=old)
    text = fake_export(epoch, os.path.join(wd, "errors", "text"),
                       {"format": "text", "template": None, "train_on_input": False, "add_bos": True, "add_eos": True})
    fails("a plain-text run", ["--message", "x"], "data.format = \"text\"", "--prompt", ckpt=text)
    fails("--prompt with --instruction", ["--prompt", "x", "--instruction", "y"], "--prompt", usage=True)
    fails("alpaca multi-turn", ["--message", "a", "--message", "b", "--message", "c"], "alpaca", "one --message",
          usage=True)
    fails("alpaca --system", ["--system", "s", "--message", "x"], "alpaca", "one --message", usage=True)
    fails("even --message count", ["--message", "a", "--message", "b"], "odd number", usage=True)
    mistral = os.path.join(wd, "kinds", "mistral-v0.3")
    fails("mistral --system", ["--system", "s", "--message", "x"], "mistral-v0.3", ckpt=mistral, usage=True)
    bad = fake_export(epoch, os.path.join(wd, "errors", "bad"), {"format": "chat"})
    fails("malformed qlora.json", ["--message", "x"], os.path.join(bad, "qlora.json"), "prompt.train_on_input", ckpt=bad)
    # A model's own template that runs away (99,999^2 loop steps): its file's error, not the usage.
    runaway = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    budget = fake_export(epoch, os.path.join(wd, "errors", "budget"), {**chat_prompt("auto"), "chat_template": runaway})
    fails("a template past its budget", ["--message", "x"], "qlora.json", "steps", ckpt=budget)


def main():
    args = recipe_args()
    wd = os.path.abspath(args.workdir)
    exe = os.path.abspath(args.qlora)
    check = Checks()
    epoch = check_export_records(check, exe, wd)
    # The reference ids: python sentencepiece with the tokenizer the export carries.
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(epoch, "tokenizer.model"))
    check_alpaca(check, exe, epoch, sp)
    check_chat_kinds(check, exe, epoch, sp, wd)
    check_chat_run(check, exe, wd)
    check_errors(check, exe, epoch, wd)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
