"""Where a traced training step's device time goes: reads a Chrome trace (bench_train_step's
--trace, written by Kineto, or the peer's, written by torch.profiler) and sums the device's
kernels, copies and sets by kind of work, from their names. Prints one JSON object:
  kernel_ms          the sum of every device activity's duration (overlaps count twice)
  span_ms            first device activity's start to the last one's end
  idle_fraction      1 - kernel_ms / span_ms: the device waiting on the host (launches, syncs)
  by_kind            {kind: {"ms", "share", "count"}} in descending time
  top                the 15 longest kernels by total time (name cut to 120 characters)
On a CPU-only trace (no device activity) the sums are zero.

    python bench/trace_summary.py TRACE.json
"""
import json
import sys
from collections import defaultdict

# (kind, substrings of a lower-cased kernel name); the first match wins. Inductor's kernels
# (torch.compile) come first: triton_tem_*mm* are its GEMM templates, every other triton_* a fused
# pointwise or reduction kernel, whatever ops it fused.
KINDS = [
    ("nccl_collectives", ["nccl"]),
    ("gemm", ["triton_tem_fused_mm", "triton_tem_fused_addmm", "triton_tem_fused_bmm"]),
    ("inductor_fused", ["triton_"]),
    ("nf4_dequantize", ["dequantize", "nf4"]),
    ("attention", ["flash", "fmha", "attention", "sdpa", "_attn"]),
    ("gemm", ["gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_", "splitk", "matmul"]),
    ("loss", ["cross_entropy", "log_softmax", "nll_loss"]),
    ("optimizer", ["adam", "multi_tensor_apply"]),
    ("copies_and_casts", ["memcpy", "memset", "copy", "cast", "fill"]),
    ("norm_rope_swiglu_elementwise", ["elementwise", "vectorized", "reduce", "norm", "rope", "silu", "mul", "add",
                                      "softmax"]),
]
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name):
    n = name.lower()
    for kind, keys in KINDS:
        if any(k in n for k in keys):
            return kind
    return "other"


def summarize(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    by_kind = defaultdict(lambda: [0.0, 0])
    by_name = defaultdict(float)
    for e in device:
        d = float(e.get("dur", 0)) / 1000.0
        k = by_kind[kind_of(e["name"])]
        k[0] += d
        k[1] += 1
        by_name[e["name"][:120]] += d
    total = sum(v[0] for v in by_kind.values())
    span = 0.0
    if device:
        span = (max(float(e["ts"]) + float(e.get("dur", 0)) for e in device) - min(float(e["ts"]) for e in device)) / 1000.0
    kinds = sorted(by_kind.items(), key=lambda kv: -kv[1][0])
    return {
        "kernel_ms": total, "span_ms": span, "idle_fraction": 1.0 - total / span if span > 0 else None,
        "by_kind": {k: {"ms": v[0], "share": v[0] / total if total else 0.0, "count": v[1]} for k, v in kinds},
        "top": [{"name": n, "ms": ms} for n, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]],
    }


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(json.dumps(summarize(sys.argv[1])))
