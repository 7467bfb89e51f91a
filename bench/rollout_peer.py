#!/usr/bin/env python3
"""The peer of bench/bench_rollout.cpp: transformers' generate on the same random Llama and prompts.

    rollout_peer.py --write DIR --hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000
        writes a random LlamaForCausalLM (seeded; bf16 on disk, half the bytes of fp32) to DIR
    rollout_peer.py --run DIR --lengths 16,20,... --generations 4 --new 64 [--reps 2] [--threads N] [--nf4]
        loads DIR in fp32 (--nf4: every decoder *_proj weight replaced by its NF4 round trip through
        torchao, the values qlora's NF4 base multiplies by) and times greedy model.generate on the batch bench_rollout runs: each
        prompt (bench_rollout's prompt_ids) repeated --generations times, left-padded with an
        attention mask, no EOS (every sequence makes --new tokens). Prints one JSON object on its
        last line: the median seconds, tokens/s and the generated ids [sequences][new].
"""
import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def prompt_ids(index, length, vocab):
    """Prompt `index`'s tokens, as bench_rollout.cpp's prompt_ids makes them."""
    return [(31 * index + 17 * j + 5) % vocab for j in range(length)]


def write(a):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=a.vocab,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(a.write)
    print(json.dumps({"written": a.write}))


def run(a):
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    model = LlamaForCausalLM.from_pretrained(a.run, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every sequence runs --new steps, as ours does
    if a.nf4:
        from torchao.dtypes import to_nf4
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and name.endswith("_proj"):
                    w = to_nf4(mod.weight.to(torch.bfloat16), 64, 256).get_original_weight()
                    mod.weight.copy_(w.float())
    lengths = [int(x) for x in a.lengths.split(",")]
    width = max(lengths)
    vocab = model.config.vocab_size
    ids = torch.zeros(len(lengths) * a.generations, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for p, n in enumerate(lengths):
        for g in range(a.generations):
            ids[p * a.generations + g, width - n:] = torch.tensor(prompt_ids(p, n, vocab))
            mask[p * a.generations + g, width - n:] = 1

    def once(new):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0, out[:, width:]

    once(4)  # warm-up
    times, out = [], None
    for _ in range(a.reps):
        t, out = once(a.new)
        times.append(t)
    s = statistics.median(times)
    weights = "NF4 round trip, dense fp32" if a.nf4 else "fp32"
    print(json.dumps({"impl": f"transformers {__import__('transformers').__version__} generate ({weights}, sdpa)",
                      "threads": torch.get_num_threads(), "seconds": s, "times": times,
                      "tokens_per_s": out.numel() / s, "ids": out.tolist()}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write")
    ap.add_argument("--run")
    for k, v in [("hidden", 768), ("inter", 2048), ("layers", 12), ("heads", 12), ("vocab", 32000),
                 ("generations", 4), ("new", 64), ("reps", 2), ("threads", 0)]:
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--lengths", default="")
    ap.add_argument("--nf4", action="store_true")
    a = ap.parse_args()
    write(a) if a.write else run(a)


if __name__ == "__main__":
    main()
