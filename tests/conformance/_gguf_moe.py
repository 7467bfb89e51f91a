"""test_gguf_families.py's Mixture-of-Experts checks: the fused and per-expert layouts, LoRA on the experts,
gpt-oss's MXFP4 experts and its YaRN note, and the MoE refusals."""
import os
import shutil
import subprocess

import numpy as np
import torch

import _families
from _gguf_common import (CHECKS, check, check_llama_quantize_mix, edited_copy, hf_logits, llama_cpp_logits,
                          llama_cpp_model, prompt_ids, qlora_gguf, refused, rel_diff, tolerance)


def check_moe_fused(tool, name, d, model, tok):
    """The same model saved in transformers' in-memory (fused) layout, experts.gate_up_proj [E, 2I, H]
    and experts.down_proj [E, H, I], as a qlora merged export of a fused checkpoint writes it: the same
    GGUF logits (gate_up split into its gate and up halves)."""
    fused = d + "_fused"
    shutil.rmtree(fused, ignore_errors=True)
    shutil.copytree(d, fused, ignore=shutil.ignore_patterns("*.gguf", "*.safetensors", "adapter*", "transformers_reads"))
    model.save_pretrained(fused, save_original_format=False)
    from safetensors import safe_open
    with safe_open(os.path.join(fused, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    if not check(any(k.endswith("mlp.experts.gate_up_proj") for k in keys), f"{name}: the fused save holds "
                 f"experts.gate_up_proj ({[k for k in keys if 'experts' in k][:2]})"):
        return
    ids = prompt_ids(tok)
    ref = hf_logits(model, ids)
    r, out = qlora_gguf(tool, fused, "f32")
    if not check(r.returncode == 0, f"{name} fused: qlora gguf --type f32: {r.stderr.strip()[:300]}"):
        return
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(out), ids), ref)
    CHECKS.check(f"{name} fused experts: llama.cpp's logits on our f32 file equal transformers'",
                 diff < tolerance(name, "f32"), f"max|diff| / max(1, max|ref|) = {diff:.2e} (< {tolerance(name, 'f32'):g})")


def check_moe_split(tool, name, d, model, tok):
    """The same model saved with a tensor per expert and projection (experts.<e>.gate_proj / up_proj /
    down_proj), the layout transformers does not write for Gemma 4: the same GGUF logits (the experts
    restacked into ffn_gate_up_exps)."""
    split = d + "_split"
    shutil.rmtree(split, ignore_errors=True)
    shutil.copytree(d, split, ignore=shutil.ignore_patterns("*.gguf", "*.safetensors", "adapter*", "transformers_reads"))
    if not check(_families.save_split_experts(model, split) > 0, f"{name}: the split save holds per-expert tensors"):
        return
    ids = prompt_ids(tok)
    r, out = qlora_gguf(tool, split, "f32")
    if not check(r.returncode == 0, f"{name} split: qlora gguf --type f32: {r.stderr.strip()[:300]}"):
        return
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(out), ids), hf_logits(model, ids))
    CHECKS.check(f"{name} per-expert experts: llama.cpp's logits on our f32 file equal transformers'",
                 diff < tolerance(name, "f32"), f"max|diff| / max(1, max|ref|) = {diff:.2e} (< {tolerance(name, 'f32'):g})")


def check_expert_adapter(tool, name, d, model, tok, base_gguf, params):
    """A random PEFT LoRA on the experts (target_parameters: peft's stacked A [r*E, in], B [out, r*E])
    beside the attention: `qlora gguf --adapter` writes it per expert on ffn_*_exps, and llama.cpp with
    it on our f32 file of the base gives peft's logits."""
    import copy

    from peft import LoraConfig, get_peft_model
    torch.manual_seed(4)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=params,
                     init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(model), cfg).eval()
    with torch.no_grad():  # B non-zero and small: the adapted experts stay near the base's routing scale
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(0.5)
    label = "+".join(x.split(".")[-1] for x in params)
    adapter = os.path.join(d, f"adapter_experts_{label}")
    peft_model.save_pretrained(adapter)
    out = adapter + ".gguf"
    r = subprocess.run([tool, "gguf", adapter, "--adapter", "--base", d, "--type", "f32", "-o", out],
                       capture_output=True, text=True)
    if not check(r.returncode == 0, f"{name}: qlora gguf --adapter (experts: {label}): {(r.stdout or r.stderr).strip()[:300]}"):
        return
    ids = prompt_ids(tok)
    ref = hf_logits(peft_model, ids)
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(base_gguf, lora_path=out), ids), ref)
    moved = rel_diff(hf_logits(model, ids), ref)
    tol = tolerance(name, "f32")
    CHECKS.check(f"{name}: llama.cpp with our expert LoRA GGUF ({label}) on the base's f32 file gives peft's logits",
                 diff < tol < moved, f"{diff:.2e} (< {tol:g}; the adapter moves them by {moved:.2e})")


