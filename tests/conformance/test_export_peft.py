#!/usr/bin/env python3
"""Conformance of our exports with peft and transformers.

Makes a tiny fp32 LlamaForCausalLM (save_pretrained), runs tests/tools/export_tool on it (LoRA
r=8 on every projection with random B), then checks
  1. PeftModel.from_pretrained(base, OUT/adapter) gives our logits,
  2. AutoModelForCausalLM.from_pretrained(OUT/merged) gives our logits,
  3. the adapter config round-trips through peft's LoraConfig,
  4. the gradients of every adapter tensor (next-token cross-entropy of the tokens) equal peft's.
For Llama also with --rslora (scale alpha / sqrt(r)) and --dora (peft's use_dora: magnitude
vectors, detached norms, DoRA's merge).
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
# Gradients: against peft in float64, so the tolerance bounds our fp32 rounding alone. Relative to
# the largest reference gradient of the tensor: 1e-4 of it (DoRA's norm is summed in another order
# than peft's torch.linalg.norm: a few ulps more), or, where the case rounds worse than that, three
# times the worst relative distance of peft's own fp32 gradients from float64 over the case's
# tensors (gemma4: 1.8e-4, in layer 0's q_proj, into which every later layer, the KV-sharing ones
# included, backpropagates; ours is 2.8e-4 there with the AVX2 kernels and 3.8e-4 with the AVX-512
# ones, whose sums run in other orders). A wrong scale or a missing term is off by > 1e-2 of it.
GRAD_RTOL = 1e-4
LORA_R, LORA_ALPHA = 8, 16
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_grads(base_dir, out_dir, tokens, attn, dtype):
    """peft's gradients of the adapter tensors (named as in grads.safetensors) for the tool's loss."""
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, attn_implementation=attn).eval()
    if dtype == torch.float64 and getattr(base.config, "_experts_implementation", None) not in (None, "eager"):
        base.set_experts_implementation("eager")  # grouped_mm, MoE's default, has no float64 kernel
    model = PeftModel.from_pretrained(base, os.path.join(out_dir, "adapter"), is_trainable=True).eval().to(dtype)
    logits = model(tokens).logits[0]
    torch.nn.functional.cross_entropy(logits[:-1], tokens[0, 1:]).backward()
    return {pname.replace(".default", "").replace("lora_magnitude_vector.weight", "lora_magnitude_vector"): p.grad
            for pname, p in model.named_parameters() if p.requires_grad}


def check_grads(checks, name, base_dir, out_dir, tokens, attn):
    """peft's gradients of the adapter tensors for the tool's loss equal ours (grads.safetensors)."""
    ref = peft_grads(base_dir, out_dir, tokens, attn, torch.float64)
    peft32 = peft_grads(base_dir, out_dir, tokens, attn, torch.float32)
    ours = load_file(os.path.join(out_dir, "grads.safetensors"))
    scale = lambda g: max(g.abs().max().item(), 1e-6)
    rtol = max([GRAD_RTOL] + [3.0 * (peft32[k].double() - g).abs().max().item() / scale(g) for k, g in ref.items()])
    seen = 0
    for key, g in ref.items():
        if key not in ours:
            checks.check(f"{name} grad {key}", False, "missing from grads.safetensors")
            continue
        seen += 1
        atol = rtol * scale(g)
        checks.compare(f"{name} grad {key.split('model.layers.')[-1]}", ours[key], g, atol)
    checks.check(f"{name} every adapter tensor has a gradient", seen == len(ours), f"{seen} of {len(ours)}")


def expert_parameters(model):
    """peft's target_parameters for the experts: each MoE layer's fused tensors named from the layer
    ("mlp.experts.gate_up_proj"; Gemma 4's sit on the layer itself: "experts.gate_up_proj")."""
    out = set()
    for n, _ in model.named_modules():
        if n.endswith(".experts") and ".layers." in n:
            stem = n.split(".layers.", 1)[1].split(".", 1)[1]  # past "layers.N."
            out |= {stem + ".down_proj", stem + ".gate_up_proj"}
    return out


def check_export(checks, tool, name, base_dir, out_dir, targets, attn, tokens=None, variant=()):
    """Runs export_tool on base_dir (variant: extra flags, --dora / --rslora) and checks what peft
    and transformers make of its output."""
    from transformers import AutoModelForCausalLM
    from peft import PeftModel, LoraConfig

    cmd = [tool, "--checkpoint", base_dir, "--out", out_dir, "--targets", ",".join(targets), *variant]
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
        # Every module of the base that a target names (a Qwen3.5 layer holds one mixer's projections);
        # a MoE layer's experts carry two (peft's target_parameters on gate_up_proj and down_proj).
        # A target matches a module named by it or ending in "." + it (peft's rule; Qwen3.5-MoE's
        # "shared_expert.gate_proj"); the experts hold two adapters (gate_up_proj, down_proj).
        want = sum(2 if n.endswith("experts") else 1 for n, _ in base.named_modules()
                   if any(n == t or n.endswith("." + t) for t in targets))
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
        # peft's own merge (DoRA: rows rescaled to magnitude / ||W + delta||) against our weights.
        peft_merged = peft_model.merge_and_unload().state_dict()
        ours_merged = merged.state_dict()
        worst = max((ours_merged[k] - v).abs().max().item() / max(v.abs().max().item(), 1e-6)
                    for k, v in peft_merged.items()
                    if k.endswith("_proj.weight") or k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"))
        checks.check(f"{name} merged weights equal peft's merge_and_unload", worst <= MERGED_ATOL_PER_UNIT,
                     f"max relative |diff| {worst:.3e} (tol {MERGED_ATOL_PER_UNIT:g})")

    with open(os.path.join(out_dir, "adapter", "adapter_config.json")) as f:
        raw = json.load(f)
    lc = LoraConfig.from_pretrained(os.path.join(out_dir, "adapter"))
    # The experts are peft's target_parameters, not a module.
    params = expert_parameters(base) if "experts" in targets else set()
    ok = lc.r == LORA_R and lc.lora_alpha == LORA_ALPHA and lc.peft_type.value == "LORA" and \
        set(lc.target_modules) == {t.rsplit(".", 1)[-1] for t in targets} - {"experts"} and \
        set(lc.target_parameters or []) == params  # the tool names modules by their last name, as peft matches
    checks.check(f"{name} adapter_config via LoraConfig", ok,
                 f"r={lc.r} alpha={lc.lora_alpha} targets={sorted(lc.target_modules)} "
                 f"parameters={sorted(lc.target_parameters or [])}")
    checks.check(f"{name} adapter_config task_type", raw.get("task_type") == "CAUSAL_LM", str(raw.get("task_type")))
    want = {"use_dora": "--dora" in variant, "use_rslora": "--rslora" in variant}
    got = {k: raw.get(k) for k in want}
    checks.check(f"{name} adapter_config use_dora/use_rslora", got == want and (lc.use_dora, lc.use_rslora) ==
                 (want["use_dora"], want["use_rslora"]), f"{got} (want {want})")
    check_grads(checks, name, base_dir, out_dir, tokens, attn)


def llama_case(checks, tool, workdir):
    from transformers import LlamaConfig, LlamaForCausalLM
    base_dir = os.path.join(workdir, "base")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(base_dir)
    for variant in [(), ("--rslora",), ("--dora",)]:
        name = "llama" + "".join(v.replace("--", " ") for v in variant)
        try:
            check_export(checks, tool, name, base_dir, os.path.join(workdir, "out" + "".join(variant)), LLAMA_TARGETS,
                         "sdpa", variant=variant)
        except Exception as e:
            checks.crashed(name, e)


def family_cases(checks, tool, workdir, only):
    import _families as F
    for i, (name, case) in enumerate(F.CASES.items()):
        if only and name not in only:
            continue
        if not case["model_cls"].__name__.endswith("ForCausalLM"):
            continue  # a multimodal form: this harness loads text-only classes
        try:
            base_dir = os.path.join(workdir, name, "base")
            save_sharded(F.build(name, seed=3000 + i), base_dir)
            g = torch.Generator().manual_seed(3000 + i)
            tokens = torch.randint(0, F.COMMON["vocab_size"], (F.SEQ,), generator=g).tolist()  # > window
            check_export(checks, tool, name, base_dir, os.path.join(workdir, name, "out"), case["targets"],
                         case["attn"], tokens)
        except Exception as e:
            checks.crashed(name, e)


def mxfp4_case(checks, tool, workdir):
    """gpt-oss from its Hub form (experts in MXFP4, _families.save_mxfp4): peft on transformers' reading of that
    checkpoint (dequantized) gives our adapter's logits; the merged export holds the experts in bf16 (peft's
    merge_and_unload rounded to bf16, bit for bit), no quantization_config, and the log says so."""
    import subprocess
    import _families as F
    from peft import PeftModel
    name = "gpt_oss mxfp4"
    try:
        base_dir, out_dir = os.path.join(workdir, "gpt_oss_mxfp4", "base"), os.path.join(workdir, "gpt_oss_mxfp4", "out")
        F.save_mxfp4(F.build("gpt_oss", seed=3100), base_dir)
        tokens = list(range(3, 3 + F.SEQ))
        r = subprocess.run([tool, "--checkpoint", base_dir, "--out", out_dir, "--targets", ",".join(F.MOE_TARGETS),
                            "--tokens", ",".join(map(str, tokens))], capture_output=True, text=True)
        checks.check(f"{name} export ran", r.returncode == 0, r.stderr.strip()[-300:])
        checks.check(f"{name} log says the experts are written in bf16", "MXFP4" in r.stdout and "bf16" in r.stdout,
                     r.stdout.strip()[-300:])
        ours = load_file(os.path.join(out_dir, "logits.safetensors"))
        with torch.no_grad():
            peft_model = PeftModel.from_pretrained(F.load_mxfp4(base_dir), os.path.join(out_dir, "adapter")).eval()
            ref = peft_model(ours["tokens"]).logits
            checks.compare(f"{name} peft adapter logits", ours["logits"], ref,
                           ADAPTER_ATOL_PER_UNIT * max(1.0, ref.abs().max().item()))
            peft_merged = peft_model.merge_and_unload().state_dict()
        merged = load_file(os.path.join(out_dir, "merged", "model.safetensors"))
        experts = [k for k in merged if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]
        checks.check(f"{name} merged experts bf16, no MXFP4 tensors",
                     len(experts) == 4 and all(merged[k].dtype == torch.bfloat16 for k in experts) and
                     not any(k.endswith("_blocks") or k.endswith("_scales") for k in merged), str(sorted(experts)))
        worst = max((merged[k].float() - peft_merged[k].to(torch.bfloat16).float()).abs().max().item() for k in experts)
        checks.check(f"{name} merged experts = peft's merge_and_unload in bf16", worst == 0.0, f"max|diff| {worst:.3e}")
        with open(os.path.join(out_dir, "merged", "config.json")) as f:
            cfg = json.load(f)
        checks.check(f"{name} merged config has no quantization_config", "quantization_config" not in cfg,
                     str(cfg.get("quantization_config")))
        mxfp4_unchanged_experts(checks, tool, base_dir, os.path.join(workdir, "gpt_oss_mxfp4", "attention"), tokens)
    except Exception as e:
        checks.crashed(name, e)


def mxfp4_unchanged_experts(checks, tool, base_dir, out_dir, tokens):
    """LoRA on the attention alone: the merged export keeps the experts' MXFP4 blocks and scales bit for bit
    (and the quantization_config), and transformers' reading of it gives peft's logits."""
    import subprocess
    import _families as F
    from peft import PeftModel
    name = "gpt_oss mxfp4, experts unchanged"
    r = subprocess.run([tool, "--checkpoint", base_dir, "--out", out_dir, "--targets", "q_proj,k_proj,v_proj,o_proj",
                        "--tokens", ",".join(map(str, tokens))], capture_output=True, text=True)
    if not checks.check(f"{name}: export ran", r.returncode == 0, r.stderr.strip()[-300:]):
        return
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    merged = load_file(os.path.join(out_dir, "merged", "model.safetensors"))
    packed = [k for k in base if k.endswith("_blocks") or k.endswith("_scales")]
    checks.check(f"{name}: the merged export holds the original's MXFP4 tensors bit for bit",
                 len(packed) == 8 and all(k in merged and torch.equal(merged[k], base[k]) for k in packed),
                 str(sorted(set(packed) - set(merged))))
    with open(os.path.join(out_dir, "merged", "config.json")) as f:
        checks.check(f"{name}: its quantization_config kept", "quantization_config" in json.load(f), "")
    with torch.no_grad():
        ref = PeftModel.from_pretrained(F.load_mxfp4(base_dir), os.path.join(out_dir, "adapter")).eval()(
            torch.tensor([tokens])).logits
        got = F.load_mxfp4(os.path.join(out_dir, "merged"))(torch.tensor([tokens])).logits
    checks.compare(f"{name}: transformers on the merged export = peft's adapter", got, ref,
                   ADAPTER_ATOL_PER_UNIT * max(1.0, ref.abs().max().item()))


def main():
    def options(ap):
        ap.add_argument("--families", action="store_true", help="the families of _families.CASES instead of Llama")
        ap.add_argument("--case", action="append", help="with --families: only these cases")
    args = parse_tool_args(options)
    checks = Checks()
    if args.families:
        family_cases(checks, args.tool, args.workdir, args.case)
        if not args.case or "gpt_oss" in args.case:
            mxfp4_case(checks, args.tool, args.workdir)
    else:
        llama_case(checks, args.tool, args.workdir)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
