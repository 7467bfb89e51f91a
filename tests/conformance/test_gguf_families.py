"""Conformance: `qlora gguf` writes every family qlora trains, checked by llama.cpp itself (llama-cpp-python).

Each family is a tiny random model written by transformers (_families.py), with a tokenizer of that
family's kind, converted with `qlora gguf --type f32` and `--type f16`:

  llama3   Llama-3 layout: llama3 RoPE scaling (a rope_freqs tensor), byte-level BPE "llama-bpe"
           (the tiktoken fixture in tests/data as tokenizer.json)
  mistral  arch llama, sentencepiece (tests/data/tokenizer); with a window shorter than the context,
           the file's context_length is the window and logits agree inside it
  qwen2    q/k/v biases, tied head, Qwen's real BPE ("qwen2", its first ranks)
  qwen3    q/k norms, head_dim * heads > hidden
  gemma2   soft-caps, sliding window, four norms a block (stored 1 + w), a Gemma-like sentencepiece
  gemma3   q/k norms, 5 local : 1 global layers with their own RoPE bases; with linear scaling; and a
           Hub-style Gemma3ForConditionalGeneration, of which only the language model is written
  phi3     fused qkv and gate_up, sliding window
  olmo3    post-norms, q/k norms over all heads, 3 sliding : 1 full layers, YaRN on the full ones
  qwen35   Qwen3.5: Gated DeltaNet layers (value heads reordered for llama.cpp, A_log as -exp, conv1d
           squeezed, 1 + w norms), a gated full-attention layer with partial rotary; and the Hub's
           Qwen3_5ForConditionalGeneration, of which only the language model is written
  gemma4   Gemma 4: sliding and full layers of their own head sizes and kv heads, keys as values on
           the full layers (attention_k_eq_v), proportional RoPE, KV-shared layers with double-wide
           MLPs, per-layer inputs, layer scalars, a final soft-cap; and the Hub's
           Gemma4ForConditionalGeneration, of which only the language model is written
  qwen3_moe  Qwen3-MoE as llama.cpp's qwen3moe: the router as ffn_gate_inp, each layer's experts
           stacked into ffn_{gate,up,down}_exps, from transformers' one tensor per expert and from
           the fused experts.gate_up_proj / down_proj; q4_k_m and q8_0 are llama-quantize's of our
           f32 file; a LoRA on the experts (peft's target_parameters) applied by llama.cpp
  mixtral  Mixtral as llama.cpp's llama with expert_count (block_sparse_moe.experts.<e>.w1/w3/w2),
           fused too; q4_k_m and q8_0 as llama-quantize makes them; the experts' LoRA too
  qwen35moe  Qwen3.5-MoE as llama.cpp's qwen35moe: qwen35's layers with the experts as qwen3_moe's and
           the shared expert as ffn_{gate,up,down}_shexp scaled by ffn_gate_inp_shexp; the same checks
           as qwen3_moe, its LoRA over the shared expert and the DeltaNet too; and the Hub's
           Qwen3_5MoeForConditionalGeneration, of which only the language model is written
  gemma4_moe  Gemma 4's MoE form (26B-A4B) as llama.cpp's gemma4 with experts: the router as
           ffn_gate_inp with its scale (ffn_gate_inp.scale), the experts as one ffn_gate_up_exps and
           ffn_down_exps with per_expert_scale (ffn_down_exps.scale), the MoE norms; from transformers'
           fused experts and from a tensor per expert; q4_k_m and q8_0 as llama-quantize makes them;
           the experts' LoRA on ffn_gate_up_exps / ffn_down_exps; and the Hub's
           Gemma4ForConditionalGeneration form, of which only the language model is written
  gpt_oss  gpt-oss as llama.cpp's gpt-oss: q/k/v/o biases, attn_sinks, the router's bias, the experts
           (transposed, gate/up interleaved) split into ffn_{gate,up,down}_exps by even and odd columns with
           their biases, a window on even layers, YaRN; q4_k_m and q8_0; the experts' LoRA (B's even/odd rows)

For each: llama.cpp's logits on the f32 and f16 files equal transformers' within the tolerance
beside the check, and its greedy continuation of 24 tokens is transformers'; llama.cpp tokenizes a
varied corpus as the reference tokenizer does (each tokenizer kind, plus the full real Qwen
vocabulary); Qwen3.5's q4_k_m file is llama-quantize's of our f32 file; transformers' own GGUF
loader reads our files where it knows the architecture; a random PEFT LoRA over every linear layer,
written by `qlora gguf --adapter`, gives peft's logits in llama.cpp on the base's f32 file. Each
refusal (unknown model_type, unsupported RoPE, what llama.cpp would compute differently, a tensor
without a GGUF name, an unknown pre-tokenizer) is checked once, with no file left behind.

    python tests/conformance/test_gguf_families.py --tool build/qlora --workdir build/conformance_gguf_families
    (--only qwen3_moe mixtral gpt_oss: those families' checks alone, with their refusals)
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _families  # noqa: E402
from _common import Checks, parse_tool_args  # noqa: E402
from _gguf_tokenizers import CORPUS, HfTokenizer, SpTokenizer, qwen_tokenizer, tokenizer_for  # noqa: E402
from _gguf_common import (CHECKS, GREEDY, PROMPT, TOL, TOL_GELU, TOL_GEMMA4_ADAPTER, F16_ROUNDED_REFERENCE,  # noqa: E402,F401
                          check, check_llama_quantize_mix, edited_copy, f16_weights, hf_greedy, hf_logits,
                          llama_cpp_greedy, llama_cpp_logits, llama_cpp_model, prompt_ids, qlora_gguf, refused,
                          rel_diff, tolerance)
from _gguf_moe import (check_expert_adapter, check_gpt_oss_mxfp4, check_moe_fused, check_moe_refusals,  # noqa: E402
                       check_moe_split)


# ---------------------------------------------------------------------------------------------- models

GEMMA3_6 = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's fixed 5 local : 1 global
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

QWEN35_LLAMA_CPP = dict(linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=4,
                       linear_value_head_dim=32)

GEMMA4_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# name: (case in _families, overrides, tokenizer kind, sequence length for the logits check)
FAMILIES = {
    "llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE), "llama-bpe"),
    "mistral": ("mistral_sliding", dict(sliding_window=None), "sp-llama"),
    "qwen2": ("qwen2_tied", {}, "qwen2"),
    "qwen3": ("qwen3", {}, "qwen2"),
    # llama.cpp scales gemma queries by head_dim^-0.5: query_pre_attn_scalar = head_dim.
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=64), "sp-gemma"),
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=64, num_hidden_layers=6, layer_types=GEMMA3_6), "sp-gemma"),
    "gemma3_linear": ("gemma3_linear", dict(query_pre_attn_scalar=64, num_hidden_layers=6, layer_types=GEMMA3_6),
                      "sp-gemma"),
    "phi3": ("phi3", dict(sliding_window=None), "sp-phi3"),
    "smollm3": ("smollm3", dict(tie_word_embeddings=True), "llama-bpe"),
    "olmo2": ("olmo2", {}, "llama-bpe"),
    # YaRN on the full layers (rope.scaling.* keys; llama.cpp's olmo2 leaves the sliding ones unscaled).
    "olmo3": ("olmo3", {}, "llama-bpe"),
    # llama.cpp's qwen35 takes one head size for the DeltaNet's keys and values (ssm.state_size), so
    # both are 32 here; 2 key heads of 4 value heads keep the value-head reordering exercised.
    "qwen35": ("qwen3_5", QWEN35_LLAMA_CPP, "qwen35"),
    # llama.cpp's gemma4 has its KV-shared layers read the last non-shared layer (full layers) and the
    # one before it (sliding layers), as Gemma 4's checkpoints lay them out: layers 2 full, 1 sliding.
    "gemma4": ("gemma4", dict(layer_types=GEMMA4_LAYERS), "sp-gemma"),
    # Mixture of Experts. llama.cpp's qwen3moe makes every layer MoE and always renormalises the top k
    # (qlora refuses mlp_only_layers and norm_topk_prob false: check_moe_refusals).
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[], norm_topk_prob=True), "qwen2"),
    # Mixtral as llama.cpp's llama with expert_count; no window (mistral's check_window covers it).
    "mixtral": ("mixtral", dict(sliding_window=None), "sp-llama"),
    # Qwen3.5-MoE as llama.cpp's qwen35moe: qwen35's DeltaNet (one head size, as above) and every layer
    # MoE beside the shared expert (ffn_*_shexp, its gate ffn_gate_inp_shexp).
    "qwen35moe": ("qwen3_5_moe", QWEN35_LLAMA_CPP, "qwen35"),
    "gemma4_moe": ("gemma4_moe", {}, "sp-gemma"),
    # gpt-oss as llama.cpp's gpt-oss, which fixes the clamp at 7: weights of 0.2 std make 2% of the
    # gates and 3% of the ups reach it (without the clamp transformers' logits move by 0.34 of the
    # largest), and rounds YaRN's ramp to whole dimensions (truncate true here; false: a note).
    "gpt_oss": ("gpt_oss", dict(swiglu_limit=7.0, initializer_range=0.2,
                                rope_parameters={**_families.GPT_OSS_ROPE, "truncate": True}), "llama-bpe"),
}
MOE_FAMILIES = ["qwen3_moe", "mixtral", "qwen35moe", "gemma4_moe", "gpt_oss"]


def build_family(name, work, seed=0):
    """The family's tiny model saved with its tokenizer; returns (dir, model, tokenizer reference)."""
    case, overrides, kind = FAMILIES[name]
    d = os.path.join(work, name)
    tok = tokenizer_for(kind, d)
    model = _families.build(case, seed, **vocab_sizes(case, tok), max_position_embeddings=256, **overrides)
    model.save_pretrained(d)
    return d, model, tok


