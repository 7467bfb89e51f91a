"""Conformance: `qlora gguf --type q4_k_m | q5_k_m | q6_k | q8_0 | q4_0` against llama.cpp's own quantizer
(llama-cpp-python's llama_model_quantize with its default mix: not pure, no importance matrix), run on
our f32 file of the same checkpoint:

1. every tensor has the type llama.cpp chose and the same bytes (the k-quant and legacy encoders, and
   the per-tensor mix: the output head, attn_v/ffn_down in the layers llama.cpp gives more bits, its
   counters, the fallbacks for rows that are not whole 256-blocks, the tied-embeddings head), and
   general.file_type is llama.cpp's;
2. models: the real SmolLM2-135M-Instruct (hidden 576, not whole 256-blocks: the fallbacks, with
   k-quants on ffn_down only, tied embeddings); a random tiny Llama whose rows ARE whole 256-blocks
   (8 layers, GQA, untied: every k-quant type); the same with edge-case rows in every matrix (zeros of
   both signs, constants, one sign only, magnitudes 1e-30 to 1e4, outliers, a zero sub-block); an
   80-layer GQA tiny Llama for q4_k_m (llama.cpp's "70B" rule: attn_v in q5_K);
3. llama.cpp loads each file: its logits on a prompt equal those on its own quantizer's file, and stay
   within a loose bound of the f16 file's.

Why the f32 file: llama.cpp quantizes whatever floats its input holds. From an f16 file it would
quantize f16-rounded weights, while qlora quantizes the checkpoint's own values; from our f32 file
both quantize the same floats, so the bytes must be equal, not just close. SmolLM2's checkpoint is
bf16, which f16 holds exactly but below f16's normal range: llama.cpp's file from our f16 file
matches ours in every row f16 represents exactly, and the rows that differ are all rows with such
tiny weights (checked, with their largest dequantized difference printed).

    python tests/conformance/test_gguf_kquants.py --tool build/qlora --workdir build/conformance_gguf_kquants
"""
import ctypes
import functools
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
from gguf import GGUFReader, quants

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Checks, parse_tool_args  # noqa: E402
from smollm2 import smollm2_dir  # noqa: E402

TYPES = ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0"]
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
PROMPT = "The history of the Roman Empire is long and"
# Max |logit - the f16 file's logit| over the prompt's positions and the vocabulary, measured
# (llama-cpp-python 0.3.36) and then loosened ~1.5x: they catch a wrong layout or scale,
# not a rounding difference. SmolLM2 (logits up to ~31) is fragile at 135M parameters: q8_0 moves
# its logits by ~1, the 4-bit types by 5 (q4_k_m) to 14 (q4_0); the tiny random Llamas' logits
# are ~1 at most.
LOGIT_TOL = {"smollm2": {"q8_0": 1.5, "q6_k": 4.5, "q5_k_m": 7.0, "q4_k_m": 8.0, "q4_0": 20.0},
             "tiny": {"q8_0": 0.05, "q6_k": 0.12, "q5_k_m": 0.25, "q4_k_m": 0.35, "q4_0": 0.5}}

CHECKS = Checks()


def check(ok, what):
    return CHECKS.check(what, ok, "ok" if ok else "differs")


def ftype(t):
    import llama_cpp
    return getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{t.upper()}")


def llama_quantize(src, out, t):
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = ftype(t), False, 2
    return llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))


@functools.lru_cache(maxsize=None)
def reader(path):
    """The gguf package's reader of a file, made once per file: it parses every metadata array (SmolLM2's
    49,152 tokens and 48,900 merges) element by element, seconds per file."""
    return GGUFReader(path)


def tensors(path):
    return {t.name: t for t in reader(path).tensors}


def raw(t):
    return np.asarray(t.data).view(np.uint8).ravel()


def file_type(path):
    return int(reader(path).fields["general.file_type"].contents())


def export(tool, d, t, out):
    r = subprocess.run([tool, "gguf", d, "--type", t, "-o", out], capture_output=True, text=True)
    check(r.returncode == 0, f"qlora gguf --type {t}: {r.stdout.strip() or r.stderr.strip()}")
    return out


