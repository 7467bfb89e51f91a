#!/usr/bin/env python3
"""Conformance: our forward for the families of issue #11 (tests/tools/llama_logits) against transformers.

For each tiny random model of _families.CASES (Llama as the control that loads today, Qwen2 untied/tied, Qwen3, Gemma 2, Gemma 3 text with
mixed layer types and per-type RoPE bases, plus a linear-scaled global RoPE, Mistral and Phi-3 with a
sliding window shorter than the sequence, SmolLM3 with a NoPE layer, OLMo 2 and OLMo 3 with YaRN on its full layers, Qwen3.5 with three Gated DeltaNet
layers and a gated, partially rotary attention layer, Qwen3-MoE with a dense layer among its MoE ones, Mixtral and
Qwen3.5-MoE (its hybrid with a MoE and a gated shared expert in every layer; also the Hub's multimodal form), each
also from fused 3-D expert tensors, gpt-oss with sinks, biases, its clamped activation and interleaved experts
(and its Hub form: MXFP4 experts)), written by transformers' save_pretrained in >= 2 shards:
  reference  each ablation of the case (a feature switched off) moves transformers' logits by far
             more than the tolerance, so the case exercises that feature (needs no tool)
  fp32       logits of a batch of 2 rows of SEQ tokens
  packed     each row as two packed samples (11 + 9 tokens, each longer than the window): the packed
             training forward equals transformers run on each sample alone
  decode     the KV cache: prefill P tokens (P = 5 < window, P = 12 > window), then one token per
             forward; the logits equal transformers' full forward
  nf4        the base projections in NF4: the reference gets each decoder *_proj.weight replaced by
             torchao's to_nf4(w).get_original_weight(), our tool runs with --nf4
  mxfp4      gpt-oss's experts in MXFP4 as the Hub ships them (packed by the test): against transformers'
             model loaded from that checkpoint (its CPU decode), fp32 and NF4; a bad scales shape refused
Then greedy generation (models::generate through llama_logits --generate) equals transformers' greedy
decoding (its full forward, argmax appended, no cache: what any cache must give) for prompts shorter
and longer than the window, prompt + new tokens > window;
and so does batched generation (models::generate_batch, --batch-lengths): all those prompts, of both
lengths, in one batch with GEN_GROUP sequences each (left-padded key slots, per-row positions, each
prompt's cache shared by its sequences), each sequence against the same prompt's reference.
Where torch sees a CUDA device, each case's forward also runs there on both sides (llama_logits
--device cuda against transformers on CUDA): in fp32, and in bf16 (a copy of the model cast to bf16).

Usage: test_families_transformers.py --tool PATH/llama_logits --workdir DIR [--case NAME ...]
Prints one line per check and "N passed, M failed"; exit status 1 on any failure. A case our tool
refuses (e.g. an unsupported model_type) fails with the tool's stderr.
"""
import copy
import os
import sys

import torch

import _families as F
from _common import (Checks, logits_tool, nf4_roundtrip_projections, parse_tool_args, run_tool, save_sharded,
                     tokens_arg)