def vocab_sizes(case, tok):
    """The tokenizer's vocabulary size, for Gemma 4 its per-layer table's too (llama.cpp's gemma4 takes
    one row of it a token)."""
    return dict(vocab_size=len(tok), **(dict(vocab_size_per_layer_input=len(tok)) if case.startswith("gemma4") else {}))


def check_ablations(name, model, ids, ref):
    """Each feature of the case (_families' ablations: a soft-cap, the window, q/k norms, the RoPE
    bases...) moves transformers' logits by far more than the tolerance, so a file that lost it fails."""
    case, overrides, _ = FAMILIES[name]
    for label, abl_overrides, edit in _families.CASES[case]["ablations"]:
        if set(abl_overrides) & set(overrides):
            continue  # a feature this case sets aside for llama.cpp (e.g. the window: check_window)
        kw = {"vocab_size": model.config.vocab_size, "max_position_embeddings": 256, **overrides, **abl_overrides}
        if case.startswith("gemma4"):
            kw["vocab_size_per_layer_input"] = model.config.vocab_size
        other = _families.ablated(case, model, kw, edit)
        moved = rel_diff(hf_logits(other, ids), ref)
        CHECKS.check(f"{name}: ablation '{label}' moves the reference logits beyond 10x the f32 tolerance",
                     moved > 10 * tolerance(name, "f32"), f"{moved:.2e}")