def compare_with_llama_cpp(name, f32, ours, t, seen):
    """llama.cpp's quantizer on our f32 file: the same type and bytes per tensor."""
    theirs_path = os.path.join(os.path.dirname(ours), f"llama-quantize-{name}-{t}.gguf")
    rc = llama_quantize(f32, theirs_path, t)
    if not check(rc == 0, f"{name} {t}: llama_model_quantize on our f32 file returns 0 (rc {rc})"):
        return
    a, b = tensors(ours), tensors(theirs_path)
    wrong_type = [n for n in b if n not in a or a[n].tensor_type != b[n].tensor_type]
    wrong_type += [n for n in a if n not in b]
    same = [n for n in b if n in a and a[n].tensor_type == b[n].tensor_type and np.array_equal(raw(a[n]), raw(b[n]))]
    counts = {}
    for n in b:
        counts[b[n].tensor_type.name] = counts.get(b[n].tensor_type.name, 0) + 1
        seen.add(b[n].tensor_type.name)
    detail = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    check(not wrong_type, f"{name} {t}: every tensor's type is llama.cpp's ({detail}; differ: "
          f"{[(n, a[n].tensor_type.name if n in a else None, b[n].tensor_type.name if n in b else None) for n in wrong_type[:3]]})")
    differ = [n for n in b if n not in same]
    check(not differ and len(a) == len(b),
          f"{name} {t}: {len(same)}/{len(b)} tensors byte for byte equal to llama.cpp's ({differ[:3]})")
    check(file_type(ours) == file_type(theirs_path),
          f"{name} {t}: general.file_type {file_type(ours)} is llama.cpp's {file_type(theirs_path)}")


def logits(path, ids):
    """llama.cpp's logits at every position of `ids`. Without its extra CPU buffer types (weight
    repacking, AMX): this llama-cpp-python build crashes in them on any quantized file here, its own
    quantizer's files included; the plain CPU kernels compute the same model."""
    import llama_cpp
    import llama_cpp.llama_cpp as api
    defaults = api.llama_model_default_params

    def plain():
        p = defaults()
        p.use_extra_bufts = False
        return p
    api.llama_model_default_params = plain
    try:
        llm = llama_cpp.Llama(model_path=path, logits_all=True, verbose=False, n_ctx=128)
    finally:
        api.llama_model_default_params = defaults
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)])
    llm.close()
    return out


def check_logits(name, kind, paths, ids):
    """llama.cpp on each quantized file: the logits it gives on its own quantizer's file, exactly, and
    within a loose bound of the f16 file's."""
    ref = logits(paths["f16"], ids)
    for t in TYPES:
        ours = logits(paths[t], ids)
        theirs = logits(os.path.join(os.path.dirname(paths[t]), f"llama-quantize-{name}-{t}.gguf"), ids)
        check(np.array_equal(ours, theirs), f"{name} {t}: llama.cpp's logits on our file equal those on its own "
              f"quantizer's (max diff {np.abs(ours - theirs).max():.3g})")
        diff = float(np.abs(ours - ref).max())
        tol = LOGIT_TOL[kind][t]
        check(np.isfinite(diff) and diff < tol,
              f"{name} {t}: logits within {tol} of the f16 file's (max diff {diff:.3g}, |logits| up to "
              f"{np.abs(ref).max():.3g})")


def check_from_f16(name, paths, f32):
    """llama.cpp's quantizer on our f16 file (what a user running llama-quantize on it gets): the same
    types, and the same bytes in every row whose weights f16 represents exactly; a row differs only
    where f16 rounding changed a weight (SmolLM2's bf16 weights below f16's normal range, ~6e-5)."""
    for t in ("q4_k_m", "q8_0"):
        theirs_path = os.path.join(os.path.dirname(paths[t]), f"llama-quantize-{name}-{t}-from-f16.gguf")
        if not check(llama_quantize(paths["f16"], theirs_path, t) == 0, f"{name} {t}: llama_model_quantize on our f16 file"):
            continue
        a, b, x = tensors(paths[t]), tensors(theirs_path), tensors(f32)
        types_same = all(n in a and a[n].tensor_type == b[n].tensor_type for n in b)
        unexplained, rows_differ, rows, worst = [], 0, 0, 0.0
        for n in b:
            w = np.asarray(x[n].data, dtype=np.float32)
            w = w.reshape(-1, w.shape[-1])
            changed = (w.astype(np.float16).astype(np.float32) != w).any(axis=1)
            ra, rb = raw(a[n]).reshape(w.shape[0], -1), raw(b[n]).reshape(w.shape[0], -1)
            differ = (ra != rb).any(axis=1)
            rows += len(differ)
            rows_differ += int(differ.sum())
            if (differ & ~changed).any():
                unexplained.append(n)
            if differ.any():
                qa = quants.dequantize(ra[differ], a[n].tensor_type)
                qb = quants.dequantize(rb[differ], b[n].tensor_type)
                worst = max(worst, float(np.abs(qa - qb).max() / max(np.abs(w).max(), 1e-30)))
        check(types_same and not unexplained,
              f"{name} {t} from our f16 file: llama.cpp's types; {rows - rows_differ}/{rows} rows byte for byte "
              f"equal, the {rows_differ} others all rows f16 rounding changed (unexplained: {unexplained[:3]}; their "
              f"largest dequantized difference {worst:.2e} of the tensor's max|w|)")