# fp32 on both sides; the differences are the order of floating-point operations (our matmuls and
# attention vs transformers' eager/SDPA, one token per forward with a cache vs the whole row).
# Rounding error grows with the size of the values, and Gemma's sqrt(hidden) embedding scale gives
# logits of O(20) where the others are O(5), so the tolerance is per unit of the largest reference
# logit: 1e-4 * max(1, max|ref|) is ~1e3 fp32 ulps of it, while every ablation below (a feature
# skipped or done the wrong way) moves the logits by > 1.
ATOL_FP32_PER_UNIT = 1e-4
# NF4: our dequantization is bit-identical to torchao's (conformance.nf4_torchao), so the fp32
# tolerance applies; a thread-count-dependent last bit of the absmax mean moves weights by ~1 ulp.
ATOL_NF4_PER_UNIT = 1e-4
# On CUDA: fp32 GEMMs and reductions in another order than the CPU's (no TF32: torch's default
# for matmul), so twice the CPU tolerance; bf16 on both sides rounds every activation to 8 bits of
# mantissa (~4e-3 relative) in another order, so a few units of that, per unit of the largest logit.
ATOL_CUDA_FP32_PER_UNIT = 2e-4
ATOL_CUDA_BF16_PER_UNIT = 3e-2
# An ablation must move the reference logits by this many tolerances to count as exercised.
ABLATION_MARGIN = 100.0
PACKED = [11, 9]             # sums to SEQ; each sample longer than the window
DECODE_FROM = [5, 12]        # prefill lengths for the KV-cache check: below and above the window
GEN_PROMPTS = [5, 12]        # greedy generation prompt lengths
GEN_NEW = 16                 # new tokens: 5 + 16 and 12 + 16 both pass the window of 8
GEN_GROUP = 2                # batched generation: sequences per prompt (GRPO's num_generations)
# Greedy ids must be equal. A divergence is excused only where transformers' top-2 logits at that
# step are closer than two tolerances (each side may be off by one, so such a pair can swap).
GEN_CASES = {"llama": {}, "qwen2_untied": {}, "gemma2": {"tie_word_embeddings": False},
             "gemma3": {"tie_word_embeddings": False}, "mistral_sliding": {}, "phi3": {},
             "smollm3": {}, "olmo2": {}, "olmo3": {}, "qwen3_5": {}, "gemma4": {}, "qwen3_moe": {}, "mixtral": {},
             "qwen3_5_moe": {}, "gemma4_moe": {}, "gpt_oss": {}}

# Tied Gemma embeddings (scaled by 16) make a random model repeat its input token forever, which
# would test nothing about the cache; untied, the greedy continuation varies.


def atol_for(ref, per_unit):
    return per_unit * max(1.0, ref.abs().max().item())


def reference_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


def check_ablations(checks, name, model, tokens, ref):
    atol = atol_for(ref, ATOL_FP32_PER_UNIT)
    for label, overrides, edit in F.CASES[name]["ablations"]:
        moved = (reference_logits(F.ablated(name, model, overrides, edit), tokens) - ref).abs().max().item()
        checks.check(f"{name} reference exercises: {label}", moved > ABLATION_MARGIN * atol,
                     f"max|ablated - ref| {moved:.3e} (want > {ABLATION_MARGIN:g} x atol {atol:.1e})")


def forward_reference(model32, model64, tokens):
    """transformers' float64 logits and the tolerance for ours: the fp32 one per unit, or twice
    transformers' own fp32 distance from them where the case rounds worse than that (gemma4_vision:
    tied, sqrt(hidden)-scaled embeddings put transformers' fp32 6e-4 from float64 with logits of 3)."""
    ref = reference_logits(model64, tokens)
    own = (reference_logits(model32, tokens) - ref).abs().max().item()
    return ref, max(atol_for(ref, ATOL_FP32_PER_UNIT), 2.0 * own)


def as_float64(model):
    """A float64 copy; a MoE model's experts run eager there (transformers' default grouped_mm has no
    float64 kernel; in float64 the two sum the same products)."""
    model64 = copy.deepcopy(model).double()
    if getattr(model64.config, "_experts_implementation", None) not in (None, "eager"):
        model64.set_experts_implementation("eager")
    return model64


def check_forwards(checks, args, name, model, ckpt, tokens):
    """fp32, packed and decode against transformers in float64; each step fails on its own.

    Against float64 the tolerance bounds our rounding alone; against transformers' fp32 it would
    also have to hold theirs, which can be as large as ours."""
    model64 = as_float64(model)
    ref, atol = forward_reference(model, model64, tokens)
    out = lambda tag: os.path.join(args.workdir, f"{name}_{tag}.safetensors")
    try:
        checks.compare(f"{name} fp32", logits_tool(args.tool, ckpt, tokens, out("fp32")), ref, atol)
    except Exception as e:
        checks.crashed(f"{name} fp32", e)
    try:
        cut = PACKED[0]
        parts = [forward_reference(model, model64, t) for t in (tokens[:, :cut], tokens[:, cut:])]
        ref_packed = torch.cat([r for r, _ in parts], 1)
        ours = logits_tool(args.tool, ckpt, tokens, out("packed"), extra=["--packed", ",".join(map(str, PACKED))])
        checks.compare(f"{name} packed {PACKED}", ours, ref_packed, max(a for _, a in parts))
    except Exception as e:
        checks.crashed(f"{name} packed", e)
    for p in DECODE_FROM:
        try:
            ours = logits_tool(args.tool, ckpt, tokens, out(f"decode{p}"), extra=["--decode-from", str(p)])
            checks.compare(f"{name} kv-cache decode from {p}", ours, ref, atol)
        except Exception as e:
            checks.crashed(f"{name} kv-cache decode from {p}", e)