def check_family(tool, work, name):
    d, model, tok = build_family(name, work)
    ids = prompt_ids(tok)
    ref = hf_logits(model, ids)
    check_ablations(name, model, ids, ref)
    paths = {}
    for qtype in ("f32", "f16"):
        r, out = qlora_gguf(tool, d, qtype)
        if not check(r.returncode == 0, f"{name}: qlora gguf --type {qtype}: {r.stdout.strip() or r.stderr.strip()}"):
            return None
        paths[qtype] = out
        llm = llama_cpp_model(out)
        diff, tol = rel_diff(llama_cpp_logits(llm, ids), ref), tolerance(name, qtype)
        rounded = qtype == "f16" and name in F16_ROUNDED_REFERENCE
        if rounded:
            diff, tol = rel_diff(llama_cpp_logits(llm, ids), hf_logits(f16_weights(model), ids)), F16_ROUNDED_REFERENCE[name]
        CHECKS.check(f"{name}: llama.cpp's logits on our {qtype} file ({len(ids)} tokens) equal transformers'"
                     + (" on its f16 weights" if rounded else ""), diff < tol,
                     f"max|diff| / max(1, max|ref|) = {diff:.2e} (< {tol:g})")
        if qtype == "f32":
            ours, want = llama_cpp_greedy(llm, ids, GREEDY), hf_greedy(model, ids, GREEDY)
            CHECKS.check(f"{name}: llama.cpp's greedy {GREEDY} tokens on the f32 file equal transformers'",
                         ours == want, f"{ours[:12]}... vs {want[:12]}...")
        del llm
    return d, model, tok, paths


def check_adapter(tool, name, d, model, tok, base_gguf):
    """`qlora gguf --adapter` on a random PEFT LoRA over every linear layer of the family (B non-zero):
    llama.cpp applies it to our f32 file of the base and gives peft's logits with the adapter on."""
    import copy

    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    # Gemma 4: every linear layer but per_layer_model_projection, which llama.cpp multiplies without a
    # LoRA (qlora refuses one there).
    # MoE: the attention (peft's all-linear adds the experts and the router as target_parameters with a
    # rank_pattern; the experts' LoRA is check_expert_adapter's).
    # Qwen3.5-MoE: its DeltaNet's projections and the shared expert's (gate/up/down_proj) too.
    targets = (_families.GEMMA4_TARGETS if name.startswith("gemma4") else
               _families.QWEN35_TARGETS if name == "qwen35moe" else
               ["q_proj", "k_proj", "v_proj", "o_proj"] if name in MOE_FAMILIES else "all-linear")
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                                 init_lora_weights=False)).eval()
    adapter = os.path.join(d, "adapter")
    peft_model.save_pretrained(adapter)
    out = os.path.join(d, "adapter-f32.gguf")
    r = subprocess.run([tool, "gguf", adapter, "--adapter", "--base", d, "--type", "f32", "-o", out],
                       capture_output=True, text=True)
    if not check(r.returncode == 0, f"{name}: qlora gguf --adapter: {(r.stdout or r.stderr).strip()[:200]}"):
        return
    ids = prompt_ids(tok)
    ref = hf_logits(peft_model, ids)
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(base_gguf, lora_path=out), ids), ref)
    moved = rel_diff(hf_logits(model, ids), ref)
    tol = TOL_GEMMA4_ADAPTER if name.startswith("gemma4") else tolerance(name, "f32")
    CHECKS.check(f"{name}: llama.cpp with our LoRA GGUF on the base's f32 file gives peft's logits",
                 diff < tol < moved, f"{diff:.2e} (< {tol:g}; the adapter moves them by {moved:.2e})")