def check_gpt_oss_mxfp4(tool, work, src, model, tok):
    """gpt-oss's Hub form (experts in MXFP4, _families.save_mxfp4): our f32 file keeps the experts in llama.cpp's
    MXFP4 type, their codes moved, never decoded: gguf's own dequantization of them is the OCP decode of the
    checkpoint, bit for bit, and llama.cpp's logits equal transformers' reading of the checkpoint. A q8_0
    file holds llama-quantize's bytes of that f32 file."""
    import copy

    from gguf import GGUFReader, GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import load_file
    d = edited_copy(src, work, "gpt_oss_mxfp4")
    for f in os.listdir(d):
        if f.endswith(".safetensors") or f.endswith(".gguf"):
            os.remove(os.path.join(d, f))
    _families.save_mxfp4(model, d)
    r, out = qlora_gguf(tool, d, "f32")
    if not check(r.returncode == 0, f"gpt_oss mxfp4: qlora gguf --type f32: {r.stderr.strip()[:300]}"):
        return
    sd = load_file(os.path.join(d, "model.safetensors"))
    tensors = {x.name: x for x in GGUFReader(out).tensors}
    exact, types = True, set()
    for i in range(model.config.num_hidden_layers):
        stem = f"model.layers.{i}.mlp.experts."
        gate_up = _families.mxfp4_unpack(sd[stem + "gate_up_proj_blocks"], sd[stem + "gate_up_proj_scales"])
        down = _families.mxfp4_unpack(sd[stem + "down_proj_blocks"], sd[stem + "down_proj_scales"])
        for name, want in (("gate", gate_up[:, 0::2]), ("up", gate_up[:, 1::2]), ("down", down)):
            t = tensors[f"blk.{i}.ffn_{name}_exps.weight"]
            types.add(t.tensor_type.name)
            got = dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
            exact = exact and np.array_equal(got, want.numpy())
    check(types == {GGMLQuantizationType.MXFP4.name} and exact, f"gpt_oss mxfp4: the experts are MXFP4 in the f32 "
          f"file ({sorted(types)}) and gguf decodes them to the checkpoint's values exactly ({exact})")
    ids = prompt_ids(tok)
    theirs = _families.load_mxfp4(d)
    ref = hf_logits(theirs, ids)
    # ggml's CPU product of MXFP4 weights rounds the activations to q8_0 blocks (as with f16 weights it
    # rounds them to f16): the f16 tolerance. The same decoded values in f32 give the f32 one.
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(out), ids), ref)
    CHECKS.check("gpt_oss mxfp4: llama.cpp's logits on our f32 file (MXFP4 experts) equal transformers'",
                 diff < tolerance("gpt_oss", "f16"), f"{diff:.2e} (< {tolerance('gpt_oss', 'f16'):g})")
    dense = edited_copy(src, work, "gpt_oss_mxfp4_decoded")
    decoded = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in decoded.named_parameters():
            if n + "_blocks" in sd:  # [E, in, out]: the blocks' [E, out, in] transposed
                p.copy_(_families.mxfp4_unpack(sd[n + "_blocks"], sd[n + "_scales"]).transpose(1, 2))
    decoded.save_pretrained(dense)
    r, dense_out = qlora_gguf(tool, dense, "f32")
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(dense_out), ids), ref) if r.returncode == 0 else float("inf")
    CHECKS.check("gpt_oss mxfp4: the same experts decoded, in an f32 file: llama.cpp's logits equal transformers'",
                 diff < tolerance("gpt_oss", "f32"), f"{diff:.2e} (< {tolerance('gpt_oss', 'f32'):g})")
    check_llama_quantize_mix(tool, "gpt_oss mxfp4", d, out, "q8_0", requantize=True)


def check_gpt_oss_truncate_note(tool, work, src):
    """gpt-oss's own YaRN (truncate false): written, with a note that ggml rounds the ramp's ends."""
    d = edited_copy(src, work, "gpt_oss_untruncated", lambda c: c["rope_parameters"].update(truncate=False))
    r, _ = qlora_gguf(tool, d, "f32")
    check(r.returncode == 0 and "truncate is false" in r.stderr, f"gpt_oss with YaRN truncate false: written with a "
          f"note: {r.stderr.strip()[:300]}")


def check_moe_refusals(tool, work, dirs):
    if "gpt_oss" in dirs:
        refused(tool, edited_copy(dirs["gpt_oss"], work, "refuse_gpt_oss_limit", lambda c: c.update(swiglu_limit=1.0)),
                "gpt_oss with swiglu_limit 1", "swiglu_limit", "7")
        refused(tool, edited_copy(dirs["gpt_oss"], work, "refuse_gpt_oss_layers", lambda c: c.update(
            layer_types=["full_attention", "sliding_attention"])), "gpt_oss with the window on odd layers",
            "layer_types", "layer 0")
        check_gpt_oss_truncate_note(tool, work, dirs["gpt_oss"])
    if "qwen3_moe" in dirs:
        refused(tool, edited_copy(dirs["qwen3_moe"], work, "refuse_qwen3_moe_norm", lambda c: c.update(
            norm_topk_prob=False)), "qwen3_moe with norm_topk_prob false", "norm_topk_prob", "renormalises")
        refused(tool, edited_copy(dirs["qwen3_moe"], work, "refuse_qwen3_moe_dense", lambda c: c.update(
            mlp_only_layers=[1])), "qwen3_moe with a dense layer (mlp_only_layers)", "mlp_only_layers", "layer 1")
        refused(tool, edited_copy(dirs["qwen3_moe"], work, "refuse_qwen3_moe_step", lambda c: c.update(
            decoder_sparse_step=2)), "qwen3_moe with decoder_sparse_step 2", "decoder_sparse_step", "layer 0")