def check_cuda(checks, args, name, model, ckpt, tokens):
    """The forward on CUDA, both sides, fp32 then bf16; the model itself stays on the CPU in fp32."""
    for dtype, tag, per_unit in [(torch.float32, "fp32", ATOL_CUDA_FP32_PER_UNIT),
                                 (torch.bfloat16, "bf16", ATOL_CUDA_BF16_PER_UNIT)]:
        try:
            on_gpu = copy.deepcopy(model).to("cuda", dtype)
            # .to(bf16) also rounds the RoPE inverse frequencies, which transformers computes and
            # keeps in fp32 when it loads in bf16 (and ours stay fp32): put the fp32 ones back.
            cpu_modules = dict(model.named_modules())
            for mname, m in on_gpu.named_modules():
                for buf in ("inv_freq", "original_inv_freq"):
                    if isinstance(getattr(m, buf, None), torch.Tensor):
                        setattr(m, buf, getattr(cpu_modules[mname], buf).to("cuda"))
            with torch.no_grad():
                ref = on_gpu(tokens.cuda()).logits.float().cpu()
            del on_gpu
            ours = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, f"{name}_cuda_{tag}.safetensors"),
                               extra=["--device", "cuda", "--dtype", tag])
            checks.compare(f"{name} cuda {tag}", ours, ref, atol_for(ref, per_unit))
        except Exception as e:
            checks.crashed(f"{name} cuda {tag}", e)


def check_fused(checks, args, name, model, tokens, ref):
    """A MoE checkpoint with fused 3-D expert tensors (save_original_format=False: transformers' own
    modules' names) gives the logits of the one with a tensor per expert."""
    try:
        ckpt = os.path.join(args.workdir, f"{name}_fused")
        model.save_pretrained(ckpt, safe_serialization=True, save_original_format=False)
        from safetensors import safe_open
        with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
            fused = [k for k in f.keys() if k.endswith("experts.gate_up_proj")]
        checks.check(f"{name} fused checkpoint holds 3-D experts", len(fused) > 0, f"{len(fused)} gate_up_proj tensors")
        ours = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, f"{name}_fused.safetensors"))
        checks.compare(f"{name} fused experts fp32", ours, ref, atol_for(ref, ATOL_FP32_PER_UNIT))
    except Exception as e:
        checks.crashed(f"{name} fused", e)


def check_split(checks, args, name, model, tokens, ref):
    """A MoE checkpoint with one tensor per expert and projection (the layout transformers does not
    write for this family) gives the logits of the fused one."""
    try:
        ckpt = os.path.join(args.workdir, f"{name}_split")
        n = F.save_split_experts(model, ckpt)
        checks.check(f"{name} split checkpoint holds a tensor per expert", n > 0, f"{n} per-expert tensors")
        ours = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, f"{name}_split.safetensors"))
        checks.compare(f"{name} per-expert experts fp32", ours, ref, atol_for(ref, ATOL_FP32_PER_UNIT))
    except Exception as e:
        checks.crashed(f"{name} split", e)