def check_gemma4_projection_adapter(tool, d, model):
    """A LoRA on Gemma 4's per_layer_model_projection: llama.cpp multiplies that matrix without applying
    a LoRA, so `qlora gguf --adapter` refuses it by name and writes nothing."""
    import copy

    from peft import LoraConfig, get_peft_model
    torch.manual_seed(3)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                 target_modules=["per_layer_model_projection"]))
    adapter = os.path.join(d, "model_projection_adapter")
    peft_model.save_pretrained(adapter)
    out = adapter + ".gguf"
    r = subprocess.run([tool, "gguf", adapter, "--adapter", "--base", d, "--type", "f32", "-o", out],
                       capture_output=True, text=True)
    msg = r.stderr.strip()
    check(r.returncode != 0 and "per_layer_model_projection" in msg and not os.path.exists(out)
          and not os.path.exists(out + ".tmp"), f"refused: a LoRA on gemma4's per_layer_model_projection: {msg[:300]}")


def check_tied_head_adapter(tool, work, d, model):
    """A LoRA on a tied head (lm_head in the targets, tie_word_embeddings): the base's GGUF has no
    output.weight to apply it to (llama.cpp 0.3.36 crashed on such an adapter), so `qlora gguf --adapter`
    refuses it by name and writes nothing: given the tied base, and given an epoch's merged export
    whose config the LoRA untied, with the adapter naming the tied base as qlora's export does."""
    import copy

    from peft import LoraConfig, get_peft_model
    torch.manual_seed(2)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                 target_modules=["q_proj", "lm_head"]))
    adapter = os.path.join(work, "tied_head_adapter")
    peft_model.save_pretrained(adapter, save_embedding_layers=False)  # A and B only, as qlora exports
    cfg_path = os.path.join(adapter, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = d
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    merged = edited_copy(d, work, "tied_head_merged", lambda c: c.update(tie_word_embeddings=False))
    out = os.path.join(work, "tied_head-lora.gguf")
    for label, base in (("the tied base", d), ("an epoch's export that the LoRA untied", merged)):
        r = subprocess.run([tool, "gguf", adapter, "--adapter", "--base", base, "--type", "f32", "-o", out],
                           capture_output=True, text=True)
        msg = r.stderr.strip()
        check(r.returncode != 0 and "lm_head.lora_A" in msg and "output head" in msg and "merged model" in msg
              and not os.path.exists(out) and not os.path.exists(out + ".tmp"),
              f"refused: a LoRA on a tied output head, with {label}: {msg[:300]}")


# ---------------------------------------------------------------------------------------------- main checks

def check_tokenization(path, ref, label):
    llm = llama_cpp_model(path, vocab_only=True)
    texts = CORPUS + getattr(ref, "texts", [])
    bad = [t for t in texts if llm.tokenize(t.encode(), add_bos=False, special=False) != ref.encode(t)]
    check(not bad, f"{label}: llama.cpp tokenizes {len(texts)} texts as the reference does ({bad[:2]})")
    added = getattr(ref, "added", {})
    if added:
        got = {t: llm.tokenize(t.encode(), add_bos=False, special=True) for t in added}
        check(all(got[t] == [i] for t, i in added.items()),
              f"{label}: the added tokens are single tokens with their ids ({got})")


def check_full_qwen_vocab(tool, work):
    """Qwen's whole vocabulary (151,646 tokens, config vocab 151,936) on a one-layer Qwen2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    d = os.path.join(work, "qwen2_full_vocab")
    tok = HfTokenizer(qwen_tokenizer(d))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    r, out = qlora_gguf(tool, d, "f16")
    if check(r.returncode == 0, f"qwen2 full vocabulary: qlora gguf: {r.stdout.strip() or r.stderr.strip()}"):
        check_tokenization(out, tok, f"qwen2 full vocabulary ({len(tok)} tokens)")


def check_transformers_loader(name, path, model):
    """transformers' own GGUF reader as a second opinion, where it knows the architecture: the weights
    it reads back from our f32 file (undoing llama.cpp's Q/K order and Gemma's 1 + w itself) are the
    model's. (Weights, not logits: its config reader drops some keys, e.g. Llama-3's rope_freqs.)"""
    from transformers import AutoModelForCausalLM
    alone = os.path.join(os.path.dirname(path), "transformers_reads")  # no config.json beside the file
    os.makedirs(alone, exist_ok=True)
    shutil.copy(path, alone)
    try:
        m = AutoModelForCausalLM.from_pretrained(alone, gguf_file=os.path.basename(path), dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        # Its own limits, named: an architecture (or a general.name it maps to one) it has no table for;
        # a key it does not read (Qwen3's attention.key_length, so its head_dim is the class default).
        known = ("gguf" in str(e).lower() and ("not supported" in str(e).lower() or "unknown" in str(e).lower())
                 or "ignore_mismatched_sizes" in str(e))
        if known:
            print(f"SKIP {name}: transformers' GGUF loader cannot read this file's architecture or shapes: "
                  f"{str(e).splitlines()[0][:120]}")
            return
        raise
    finally:
        shutil.rmtree(alone)
    theirs, ours = m.state_dict(), model.state_dict()
    missing = sorted(k for k in ours if k not in theirs)
    diff = max((float((theirs[k].float() - v.float()).abs().max()) for k, v in ours.items()
                if k in theirs and theirs[k].shape == v.shape), default=float("inf"))
    shapes = [k for k, v in ours.items() if k in theirs and theirs[k].shape != v.shape]
    CHECKS.check(f"{name}: transformers' GGUF loader reads our f32 file back as the model's weights",
                 not missing and not shapes and diff < 1e-6,
                 f"{len(ours)} tensors, max|diff| {diff:.1e}; missing {missing[:3]}, other shapes {shapes[:3]}")


def check_window(tool, work, name, case, kind):
    """A window shorter than the context where llama.cpp applies none (its llama has no window, its
    phi3 ignores it): the file declares the window as its context, the log says so, and inside it
    llama.cpp gives transformers' logits."""
    from gguf import GGUFReader
    d = os.path.join(work, name + "_window")
    tok = tokenizer_for(kind, d)
    model = _families.build(case, 0, vocab_size=len(tok), max_position_embeddings=256)
    model.save_pretrained(d)
    r, out = qlora_gguf(tool, d, "f32")
    if not check(r.returncode == 0 and "sliding_window" in r.stderr,
                 f"{name} with sliding_window {_families.WINDOW}: written, the log saying why its context is the "
                 f"window ({r.stderr.strip()[:160]})"):
        return
    reader = GGUFReader(out)
    arch = reader.fields["general.architecture"].contents()
    ctx = reader.fields[f"{arch}.context_length"].contents()
    check(ctx == _families.WINDOW, f"{name} window: {arch}.context_length is the window ({ctx})")
    ids = prompt_ids(tok)[:_families.WINDOW]
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(out), ids), hf_logits(model, ids))
    CHECKS.check(f"{name} window: llama.cpp's logits inside the window equal transformers'", diff < TOL["f32"],
                 f"max|diff| / max(1, max|ref|) = {diff:.2e} (< {TOL['f32']:g})")


