"""The peer for bench_nf4: torchao's to_nf4 and NF4 dequantize on the same tensor, timed the
same way (median of reps after a warm-up). Prints one JSON object. Called by bench_nf4."""
import argparse
import json
import statistics
import time

import torch
from torchao.dtypes.nf4tensor import to_nf4


def timed(fn, reps, sync):
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": reps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=11008)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantize-reps", type=int, default=2)
    ap.add_argument("--dequantize-reps", type=int, default=5)
    a = ap.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    x = (torch.randn(a.rows, a.cols, generator=torch.Generator().manual_seed(0)) * 0.02)
    x = x.to(torch.bfloat16).to(a.device)
    nf4 = to_nf4(x)
    out = {
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "to_nf4": timed(lambda: to_nf4(x), a.quantize_reps, sync),
        "dequantize": timed(lambda: nf4.get_original_weight(), a.dequantize_reps, sync),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    with torch.no_grad():
        main()