def tiny_llama(d, seed, layers=8, edge=False):
    """A random Llama whose rows are whole 256-blocks (hidden 256, ffn 512, 4 heads over 2 KV heads),
    with the Llama-2-like sentencepiece tokenizer of tests/data; `edge`: edge-case rows in every matrix."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512 if layers < 80 else 256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    if edge:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.dim() == 2:
                    edge_rows(p, g)
    model.save_pretrained(d)
    shutil.copy(os.path.join(DATA, "tokenizer", "tokenizer.model"), os.path.join(d, "tokenizer.model"))
    return d


def edge_rows(w, g):
    """The first rows of `w` replaced by rows that stress the encoders' corner cases."""
    cols = w.shape[1]
    normal = lambda: torch.randn(cols, generator=g)  # noqa: E731
    rows = [torch.zeros(cols), -torch.zeros(cols), torch.full((cols,), 0.5), torch.full((cols,), -3.0),
            -normal().abs(), normal().abs(), normal() * 1e-30, normal() * 1e-9, normal() * 1e-6,
            normal() * 1e4, normal() * 1e-2 + torch.where(torch.arange(cols) == 5, 1e3, 0.0),
            normal() * torch.where(torch.arange(cols) // 32 == 1, 0.0, 1.0),
            normal() * torch.where(torch.arange(cols) // 16 == 3, 1e-20, 1.0), torch.randint(-8, 8, (cols,), generator=g).float(),
            (normal() * 1e-2).to(torch.bfloat16).float(), normal().sign() * 0.02]
    for i, r in enumerate(rows[:w.shape[0]]):
        w[i] = r


def run_model(tool, workdir, name, d, types, kind, ids, seen):
    os.makedirs(os.path.join(workdir, name))
    paths = {t: export(tool, d, t, os.path.join(workdir, name, f"{name}-{t}.gguf")) for t in ["f32", "f16"] + types}
    for t in types:
        compare_with_llama_cpp(name, paths["f32"], paths[t], t, seen)
    if kind is not None:
        check_logits(name, kind, paths, ids)
    return paths



def main():
    a = parse_tool_args()
    import llama_cpp._logger
    llama_cpp._logger.set_verbose(False)  # llama.cpp's per-tensor log of each quantization: errors only
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    import sentencepiece as spm
    from transformers import AutoTokenizer
    seen = set()
    smol = smollm2_dir()
    ids = AutoTokenizer.from_pretrained(smol).encode(PROMPT)
    paths = run_model(a.tool, a.workdir, "smollm2", smol, TYPES, "smollm2", ids, seen)
    check_from_f16("smollm2", paths, paths["f32"])
    reader.cache_clear()  # done with SmolLM2's files (their memory maps)
    sp_ids = [1] + spm.SentencePieceProcessor(model_file=os.path.join(DATA, "tokenizer", "tokenizer.model")).encode(PROMPT)
    tiny = tiny_llama(os.path.join(a.workdir, "tiny-hf"), seed=7)
    run_model(a.tool, a.workdir, "tiny", tiny, TYPES, "tiny", sp_ids, seen)
    edge = tiny_llama(os.path.join(a.workdir, "edge-hf"), seed=8, edge=True)
    run_model(a.tool, a.workdir, "edge", edge, TYPES, None, sp_ids, seen)
    deep = tiny_llama(os.path.join(a.workdir, "deep-hf"), seed=9, layers=80)
    run_model(a.tool, a.workdir, "deep80", deep, ["q4_k_m"], None, sp_ids, seen)
    want = {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0", "Q4_0", "F32"}
    check(want <= seen, f"the comparisons covered every type qlora encodes ({sorted(seen)}; missing {sorted(want - seen)})")
    r = subprocess.run([a.tool, "gguf", smol, "--type", "q4_k_s"], capture_output=True, text=True)
    check(r.returncode == 1 and "q4_k_s" in r.stderr and "q4_k_m, q5_k_m, q6_k" in r.stderr,
          f"an unknown type is refused, naming the valid ones: {r.stderr.strip()}")
    return CHECKS.summary()


if __name__ == "__main__":
    sys.exit(main())