def check_sentencepiece_json(tool, work, dirs):
    """A sentencepiece vocabulary shipped only as tokenizer.json (transformers' fast form: BPE with byte
    fallback; as Hub repositories and transformers' GGUF conversion ship Gemma), for Gemma (no dummy
    prefix) and Llama 2 (Metaspace, a dummy prefix): written as llama.cpp's "llama" vocabulary, which
    tokenizes the corpus as sentencepiece does, and gives the model's logits."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, GemmaTokenizerFast, LlamaTokenizerFast
    for name, cls, special in (("gemma3", GemmaTokenizerFast, dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                                                    unk_token="<unk>", mask_token=None)),
                               ("mistral", LlamaTokenizerFast, {})):
        if name not in dirs:
            continue
        d = edited_copy(dirs[name], work, name + "_tokenizer_json")
        cls.from_pretrained(dirs[name], **special).save_pretrained(d)
        os.remove(os.path.join(d, "tokenizer.model"))
        # The reference is sentencepiece on the model the tokenizer.json was made from: `tokenizers`
        # on Llama's fast form drops one of several leading spaces ("  a": one "▁" where sentencepiece
        # and llama.cpp give two), the one text of the corpus where the two differ.
        ref = SpTokenizer(os.path.join(dirs[name], "tokenizer.model"))
        r, out = qlora_gguf(tool, d, "f32")
        if not check(r.returncode == 0, f"{name} tokenizer.json only: qlora gguf: {r.stdout.strip() or r.stderr.strip()}"):
            continue
        kind = GGUFReader(out).fields["tokenizer.ggml.model"].contents()
        check(kind == "llama", f"{name} tokenizer.json only: tokenizer.ggml.model is llama ({kind})")
        check_tokenization(out, ref, f"{name} tokenizer.json only")
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        ids = prompt_ids(ref)
        diff = rel_diff(llama_cpp_logits(llama_cpp_model(out), ids), hf_logits(model, ids))
        CHECKS.check(f"{name} tokenizer.json only: llama.cpp's logits equal transformers'", diff < tolerance(name, "f32"),
                     f"max|diff| / max(1, max|ref|) = {diff:.2e} (< {tolerance(name, 'f32'):g})")
    if "mistral" in dirs:  # Metaspace splitting at every space: llama.cpp's "llama" vocabulary never splits
        def split_metaspace(d):
            path = os.path.join(d, "tokenizer.json")
            with open(path) as f:
                tj = json.load(f)
            tj["pre_tokenizer"]["split"] = True
            with open(path, "w") as f:
                json.dump(tj, f)
        d = edited_copy(os.path.join(work, "mistral_tokenizer_json"), work, "refuse_metaspace_split")
        split_metaspace(d)
        refused(tool, d, "a byte-fallback tokenizer.json whose Metaspace splits", "pre-tokenizer", "Metaspace")


def check_multimodal(tool, d, label, model, tok, tol):
    """A Hub-style multimodal checkpoint in d: the language model is written (llama.cpp gives the
    multimodal model's text logits), the vision tower is not, and the log says so."""
    from gguf import GGUFReader
    r, out = qlora_gguf(tool, d, "f32")
    if not check(r.returncode == 0 and "vision tower" in r.stderr,
                 f"{label} multimodal: written, the log naming the vision tower ({r.stderr.strip()[:200]})"):
        return
    names = [t.name for t in GGUFReader(out).tensors]
    check(not [n for n in names if "v." in n[:2] or "mm" in n or "vision" in n],
          f"{label} multimodal: only language-model tensors ({len(names)})")
    ids = prompt_ids(tok)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(out), ids), ref)
    CHECKS.check(f"{label} multimodal: llama.cpp's logits equal the multimodal model's text logits", diff < tol,
                 f"max|diff| / max(1, max|ref|) = {diff:.2e} (< {tol:g})")


