"""What test_gguf_families.py's checks share: the prompt, the check counter, `qlora gguf`, llama.cpp and
transformers logits, the tolerances (each written beside its reason), edited copies and refusals."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Checks  # noqa: E402

PROMPT = "The history of the Roman Empire is long, 1234"
GREEDY = 24

CHECKS = Checks()


def check(ok, what):
    return CHECKS.check(what, ok, "ok" if ok else "differs")


def qlora_gguf(tool, d, qtype, out=None):
    out = out or os.path.join(d, f"model-{qtype}.gguf")
    r = subprocess.run([tool, "gguf", d, "--type", qtype, "-o", out], capture_output=True, text=True)
    return r, out


def prompt_ids(tok):
    ids = tok.encode(PROMPT)
    return ([tok.bos] if tok.bos is not None else []) + ids


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def llama_cpp_model(path, **kw):
    """llama.cpp on CPU with an f32 KV cache (its default f16 cache would round keys and values)."""
    import llama_cpp
    return llama_cpp.Llama(model_path=path, logits_all=True, verbose=False, n_ctx=256, n_threads=2,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, **kw)


def llama_cpp_logits(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def llama_cpp_greedy(llm, ids, n):
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        llm.eval([t])
    return out


def hf_greedy(model, ids, n):
    with torch.no_grad():
        g = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    return g[0][len(ids):].tolist()


def rel_diff(ours, ref):
    return float(np.abs(ours - ref).max()) / max(1.0, float(np.abs(ref).max()))


# f32: only the order of floating-point operations differs (ggml's kernels vs torch): ~1e-6 of the
# largest logit. f16: the weights rounded to 11 bits move random tiny models' logits by ~1e-3 of it.
TOL = {"f32": 1e-4, "f16": 2e-2}
# Gemma's GeLU: ggml's CPU kernel reads it from an f16 table, ~1e-3 of the largest logit.
TOL_GELU = {"f32": 5e-3, "f16": 2e-2}


# Qwen3.5 in f16: rounding this random case's weights to f16 alone moves transformers' own logits by
# 1.4e-2 of the largest (mostly the embedding and in_proj_qkv: the DeltaNet's L2-normalised 32-element
# q/k and its recurrence amplify it), and ggml's f16 products round activations too (2.0e-2 in all).
# A lost transform moves them by O(1) (the ablations). f32 is as tight as the others.
TOL_QWEN35 = {"f32": 1e-4, "f16": 5e-2}


# Gemma 4: this random case amplifies a perturbation about a hundredfold (rounding its weights to f16,
# 5e-4 relative, moves transformers' own logits by 5.3e-2 of the largest), and its GeLUs (the MLP's and
# the per-layer inputs' gate) read ggml's f16 table: its f32 logits land at 5.0e-3, the Hub form's
# (tied head, other weights) at 8.7e-3. A lost feature moves them by O(1) (the ablations).
TOL_GEMMA4 = {"f32": 2e-2, "f16": 1e-1}
# Its random LoRA (B non-zero, scale 2) grows the activations and with them the table's rounding: an
# adapter on any one target alone lands at 0.7-1.5e-2, on all of them at 1.6e-2; the adapter moves the
# logits by 1.5 or more.
TOL_GEMMA4_ADAPTER = 3e-2


# Qwen3.5-MoE in f16: rounding this random case's weights to f16 alone moves transformers' own logits by
# 9.0e-2 of the largest (a token whose experts nearly tie can route elsewhere), so its f16 file is compared
# with transformers run on the weights that file holds (every matrix rounded to f16; the router, the
# shared expert's gate and the conv in f32, as the file keeps them): 6.8e-3 apart, ggml's f16 products
# rounding activations too. Against the unrounded model a lost transform moves them by O(1) (ablations).
F16_ROUNDED_REFERENCE = {"qwen35moe": 2e-2}


def f16_weights(model):
    """A copy of `model` with the weights an f16 GGUF stores in f16 rounded to it."""
    import copy
    other = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in other.named_parameters():
            if p.dim() >= 2 and not n.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight")):
                p.copy_(p.half().float())
    return other


# gpt-oss in f16: rounding this case's weights to f16 alone moves transformers' own logits by 1.2e-2 of
# the largest (gates near the clamp, routing near ties), and ggml's f16 products round activations too
# (2.8e-2 in all); a lost feature moves them by 0.2 or more (the ablations). f32 is as tight as the others.
TOL_GPT_OSS = {"f32": 1e-4, "f16": 5e-2}


def tolerance(name, qtype):
    if name == "gpt_oss":
        return TOL_GPT_OSS[qtype]
    if name.startswith("qwen35"):
        return TOL_QWEN35[qtype]
    if name.startswith("gemma4"):
        return TOL_GEMMA4[qtype]
    return (TOL_GELU if name.startswith("gemma") else TOL)[qtype]


def check_llama_quantize_mix(tool, name, d, f32_path, qtype="q4_k_m", requantize=False):
    """`qlora gguf --type q4_k_m` gives every tensor the type and bytes llama.cpp's own quantizer makes
    of our f32 file (for Qwen3.5: ssm_conv1d kept in f32, ssm_out's 128-wide rows in q5_0; for MoE: the
    3-D expert tensors, the router kept in f32, attn_v/attn_k in q8_0 with 8 experts). `requantize`: the
    f32 file holds MXFP4 experts, which llama-quantize decodes only when allowed to (--allow-requantize)."""
    import ctypes

    import llama_cpp
    from gguf import GGUFReader
    r, ours_path = qlora_gguf(tool, d, qtype)
    if not check(r.returncode == 0, f"{name}: qlora gguf --type {qtype}: {r.stderr.strip()[:200]}"):
        return
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[qtype]
    params.pure, params.nthread, params.allow_requantize = False, 2, requantize
    theirs_path = os.path.join(d, f"llama-quantize-{qtype}.gguf")
    rc = llama_cpp.llama_model_quantize(f32_path.encode(), theirs_path.encode(), ctypes.byref(params))
    theirs = {x.name: x for x in GGUFReader(theirs_path).tensors}
    ours = {x.name: x for x in GGUFReader(ours_path).tensors}
    differ = [n for n in ours if n not in theirs or theirs[n].tensor_type != ours[n].tensor_type or
              not np.array_equal(np.asarray(theirs[n].data).view(np.uint8), np.asarray(ours[n].data).view(np.uint8))]
    check(rc == 0 and len(theirs) == len(ours) and not differ,
          f"{name}: our {qtype} file is llama-quantize's of our f32 file, type and bytes ({len(ours)} tensors; "
          f"differ: {differ[:4]})")


def refused(tool, d, label, *words):
    out = os.path.join(d, "refused.gguf")
    r, _ = qlora_gguf(tool, d, "f16", out)
    msg = r.stderr.strip()
    check(r.returncode != 0 and all(w in msg for w in words) and not os.path.exists(out)
          and not os.path.exists(out + ".tmp"), f"refused: {label}: {msg[:300]}")


def edited_copy(src, work, name, edit_config=None):
    d = os.path.join(work, name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.gguf"))
    if edit_config:
        p = os.path.join(d, "config.json")
        with open(p) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(p, "w") as f:
            json.dump(cfg, f)
    return d
