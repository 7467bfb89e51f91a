"""What a run does when training goes wrong: a diverging or NaN step, and a damaged checkpoint.

1. optim.lr=1e6 (the issue's run): the loss or gradient norm stops being finite within a few steps;
   on_nonfinite="stop" ends the run with an error naming the step and the last good checkpoint,
   every checkpoint left is finite (keep_last_n=2 kept the newest finite ones) and no export of
   NaN weights exists; on_nonfinite="skip" drops those steps and stops after
   max_consecutive_skips of them in a row.
2. A NaN loss at one step (the fault plan nan_at_step): "skip" drops exactly that step's update
   (logged as skipped), the run goes on, its exports are finite, and the steps before it match the
   clean run exactly; "stop" stops there, and resuming from the named checkpoint with "skip"
   gives the same run bit for bit. On 2 ranks, a NaN on rank 1 alone is skipped by both ranks
   alike (no hang) and the losses agree with one process.
3. A damaged newest resume checkpoint (a flipped byte, a truncated file): checkpoint.resume=true
   skips it, says which and why, sets it aside and continues from the newest intact one with
   the losses of the uninterrupted run.
"""
import glob
import math
import os
import shutil
import sys

import numpy as np
import torch
from safetensors.torch import load_file

from recipe_common import Checks, RANKS_TOL, adapter, max_diff, metrics_rows, recipe_args, run_recipe, step_rows

SHORT = ["training.epochs=1", "training.max_steps_per_epoch=6", "logging.progress=plain"]


def finite_files(paths):
    """True when every float tensor in every safetensors file is finite."""
    for p in paths:
        for t in load_file(p).values():
            if t.is_floating_point() and not torch.isfinite(t).all():
                return False
    return True


def checkpoints(out):
    return sorted(os.path.basename(d) for d in glob.glob(os.path.join(out, "checkpoints", "step_*")))


def losses(out):
    return [(r["step"], r.get("loss")) for r in step_rows(out)]


def diverging(check, a):
    # 1. the run: lr = 1e6
    out = os.path.join(a.workdir, "lr1e6_stop")
    r = run_recipe(a.qlora, out, "optim.lr=1e6", "checkpoint.save_every_steps=1", "checkpoint.keep_last_n=2",
                   *SHORT, expect_rc=1)
    rows = metrics_rows(out)
    bad = [x["step"] for x in rows if x.get("skipped")]
    kept = checkpoints(out)
    check(r.returncode == 1 and len(bad) == 1 and f"step {bad[0]}:" in r.stderr and "not finite" in r.stderr,
          f"lr=1e6, on_nonfinite=stop: stops at the first non-finite step, naming it ({bad}; {r.stderr.strip()[-300:]})")
    newest = f"step_{bad[0] - 1:08d}" if bad else "?"
    check(kept and kept[-1] == newest and newest in r.stderr,
          f"the error names the last good checkpoint, the newest kept ({kept}, expected {newest})")
    files = glob.glob(os.path.join(out, "checkpoints", "step_*", "*.safetensors"))
    check(files and finite_files(files), f"every checkpoint left is finite ({len(files)} files)")
    check(not os.path.exists(os.path.join(out, "epoch_0")), "no export of the diverged run")

    out = os.path.join(a.workdir, "lr1e6_skip")
    r = run_recipe(a.qlora, out, "optim.lr=1e6", "training.on_nonfinite=skip", "training.max_consecutive_skips=2",
                   "checkpoint.save_every_steps=1", *SHORT, expect_rc=1)
    rows = metrics_rows(out)
    skipped = [x["step"] for x in rows if x.get("skipped")]
    check(r.returncode == 1 and len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3)) and
          "max_consecutive_skips" in r.stderr,
          f"on_nonfinite=skip: two non-finite steps in a row skipped, the third stops the run ({skipped})")
    files = glob.glob(os.path.join(out, "checkpoints", "step_*", "*.safetensors"))
    check(files and finite_files(files), "every checkpoint of the skipping run is finite")