def check_mxfp4(checks, args, name, model, tokens):
    """gpt-oss's Hub form: the experts in MXFP4, packed by the test from the OCP definition. transformers'
    own decode (convert_moe_packed_tensors) equals the OCP decode of the packed bytes; our logits on that
    checkpoint equal those of transformers' model loaded from it (dequantized on the CPU), in fp32 and with
    the NF4 base; a scales tensor of the wrong shape is refused naming its file and key."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    ckpt = os.path.join(args.workdir, f"{name}_mxfp4")
    try:
        F.save_mxfp4(model, ckpt)
        sd = load_file(os.path.join(ckpt, "model.safetensors"))
        key = "model.layers.0.mlp.experts.gate_up_proj"
        theirs = convert_moe_packed_tensors(sd[key + "_blocks"], sd[key + "_scales"], dtype=torch.float32)
        ocp = F.mxfp4_unpack(sd[key + "_blocks"], sd[key + "_scales"]).transpose(1, 2)
        checks.check(f"{name} mxfp4: transformers' decode = the OCP decode", torch.equal(theirs, ocp),
                     f"max|diff| {(theirs - ocp).abs().max().item():.3e}")
        ref_model = F.load_mxfp4(ckpt)
        ref, atol = forward_reference(ref_model, as_float64(ref_model), tokens)
        ours = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, f"{name}_mxfp4.safetensors"))
        checks.compare(f"{name} mxfp4 experts fp32", ours, ref, atol)
        nf4_roundtrip_projections(ref_model)
        ref_nf4 = reference_logits(ref_model, tokens)
        ours = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, f"{name}_mxfp4_nf4.safetensors"), nf4=True)
        checks.compare(f"{name} mxfp4 experts nf4", ours, ref_nf4, atol_for(ref_nf4, ATOL_NF4_PER_UNIT))
        bad = key.replace("layers.0", "layers.1").replace("gate_up_proj", "down_proj") + "_scales"
        sd[bad] = sd[bad][:, :-1].contiguous()
        save_file(sd, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
        try:
            logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, f"{name}_mxfp4_bad.safetensors"))
            checks.check(f"{name} mxfp4 scales of the wrong shape refused", False, "loaded")
        except RuntimeError as e:
            checks.check(f"{name} mxfp4 scales of the wrong shape refused", "model.safetensors" in str(e) and bad in str(e),
                         str(e)[:300])
    except Exception as e:
        checks.crashed(f"{name} mxfp4", e)


def check_nf4(checks, args, name, model, ckpt, tokens):
    try:
        nf4_roundtrip_projections(model)
        ref = reference_logits(model, tokens)
        # Our tool quantizes the original fp32 checkpoint itself.
        ours = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, f"{name}_nf4.safetensors"), nf4=True)
        checks.compare(f"{name} nf4", ours, ref, atol_for(ref, ATOL_NF4_PER_UNIT))
    except Exception as e:
        checks.crashed(f"{name} nf4", e)


def reference_greedy(model, prompts):
    """transformers' greedy decoding of [rows, P] prompts by full forwards (no cache: the definition the
    cached decoders must meet) -> ids [rows, GEN_NEW] and each step's top-2 logit gap [rows, GEN_NEW]."""
    seq, gaps = prompts.clone(), []
    with torch.no_grad():
        for _ in range(GEN_NEW):
            last = model(seq, use_cache=False).logits[:, -1].float()
            top2 = last.topk(2).values
            gaps.append(top2[:, 0] - top2[:, 1])
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
    return seq[:, prompts.size(1):], torch.stack(gaps, 1)


def compare_ids(checks, label, ours, ref, gaps, tie_gap):
    ours, ref = ours.tolist(), ref.tolist()
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if first is None and len(ours) == len(ref):
        return checks.check(label, True, f"{len(ref)} ids equal: {ref}")
    if first is not None and gaps[first].item() < tie_gap:
        return checks.check(label, True, f"equal up to step {first}, where the reference's top-2 gap "
                                         f"{gaps[first].item():.1e} < {tie_gap:.1e} (a near tie)")
    return checks.check(label, False, f"first difference at step {first}: ours {ours} ref {ref}")


