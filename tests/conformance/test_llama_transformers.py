#!/usr/bin/env python3
"""Conformance: our Llama forward (tests/tools/llama_logits) against transformers.

For each tiny random model (MHA, GQA, llama3 RoPE scaling, tied embeddings, Mistral) this saves
an HF checkpoint, runs our tool on it and compares fp32 logits with transformers'. Then it
repeats with the base projections in NF4: the reference model gets each *_proj weight replaced
by torchao's to_nf4(w).get_original_weight(), and our tool runs with --nf4.

Shapes are chosen so that every projection has numel % (64 * 256) == 0, which torchao's to_nf4
needs (our NF4 pads and does not).

Usage: test_llama_transformers.py --tool PATH/llama_logits --workdir DIR
Prints one line per check and "N passed, M failed"; exit status 1 on any failure.
"""
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from _common import Checks, logits_tool, nf4_roundtrip_projections, parse_tool_args, randomize_norms

# fp32 on both sides; the only differences are the order of floating-point operations (our
# matmuls/attention go through the same ATen kernels, but e.g. transformers' SDPA call may get
# an explicit mask where we pass is_causal). Logits here are O(1), so 1e-4 absolute is ~1e3
# fp32 ulps of headroom while any real mistake (RoPE layout, norm order, GQA grouping, scaling)
# shows up at 1e-2 or more.
ATOL_FP32 = 1e-4
# NF4: our dequantization is bit-identical to torchao's, so the same fp32 tolerance applies;
# the fp32 mean of the absmax scalers can differ in the last bit with a different thread count
# (ATen's summation order), which moves dequantized weights by ~1 ulp: far below ATOL_FP32.
ATOL_NF4 = 1e-4

COMMON = dict(num_hidden_layers=2, vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-5,
              initializer_range=0.1)


def cases():
    return {
        "mha_untied": (LlamaConfig, LlamaForCausalLM,
                       dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=4, tie_word_embeddings=False)),
        "gqa": (LlamaConfig, LlamaForCausalLM,
                dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=2, tie_word_embeddings=False)),
        # original_max_position_embeddings 32 puts the head_dim-64 frequencies in all three bands
        # of llama3 scaling (kept, interpolated, divided by factor).
        "llama3_rope": (LlamaConfig, LlamaForCausalLM,
                        dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32})),
        "tied": (LlamaConfig, LlamaForCausalLM,
                 dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4, tie_word_embeddings=True)),
        "mistral": (MistralConfig, MistralForCausalLM,
                    dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, tie_word_embeddings=False, sliding_window=64)),
    }


def build(cfg_cls, model_cls, kw, seed):
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**COMMON, **kw)).to(torch.float32).eval()
    randomize_norms(model, seed)
    return model


def main():
    args = parse_tool_args()
    checks = Checks()
    for i, (name, (cfg_cls, model_cls, kw)) in enumerate(cases().items()):
        try:
            model = build(cfg_cls, model_cls, kw, seed=1234 + i)
            g = torch.Generator().manual_seed(99 + i)
            tokens = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=g)
            ckpt = os.path.join(args.workdir, name)
            model.save_pretrained(ckpt, safe_serialization=True)
            with torch.no_grad():
                ref = model(tokens).logits.float()
            ours = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, name + "_logits.safetensors"))
            checks.compare(f"{name} fp32", ours, ref, ATOL_FP32)

            nf4_roundtrip_projections(model)
            with torch.no_grad():
                ref_nf4 = model(tokens).logits.float()
            # Our tool quantizes the original fp32 checkpoint itself.
            ours_nf4 = logits_tool(args.tool, ckpt, tokens, os.path.join(args.workdir, name + "_nf4.safetensors"),
                                   nf4=True)
            checks.compare(f"{name} nf4", ours_nf4, ref_nf4, ATOL_NF4)
        except Exception as e:
            checks.crashed(name, e)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
