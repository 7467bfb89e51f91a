"""What the recipe tests share: PASS/FAIL counting, launching `qlora run lora_finetune` (on N ranks,
with a fault plan), reading metrics.jsonl and the exported adapter, and the tolerance for runs that
must agree although they sum in another order.
"""
import argparse
import json
import os
import shutil
import subprocess

import numpy as np
from safetensors.numpy import load_file

# N ranks against one process (and a checkpoint resumed on another mesh): fp32 throughout, and
# what differs is only the order of sums (per-rank partial gradients reduce-scattered, per-rank
# padding changing matmul shapes), ~1e-6 relative per step, amplified by AdamW on near-zero
# gradients; any real mistake (a rank's rows dropped or counted twice, a stale shard) moves the
# losses and adapters by > 1e-2.
RANKS_TOL = 1e-4


class Checks:
    """Prints a PASS/FAIL line per check; summary() prints "N passed, M failed" and is the exit code."""

    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, ok, what):
        ok = bool(ok)
        self.passed += ok
        self.failed += not ok
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        return ok

    def summary(self):
        print(f"{self.passed} passed, {self.failed} failed")
        return 0 if self.failed == 0 else 1


def recipe_args(*extra):
    """The recipe tests' command line (--qlora, --qlora-faults, --workdir, plus `extra`: (flag,
    kwargs) pairs); the work directory is emptied first."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--qlora-faults", required=True, help="qlora with QLORA_FAULT_PLAN (tests/tools/qlora_faults.cpp)")
    ap.add_argument("--workdir", required=True)
    for flag, kwargs in extra:
        ap.add_argument(flag, **kwargs)
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    return a


def run_recipe(exe, out, *overrides, nproc=1, fault=None, expect_rc=0, timeout=600, recipe="lora_finetune"):
    """`exe run [--nproc-per-node N] RECIPE checkpoint.output_dir=OUT OVERRIDES`; `fault` is a
    QLORA_FAULT_PLAN for the qlora_faults test binary (pass it as `exe`). Prints the command and the
    output's tail when the exit code is not `expect_rc`."""
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [exe, "run", *launch, recipe, f"checkpoint.output_dir={out}", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "QLORA_FAULT_PLAN": fault or ""})
    if r.returncode != expect_rc:
        print(" ".join(cmd), "\n", r.stdout[-3000:], r.stderr[-3000:])
    return r


def metrics_rows(out):
    """Every row of OUT/metrics.jsonl: optimizer steps and validations (rows with val_tokens; GRPO's
    have no val_loss)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_rows(out):
    return [r for r in metrics_rows(out) if "val_tokens" not in r]


def val_rows(out):
    return [r for r in metrics_rows(out) if "val_tokens" in r]


def losses(out):
    return [row["loss"] for row in step_rows(out)]


def adapter(out, epoch=0):
    return load_file(os.path.join(out, f"epoch_{epoch}", "adapter", "adapter_model.safetensors"))


def safetensors_of(model_dir):
    """Every tensor of a checkpoint directory's .safetensors files, as torch tensors."""
    from safetensors.torch import load_file as load_torch  # torch only where a test needs it
    tensors = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_torch(os.path.join(model_dir, f)))
    return tensors


def max_diff(a, b):
    """Largest |a[i] - b[i]| of two lists of numbers; inf when their lengths differ."""
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else float("inf")


def max_tensor_diff(a, b):
    """Largest |a[k] - b[k]| over two dicts of arrays; inf when their keys or shapes differ."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max((float(np.abs(a[k] - b[k]).max()) for k in a), default=0.0)