def check_gemma3_multimodal(tool, work):
    """A Hub-style Gemma3ForConditionalGeneration."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    d = os.path.join(work, "gemma3_multimodal")
    tok = tokenizer_for("sp-gemma", d)
    text = dict(_families.COMMON, **_families.GEMMA, num_hidden_layers=6, layer_types=GEMMA3_6,
                rope_parameters=_families.GEMMA3_ROPE, vocab_size=len(tok), max_position_embeddings=256)
    text["query_pre_attn_scalar"] = 64
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    cfg.text_config._attn_implementation = "eager"
    model = Gemma3ForConditionalGeneration(cfg).float().eval()
    _families.randomize_norms(model, 0)
    model.save_pretrained(d)
    check_multimodal(tool, d, "gemma3", model, tok, tolerance("gemma3", "f32"))


def check_hub_multimodal(tool, work, label, case, kind, **overrides):
    """The Hub's Qwen3_5ForConditionalGeneration or Gemma4ForConditionalGeneration (its language model
    under model.language_model.), built from _families' `case`."""
    d = os.path.join(work, label + "_multimodal")
    tok = tokenizer_for(kind, d)
    model = _families.build(case, 0, **vocab_sizes(case, tok), max_position_embeddings=256, **overrides)
    model.save_pretrained(d)
    check_multimodal(tool, d, label, model, tok, tolerance(label, "f32"))


def check_olmo3_attention_factor(tool, work, src):
    """OLMo 3's YaRN with an attention_factor other than llama.cpp's own 1 + 0.1 ln(factor): written as
    rope.scaling.attn_factor (the quotient llama.cpp multiplies in), llama.cpp gives transformers' logits."""
    from transformers import AutoModelForCausalLM
    d = edited_copy(src, work, "olmo3_attention_factor", lambda c: c["rope_parameters"]["full_attention"].update(
        attention_factor=1.6))
    r, out = qlora_gguf(tool, d, "f32")
    if not check(r.returncode == 0, f"olmo3 attention_factor 1.6: qlora gguf: {r.stderr.strip()[:200]}"):
        return
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = list(range(1, _families.SEQ + 6))
    ref = hf_logits(model, ids)
    diff = rel_diff(llama_cpp_logits(llama_cpp_model(out), ids), ref)
    CHECKS.check("olmo3 attention_factor 1.6: llama.cpp's logits equal transformers'", diff < TOL["f32"],
                 f"max|diff| / max(1, max|ref|) = {diff:.2e} (< {TOL['f32']:g})")