def check_generation(checks, args, name, seed):
    overrides = GEN_CASES[name]
    model = F.build(name, seed, **overrides)
    ckpt = os.path.join(args.workdir, f"{name}_gen")
    save_sharded(model, ckpt)
    g = torch.Generator().manual_seed(seed)
    batch = []  # (prompt [P], reference ids, gaps, tie gap) of every prompt, for the batched check
    for plen in GEN_PROMPTS:
        prompts = torch.randint(0, F.COMMON["vocab_size"], (2, plen), generator=g)
        window = f" (window {F.WINDOW})" if "sliding_window" in F.CASES[name]["kw"] else ""
        label = f"{name}{' untied' if overrides else ''} generate {plen}+{GEN_NEW}{window}"
        ref_ids, ref_gaps = reference_greedy(model, prompts)
        refs = [(ref_ids[r], ref_gaps[r]) for r in range(2)]
        atol = ATOL_FP32_PER_UNIT * max(1.0, reference_logits(model, prompts).abs().max().item())
        for r in range(2):
            batch.append((prompts[r], refs[r][0], refs[r][1], 2 * atol))
        try:
            out = os.path.join(args.workdir, f"{name}_gen{plen}.safetensors")
            ours = run_tool([args.tool, "--checkpoint", ckpt, "--tokens", tokens_arg(prompts), "--dtype", "fp32",
                             "--generate", GEN_NEW, "--out", out], out)["ids"]
            for r in range(2):
                compare_ids(checks, f"{label} row {r}", ours[r], refs[r][0], refs[r][1], 2 * atol)
        except Exception as e:
            checks.crashed(label, e)
    check_batched_generation(checks, args, name, ckpt, batch)


def check_batched_generation(checks, args, name, ckpt, batch):
    """One generate_batch over prompts of different lengths, GEN_GROUP sequences each."""
    label = f"{name} generate_batch {'+'.join(str(len(p)) for p, *_ in batch)} x{GEN_GROUP}"
    try:
        width = max(len(p) for p, *_ in batch)
        rows = torch.zeros(len(batch), width, dtype=torch.long)  # the tail past each length is unused
        for r, (p, *_) in enumerate(batch):
            rows[r, :len(p)] = p
        out = os.path.join(args.workdir, f"{name}_gen_batch.safetensors")
        ours = run_tool([args.tool, "--checkpoint", ckpt, "--tokens", tokens_arg(rows), "--dtype", "fp32",
                         "--generate", GEN_NEW, "--batch-lengths", ",".join(str(len(p)) for p, *_ in batch),
                         "--generations", GEN_GROUP, "--out", out], out)["ids"]
        for i in range(len(batch) * GEN_GROUP):
            _, ref, gaps, tie = batch[i // GEN_GROUP]
            compare_ids(checks, f"{label} sequence {i}", ours[i], ref, gaps, tie)
    except Exception as e:
        checks.crashed(label, e)


def main():
    args = parse_tool_args(lambda ap: ap.add_argument("--case", action="append", choices=sorted(F.CASES),
                                                     help="run only these cases"))
    checks = Checks()
    names = args.case or list(F.CASES)
    for i, name in enumerate(F.CASES):
        if name not in names:
            continue
        seed = 2000 + i
        try:
            model = F.build(name, seed)
            ckpt = os.path.join(args.workdir, name)
            shards = save_sharded(model, ckpt)
            checks.check(f"{name} checkpoint sharded", shards >= 2, f"{shards} shards")
            g = torch.Generator().manual_seed(seed)
            tokens = torch.randint(0, F.COMMON["vocab_size"], (2, F.SEQ), generator=g)
            check_ablations(checks, name, model, tokens, reference_logits(model, tokens))
            check_forwards(checks, args, name, model, ckpt, tokens)
            if torch.cuda.is_available():
                check_cuda(checks, args, name, model, ckpt, tokens)
            if name in F.FUSED_CASES:
                check_fused(checks, args, name, model, tokens, reference_logits(model, tokens))
            if name in F.SPLIT_CASES:
                check_split(checks, args, name, model, tokens, reference_logits(model, tokens))
            if name == "gpt_oss":
                check_mxfp4(checks, args, name, model, tokens)
            check_nf4(checks, args, name, model, ckpt, tokens)  # last: rounds the model's weights
            if name in GEN_CASES:
                check_generation(checks, args, name, seed)
        except Exception as e:
            checks.crashed(name, e)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