def one_nan_step(check, a):
    # 2. a NaN loss at step 3 only
    clean = os.path.join(a.workdir, "clean")
    run_recipe(a.qlora, clean, "checkpoint.save_every_steps=2", *SHORT)
    skip = os.path.join(a.workdir, "nan_skip")
    r = run_recipe(a.qlora_faults, skip, "training.on_nonfinite=skip", "checkpoint.save_every_steps=2", *SHORT,
                   fault="nan_at_step=3")
    got, ref = losses(skip), losses(clean)
    rows = metrics_rows(skip)
    check(r.returncode == 0 and [x["step"] for x in rows if x.get("skipped")] == [3] and got[3 - 1][1] is None,
          "skip: the NaN step 3 is logged as skipped (loss null) and the run finishes")
    check(got[:2] == ref[:2] and got[3][1] != ref[3][1] and all(l is not None and math.isfinite(l) for _, l in got[3:]),
          "steps before it equal the clean run's exactly; later steps differ (one update fewer) and stay finite")
    check(finite_files([os.path.join(skip, "epoch_0", "adapter", "adapter_model.safetensors")] +
                       glob.glob(os.path.join(skip, "epoch_0", "*.safetensors"))),
          "its exports (adapter and merged model) are finite")

    stop = os.path.join(a.workdir, "nan_stop_then_skip")
    r = run_recipe(a.qlora_faults, stop, "checkpoint.save_every_steps=2", *SHORT, fault="nan_at_step=3", expect_rc=1)
    check(r.returncode == 1 and "step 3:" in r.stderr and "step_00000002" in r.stderr and
          "training.on_nonfinite=skip" in r.stderr, "stop: the error names step 3 and checkpoints/step_00000002")
    r = run_recipe(a.qlora_faults, stop, "training.on_nonfinite=skip", "checkpoint.save_every_steps=2",
                   "checkpoint.resume=true", *SHORT, fault="nan_at_step=3")
    check(r.returncode == 0 and losses(stop) == got and max_diff_adapters(stop, skip) == 0.0,
          "resuming the stopped run with on_nonfinite=skip is the skipping run bit for bit")

    ranks = os.path.join(a.workdir, "nan_skip_2ranks")
    r = run_recipe(a.qlora_faults, ranks, "training.on_nonfinite=skip", "training.batch_size=4", *SHORT, nproc=2,
                   fault="nan_at_step=3,rank=1")
    one = os.path.join(a.workdir, "nan_skip_bs8")
    run_recipe(a.qlora_faults, one, "training.on_nonfinite=skip", "training.batch_size=8", *SHORT, fault="nan_at_step=3")
    g2, g1 = losses(ranks), losses(one)
    check(r.returncode == 0 and [x["step"] for x in metrics_rows(ranks) if x.get("skipped")] == [3] and
          max_diff([l for _, l in g2 if l is not None], [l for _, l in g1 if l is not None]) < RANKS_TOL,
          "2 ranks, NaN on rank 1 only: both skip step 3 and the losses equal one process's")


def max_diff_adapters(a_out, b_out):
    x, y = adapter(a_out), adapter(b_out)
    return max(float(np.abs(x[k] - y[k]).max()) for k in x) if x.keys() == y.keys() else float("inf")


def damaged_newest(check, a):
    # 3. the newest checkpoint damaged in two ways
    ref = os.path.join(a.workdir, "clean")  # written by one_nan_step: 6 steps, checkpoints at 2, 4, 6
    for how in ("flip", "truncate"):
        out = os.path.join(a.workdir, f"damaged_{how}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(ref, out)
        newest = sorted(glob.glob(os.path.join(out, "checkpoints", "step_*")))[-1]
        target = os.path.join(newest, "rank_00000.safetensors")
        with open(target, "r+b") as f:
            if how == "flip":
                f.seek(os.path.getsize(target) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x40]))
            else:
                f.truncate(os.path.getsize(target) - 7)
        r = run_recipe(a.qlora, out, "checkpoint.save_every_steps=2", "checkpoint.resume=true", *SHORT)
        name = os.path.basename(newest)
        left = checkpoints(out)
        check(r.returncode == 0 and f"skipping damaged checkpoint {newest}" in r.stdout and
              ("xxh64" in r.stdout or "bytes" in r.stdout or "size" in r.stdout) and "step_00000004" in r.stdout,
              f"{how}: resume skips {name}, saying why, and continues from step_00000004")
        check(os.path.isdir(newest + ".damaged"), f"{how}: the damaged checkpoint is kept aside as {name}.damaged")
        resumed = [l for s, l in losses(out) if s in (5, 6)]
        check(resumed == [l for s, l in losses(ref) if s in (5, 6)] and name in left,
              f"{how}: steps 5-6 rerun with the uninterrupted run's losses; {name} is written again ({left})")


def main():
    a = recipe_args()
    check = Checks()
    diverging(check, a)
    one_nan_step(check, a)
    damaged_newest(check, a)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
