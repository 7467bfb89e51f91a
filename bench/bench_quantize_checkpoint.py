"""`qlora quantize` on a Llama-2-7B-shaped checkpoint (random bf16 weights, 3 shards + index,
13.5 GB): wall time and peak RSS, against a Python peer doing the same job with torchao's to_nf4
and safetensors, in the same run. Prints one JSON object.

    .venv/bin/python bench/bench_quantize_checkpoint.py --qlora build/qlora --workdir /tmp/q7b
        [--layers 32] [--no-peer] [--keep]

The peer quantizes each *_proj.weight with torchao (its NF4 components are saved, the rest
copied), one tensor at a time, as a careful user script would.
"""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

import torch
from safetensors.torch import save_file

from peak_rss import SNIPPET_IMPORT  # bench/, beside this script

HIDDEN, INTER, VOCAB = 4096, 11008, 32000

PEER = SNIPPET_IMPORT + r'''
import json, os, sys, time
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torchao.dtypes.nf4tensor import to_nf4
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
t0 = time.time()
with torch.no_grad():
    for name in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        out = {}
        with safe_open(os.path.join(src, name), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                if k.endswith("_proj.weight") and t.dim() == 2:
                    q = to_nf4(t)
                    out[k + ".nf4.codes"] = q.quantized_data
                    out[k + ".nf4.scalers"] = q.quantized_scalers
                    out[k + ".nf4.factors"] = q.quantization_factor
                    out[k + ".nf4.mean"] = q.scaler_mean
                else:
                    out[k] = t
        save_file(out, os.path.join(dst, name))
        del out
print(json.dumps({"seconds": time.time() - t0, "peak_rss_mib": peak_rss_bytes() / 2**20}))
'''


def make_checkpoint(path, layers):
    os.makedirs(path, exist_ok=True)
    names = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [(p + f"self_attn.{n}_proj.weight", (HIDDEN, HIDDEN)) for n in "qkvo"]
        names += [(p + "mlp.gate_proj.weight", (INTER, HIDDEN)), (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
                  (p + "mlp.down_proj.weight", (HIDDEN, INTER))]
        names += [(p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,))]
    names += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    n_shards = 3
    per = (len(names) + n_shards - 1) // n_shards
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        shard = {}
        for n, shape in names[s * per:(s + 1) * per]:
            shard[n] = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
            weight_map[n] = fname
            total += shard[n].numel() * 2
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        del shard
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return total


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def bench_args():
    """The arguments of the benchmarks on a 7B-shaped checkpoint (this one and bench_gguf.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--keep", action="store_true")
    return ap


def main():
    a = bench_args().parse_args()
    src, out, peer_out = (os.path.join(a.workdir, n) for n in ("bf16", "qlora_nf4", "torchao_nf4"))
    if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        shutil.rmtree(a.workdir, ignore_errors=True)
        make_checkpoint(src, a.layers)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(peer_out, ignore_errors=True)
    subprocess.run(["sync"])
    t0 = time.time()
    r = subprocess.run([a.qlora, "quantize", src, out], capture_output=True, text=True)
    secs = time.time() - t0
    if r.returncode != 0:
        sys.exit(r.stdout + r.stderr)
    ours = {"seconds": secs, "peak_rss_mib": float(re.search(r"peak RSS (\d+) MiB", r.stdout).group(1)),
            "output_bytes": dir_bytes(out)}
    report = {"benchmark": "quantize_checkpoint", "model": f"Llama-2-7B shape, {a.layers} layers, bf16",
              "input_bytes": dir_bytes(src), "machine": {"cpu": platform.processor() or platform.machine(),
                                                        "cores": os.cpu_count()},
              "qlora": ours}
    if not a.no_peer:
        r = subprocess.run([sys.executable, "-c", PEER, src, peer_out], capture_output=True, text=True)
        if r.returncode != 0:
            report["torchao_peer"] = {"error": r.stderr[-2000:]}
        else:
            peer = json.loads(r.stdout.strip().splitlines()[-1])
            peer["output_bytes"] = dir_bytes(peer_out)
            report["torchao_peer"] = peer
            report["speedup_vs_peer"] = peer["seconds"] / ours["seconds"]
            report["peak_rss_ratio_vs_peer"] = ours["peak_rss_mib"] / peer["peak_rss_mib"]
    print(json.dumps(report, indent=2))
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
