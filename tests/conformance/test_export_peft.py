#!/usr/bin/env python3
"""Conformance of our exports with peft and transformers.

Makes a tiny fp32 LlamaForCausalLM (save_pretrained), runs tests/tools/export_tool on it (LoRA
r=8 on every projection with random B), then checks
  1. PeftModel.from_pretrained(base, OUT/adapter) gives our logits,
  2. AutoModelForCausalLM.from_pretrained(OUT/merged) gives our logits,
  3. the adapter config round-trips through peft's LoraConfig.
With --families, the same for every tiny model of _families.CASES (Qwen2, Qwen3, Gemma 2/3, Mistral
and Phi-3 with sliding windows shorter than the tokens), sharded checkpoints, LoRA on each family's
PEFT target names (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj).
  python test_export_peft.py [--families] --tool build/export_tool --workdir /tmp/x
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file

from _common import Checks, parse_tool_args, run_checked, save_sharded

# fp32 everywhere; the only differences are summation order (our matmuls vs torch's SDPA / the
# separate LoRA path vs the merged weight), a few fp32 ulps per layer. Rounding grows with the
# values (Gemma's logits are O(20), Llama's O(1)), so the tolerance is per unit of the largest
# reference logit: ~1e3 ulps of it, where a missing or misplaced adapter moves logits by > 1e-2.
ADAPTER_ATOL_PER_UNIT = 1e-4
MERGED_ATOL_PER_UNIT = 1e-4
LORA_R, LORA_ALPHA = 8, 16
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def check_export(checks, tool, name, base_dir, out_dir, targets, attn, tokens=None):
    """Runs export_tool on base_dir and checks what peft and transformers make of its output."""
    from transformers import AutoModelForCausalLM
    from peft import PeftModel, LoraConfig

    cmd = [tool, "--checkpoint", base_dir, "--out", out_dir, "--targets", ",".join(targets)]
    if tokens is not None:
        cmd += ["--tokens", ",".join(map(str, tokens))]
    run_checked(cmd)
    ours = load_file(os.path.join(out_dir, "logits.safetensors"))
    tokens, logits = ours["tokens"], ours["logits"]

    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation=attn).eval()
        base_logits = base(tokens).logits
        peft_model = PeftModel.from_pretrained(base, os.path.join(out_dir, "adapter")).eval()
        n_lora = sum(1 for n, _ in peft_model.named_parameters() if "lora_A" in n)
        want = base.config.num_hidden_layers * len(targets)
        checks.check(f"{name} adapter loads every module", n_lora == want, f"{n_lora} lora_A modules (want {want})")
        ref = peft_model(tokens).logits
        checks.compare(f"{name} peft adapter logits", logits, ref,
                       ADAPTER_ATOL_PER_UNIT * max(1.0, ref.abs().max().item()))
        moved = (ref - base_logits).abs().max().item()
        checks.check(f"{name} adapter is non-trivial", moved > 1e-2, f"max |adapted - base| = {moved:.3e}")

        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "merged"), dtype=torch.float32,
                                                      attn_implementation=attn).eval()
        checks.check(f"{name} merged model_type", merged.config.model_type == base.config.model_type,
                     f"{merged.config.model_type} (base {base.config.model_type})")
        ref_m = merged(tokens).logits
        checks.compare(f"{name} merged model logits", logits, ref_m,
                       MERGED_ATOL_PER_UNIT * max(1.0, ref_m.abs().max().item()))

    with open(os.path.join(out_dir, "adapter", "adapter_config.json")) as f:
        raw = json.load(f)
    lc = LoraConfig.from_pretrained(os.path.join(out_dir, "adapter"))
    ok = lc.r == LORA_R and lc.lora_alpha == LORA_ALPHA and lc.peft_type.value == "LORA" and \
        set(lc.target_modules) == set(targets)
    checks.check(f"{name} adapter_config via LoraConfig", ok,
                 f"r={lc.r} alpha={lc.lora_alpha} targets={sorted(lc.target_modules)}")
    checks.check(f"{name} adapter_config task_type", raw.get("task_type") == "CAUSAL_LM", str(raw.get("task_type")))


def llama_case(checks, tool, workdir):
    from transformers import LlamaConfig, LlamaForCausalLM
    base_dir = os.path.join(workdir, "base")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(base_dir)
    check_export(checks, tool, "llama", base_dir, os.path.join(workdir, "out"), LLAMA_TARGETS, "sdpa")


def family_cases(checks, tool, workdir):
    import _families as F
    for i, (name, case) in enumerate(F.CASES.items()):
        try:
            base_dir = os.path.join(workdir, name, "base")
            save_sharded(F.build(name, seed=3000 + i), base_dir)
            g = torch.Generator().manual_seed(3000 + i)
            tokens = torch.randint(0, F.COMMON["vocab_size"], (F.SEQ,), generator=g).tolist()  # > window
            check_export(checks, tool, name, base_dir, os.path.join(workdir, name, "out"), case["targets"],
                         case["attn"], tokens)
        except Exception as e:
            checks.crashed(name, e)


def main():
    args = parse_tool_args(lambda ap: ap.add_argument("--families", action="store_true",
                                                     help="the families of _families.CASES instead of Llama"))
    checks = Checks()
    if args.families:
        family_cases(checks, args.tool, args.workdir)
    else:
        try:
            llama_case(checks, args.tool, args.workdir)
        except Exception as e:
            checks.crashed("llama", e)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
