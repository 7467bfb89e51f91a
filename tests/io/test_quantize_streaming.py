"""`qlora quantize` streams: peak RSS grows by about one tensor, not by the checkpoint's size.

Writes a 512 MiB bf16 checkpoint (8 projections of 64 MiB), quantizes it, and compares the peak
RSS qlora reports with its peak on the tiny bundled example. Memory, not time: deterministic
enough to assert, with a wide margin (half the input) that a non-streaming version (whole input
resident, > 512 MiB growth) cannot meet.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

import torch
from safetensors.torch import save_file


def peak_mib(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout, r.stderr)
        raise SystemExit("0 passed, 1 failed")
    return float(re.search(r"peak RSS (\d+) MiB", r.stdout).group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    src = os.path.join(a.workdir, "big.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": (torch.randn(8192, 4096, generator=g) * 0.02).to(torch.bfloat16)
               for i in range(8)}, src)
    size_mib = os.path.getsize(src) / 2**20
    base = peak_mib([a.qlora, "quantize", "--out", os.path.join(a.workdir, "tiny_out")])
    big = peak_mib([a.qlora, "quantize", src, os.path.join(a.workdir, "big_nf4.safetensors")])
    growth = big - base
    ok = growth < 0.5 * size_mib
    print(f"input {size_mib:.0f} MiB; peak RSS {base:.0f} MiB on the tiny example, {big:.0f} MiB here: "
          f"growth {growth:.0f} MiB (limit {0.5 * size_mib:.0f})")
    shutil.rmtree(a.workdir, ignore_errors=True)
    print(f"{int(ok)} passed, {int(not ok)} failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
