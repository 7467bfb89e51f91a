#!/usr/bin/env python3
"""The peer of bench/bench_gated_delta.cpp: transformers' torch_chunk_gated_delta_rule (Qwen3.5's
reference, chunk 64) forward + autograd backward at one shape, in a fresh process.

The first step's peak RSS over the RSS before it is the step's memory (VmHWM, as the C++ worker
measures its own); then the median of --reps timed steps after one warm-up. Inputs are drawn as
the C++ worker draws them (bench_gated_delta.cpp's make_inputs): same shapes, dtypes and
distributions. Prints one JSON object on its last line.

    gated_delta_peer.py --seq 2048 [--batch 1 --k-heads 16 --v-heads 32 --dk 128 --dv 128]
                        [--dtype bf16|fp32] [--reps 3] [--threads N]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def make_inputs(a, dtype):
    torch.manual_seed(0)
    b, t = a.batch, a.seq
    a_log = torch.empty(a.v_heads).uniform_(0.01, 16).log()  # Qwen3_5GatedDeltaNet's A_log init
    return dict(
        query=torch.randn(b, t, a.k_heads, a.dk).to(dtype),
        key=torch.randn(b, t, a.k_heads, a.dk).to(dtype),
        value=torch.randn(b, t, a.v_heads, a.dv).to(dtype),
        g=-a_log.exp() * F.softplus(torch.randn(b, t, a.v_heads) + 1.0),
        beta=torch.randn(b, t, a.v_heads).sigmoid().to(dtype),
    ), torch.randn(b, t, a.v_heads, a.dv).to(dtype)


def step(inputs, d_out):
    leaves = {n: x.detach().requires_grad_() for n, x in inputs.items()}
    out, _ = torch_chunk_gated_delta_rule(**leaves, chunk_size=64, use_qk_l2norm_in_kernel=True)
    out.backward(d_out)


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("batch", 1), ("seq", 512), ("k-heads", 16), ("v-heads", 32), ("dk", 128), ("dv", 128),
                          ("reps", 3), ("threads", 0)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    inputs, d_out = make_inputs(a, torch.bfloat16 if a.dtype == "bf16" else torch.float32)
    rss0 = status_bytes("VmRSS")
    t0 = time.perf_counter()
    step(inputs, d_out)
    first = time.perf_counter() - t0
    peak = status_bytes("VmHWM") - rss0
    times = []
    for i in range(a.reps + 1):
        t0 = time.perf_counter()
        step(inputs, d_out)
        if i:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"impl": "transformers torch_chunk_gated_delta_rule (autograd)", "torch": torch.__version__,
                      "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "threads": torch.get_num_threads(), "first_step_s": first,
                      "fwd_bwd_s": statistics.median(times) if times else first, "peak_rss_delta_bytes": peak}))


if __name__ == "__main__":
    main()
