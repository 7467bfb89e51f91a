#!/usr/bin/env python3
"""Conformance of our exports with peft and transformers.

Makes a tiny fp32 LlamaForCausalLM (save_pretrained), runs tests/tools/export_tool on it (LoRA
r=8 on every projection with random B), then checks
  1. PeftModel.from_pretrained(base, OUT/adapter) gives our logits,
  2. AutoModelForCausalLM.from_pretrained(OUT/merged) gives our logits,
  3. the adapter config round-trips through peft's LoraConfig.
  python test_export_peft.py --tool build/export_tool --workdir /tmp/x
"""
import argparse
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

# fp32 everywhere; the only differences are summation order (our matmuls vs torch's SDPA / the
# separate LoRA path vs the merged weight), a few fp32 ulps of logits of magnitude ~1 per layer.
ADAPTER_ATOL = 1e-4
MERGED_ATOL = 1e-4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from peft import PeftModel, LoraConfig

    os.makedirs(args.workdir, exist_ok=True)
    base_dir = os.path.join(args.workdir, "base")
    out_dir = os.path.join(args.workdir, "out")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(base_dir)
    subprocess.run([args.tool, "--checkpoint", base_dir, "--out", out_dir], check=True)
    ours = load_file(os.path.join(out_dir, "logits.safetensors"))
    tokens, logits = ours["tokens"], ours["logits"]

    passed, failed = 0, 0

    def check(name, ok, detail):
        nonlocal passed, failed
        print(("PASS " if ok else "FAIL ") + name + ": " + detail)
        if ok:
            passed += 1
        else:
            failed += 1

    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        base_logits = base(tokens).logits
        peft_model = PeftModel.from_pretrained(base, os.path.join(out_dir, "adapter")).eval()
        n_lora = sum(1 for n, _ in peft_model.named_parameters() if "lora_A" in n)
        check("adapter loads every module", n_lora == 14, f"{n_lora} lora_A modules (want 14)")
        ref = peft_model(tokens).logits
        d = (ref - logits).abs().max().item()
        check("peft adapter logits", d <= ADAPTER_ATOL, f"max |diff| = {d:.3e} (atol {ADAPTER_ATOL})")
        moved = (ref - base_logits).abs().max().item()
        check("adapter is non-trivial", moved > 1e-2, f"max |adapted - base| = {moved:.3e}")

        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "merged"), dtype=torch.float32)
        ref_m = merged(tokens).logits
        d = (ref_m - logits).abs().max().item()
        check("merged model logits", d <= MERGED_ATOL, f"max |diff| = {d:.3e} (atol {MERGED_ATOL})")

    with open(os.path.join(out_dir, "adapter", "adapter_config.json")) as f:
        raw = json.load(f)
    lc = LoraConfig.from_pretrained(os.path.join(out_dir, "adapter"))
    ok = lc.r == 8 and lc.lora_alpha == 16 and lc.peft_type.value == "LORA" and \
        set(lc.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    check("adapter_config via LoraConfig", ok, f"r={lc.r} alpha={lc.lora_alpha} targets={sorted(lc.target_modules)}")
    check("adapter_config task_type", raw.get("task_type") == "CAUSAL_LM", str(raw.get("task_type")))

    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