def gemma4_layer_types(cfg, types):
    """Gemma 4's config.json with other layer types (per_layer_config gives the full layers' sizes)."""
    full = next(iter(cfg["per_layer_config"].values()))
    cfg.update(layer_types=types, per_layer_config={str(i): full for i, t in enumerate(types) if t == "full_attention"})


def check_refusals(tool, work, dirs):
    refused(tool, edited_copy(dirs["llama3"], work, "refuse_model_type", lambda c: c.update(model_type="gpt_neox")),
            "an unknown model_type", "model_type", "gpt_neox")
    refused(tool, edited_copy(dirs["llama3"], work, "refuse_rope", lambda c: c.update(
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})), "a RoPE type qlora does not model",
        "rope_type", "dynamic")
    refused(tool, edited_copy(dirs["gemma2"], work, "refuse_gemma2_scale", lambda c: c.update(query_pre_attn_scalar=32)),
            "gemma2 with query_pre_attn_scalar != head_dim", "query_pre_attn_scalar")
    refused(tool, edited_copy(dirs["gemma3"], work, "refuse_gemma3_layers", lambda c: c.update(
        layer_types=["sliding_attention", "full_attention"] * 3)), "gemma3 with another local/global pattern",
        "layer_types", "layer 1")
    refused(tool, edited_copy(dirs["qwen2"], work, "refuse_qwen_window", lambda c: c.update(
        use_sliding_window=True, sliding_window=8, max_window_layers=0, layer_types=["sliding_attention"] * 2)),
        "qwen2 with a sliding window", "use_sliding_window")
    refused(tool, edited_copy(dirs["smollm3"], work, "refuse_smollm3_nope", lambda c: c.update(no_rope_layers=[1, 0, 1, 1])),
            "smollm3 with NoPE layers other than every fourth", "no_rope_layers", "layer 1")
    refused(tool, edited_copy(dirs["qwen3"], work, "refuse_qwen3_yarn", lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0})), "qwen3 with YaRN", "rope_parameters", "YaRN")
    refused(tool, edited_copy(dirs["olmo3"], work, "refuse_olmo3_yarn_truncate", lambda c: c["rope_parameters"][
        "full_attention"].update(truncate=False)), "olmo3 with YaRN's truncate false", "rope_parameters.truncate")
    refused(tool, edited_copy(dirs["olmo3"], work, "refuse_olmo3_yarn_beta", lambda c: c["rope_parameters"][
        "full_attention"].update(beta_fast=16)), "olmo3 with YaRN's beta_fast not 32", "rope_parameters.beta_fast")
    refused(tool, edited_copy(dirs["qwen35"], work, "refuse_qwen35_head_dims", lambda c: c.update(
        linear_value_head_dim=16)), "qwen35 with other DeltaNet key and value head sizes", "linear_value_head_dim")
    refused(tool, edited_copy(dirs["qwen35"], work, "refuse_qwen35_layers", lambda c: c.update(
        layer_types=["linear_attention"] * 2 + ["full_attention"] * 2)), "qwen35 with full attention on another pattern",
        "layer_types", "layer 3")
    if "gemma4" in dirs:
        refused(tool, edited_copy(dirs["gemma4"], work, "refuse_gemma4_kv_sharing", lambda c: gemma4_layer_types(
            c, _families.GEMMA4["layer_types"])), "gemma4 with KV-shared layers reading other layers than llama.cpp's",
            "num_kv_shared_layers", "layer 3")
    refused(tool, edited_copy(dirs["qwen2"], work, "refuse_vocab_size", lambda c: c.update(vocab_size=10**12)),
            "a vocab_size the embedding does not have (10^12 entries would be written)", "vocab_size", "rows")
    from safetensors.torch import load_file, save_file
    d = edited_copy(dirs["qwen3"], work, "refuse_tensor")
    st = os.path.join(d, "model.safetensors")
    t = load_file(st)
    t["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
    save_file(t, st, metadata={"format": "pt"})
    refused(tool, d, "a tensor with no GGUF name", "model.layers.0.mlp.experts.0.up_proj.weight", "qwen3")
    d = edited_copy(dirs["qwen2"], work, "refuse_pretokenizer")
    p = os.path.join(d, "tokenizer.json")
    with open(p) as f:
        tj = json.load(f)
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\p{N}+|\s+|."
    with open(p, "w") as f:
        json.dump(tj, f)
    refused(tool, d, "an unknown pre-tokenizer", "pre-tokenizer")


def main():
    a = parse_tool_args(lambda ap: ap.add_argument(
        "--only", nargs="+", choices=list(FAMILIES), metavar="FAMILY",
        help="run these families' checks (and their refusals) alone: " + ", ".join(FAMILIES)))
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    torch.set_num_threads(2)
    dirs = {}
    for name in (a.only or FAMILIES):
        try:
            got = check_family(a.tool, a.workdir, name)
        except Exception as e:  # noqa: BLE001 - one family's crash is that family's failure
            CHECKS.crashed(name, e)
            continue
        if got is None:
            continue
        d, model, tok, paths = got
        dirs[name] = d
        check_tokenization(paths["f32"], tok, f"{name} ({FAMILIES[name][2]})")
        if name.startswith("gemma4"):  # its GGUF reader takes one feed_forward_length, not one a layer
            print(f"SKIP {name}: transformers' GGUF loader cannot read per-layer feed_forward_length arrays")
        elif name in MOE_FAMILIES:  # it reads llama-with-experts as a dense Llama, qwen3moe's experts not at all
            print(f"SKIP {name}: transformers' GGUF loader does not read llama.cpp's stacked expert tensors")
        else:
            check_transformers_loader(name, paths["f32"], model)
        check_adapter(a.tool, name, d, model, tok, paths["f32"])
        if name == "gemma4":
            check_gemma4_projection_adapter(a.tool, d, model)
        if name == "qwen2":  # tied embeddings
            check_tied_head_adapter(a.tool, a.workdir, d, model)
        if name == "qwen35":  # tensors no other family has (ssm_*): llama-quantize's mix of them
            check_llama_quantize_mix(a.tool, name, d, paths["f32"])
        if name in MOE_FAMILIES:  # 3-D expert tensors and the router: llama-quantize's mix of them
            check_llama_quantize_mix(a.tool, name, d, paths["f32"])
            check_llama_quantize_mix(a.tool, name, d, paths["f32"], "q8_0")
            if name != "gpt_oss":  # its one layout is fused
                (check_moe_split if name in _families.SPLIT_CASES else check_moe_fused)(a.tool, name, d, model, tok)
            else:  # and its Hub form MXFP4
                check_gpt_oss_mxfp4(a.tool, a.workdir, d, model, tok)
            if name == "gemma4_moe":  # the Hub's 26B-A4B is a Gemma4ForConditionalGeneration
                check_hub_multimodal(a.tool, a.workdir, "gemma4_moe", "gemma4_vision", "sp-gemma",
                                     **{k: v for k, v in _families.GEMMA4_MOE.items() if _families.GEMMA4.get(k) != v})
            stem = "experts" if name == "gemma4_moe" else "mlp.experts"  # Gemma 4's sit on the layer itself
            for params in ([f"{stem}.gate_up_proj", f"{stem}.down_proj"], [f"{stem}.gate_up_proj"],
                           [f"{stem}.down_proj"]):
                check_expert_adapter(a.tool, name, d, model, tok, paths["f32"], params)
    if a.only:
        check_moe_refusals(a.tool, a.workdir, dirs)
        return CHECKS.summary()
    check_window(a.tool, a.workdir, "mistral", "mistral_sliding", "sp-llama")
    check_window(a.tool, a.workdir, "phi3", "phi3", "sp-phi3")
    check_gemma3_multimodal(a.tool, a.workdir)
    check_sentencepiece_json(a.tool, a.workdir, dirs)
    check_hub_multimodal(a.tool, a.workdir, "qwen35", "qwen3_5_vision", "qwen35", **QWEN35_LLAMA_CPP)
    check_hub_multimodal(a.tool, a.workdir, "qwen35moe", "qwen3_5_moe_vision", "qwen35", **QWEN35_LLAMA_CPP)
    check_hub_multimodal(a.tool, a.workdir, "gemma4", "gemma4_vision", "sp-gemma", layer_types=GEMMA4_LAYERS)
    if "olmo3" in dirs:
        check_olmo3_attention_factor(a.tool, a.workdir, dirs["olmo3"])
    check_full_qwen_vocab(a.tool, a.workdir)
    check_refusals(a.tool, a.workdir, dirs)
    check_moe_refusals(a.tool, a.workdir, dirs)
    return CHECKS.summary()


if __name__ == "__main__":
    sys.exit(main())
