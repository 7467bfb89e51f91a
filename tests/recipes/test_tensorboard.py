"""logging.tensorboard = true through the binary, read back with the PyPI tensorboard package's
event reader (EventAccumulator), never with our own parser:

1. a lora_finetune run with validation: OUTPUT_DIR/tb holds one event file whose scalars are
   metrics.jsonl's numbers, tag by tag and step by step (loss, val_loss, lr, grad_norm,
   tokens_per_second, peak_memory_bytes, ...), as float32;
2. killed by SIGKILL after step 10 (its last checkpoint at step 8) and resumed: every step appears
   once, and the scalars equal the final metrics.jsonl (the steps 9-10 the killed run logged are
   dropped from its file, not repeated);
3. on 2 ranks only rank 0 writes (one event file);
4. a lora_dpo run logs its rewards (rewards/margins, val_rewards/accuracies, ...);
5. without the key no tb directory is made.
"""
import glob
import math
import os

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipe_common import Checks, metrics_rows, recipe_args, run_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["training.epochs=1", "training.max_steps_per_epoch=12", "training.eval_every_steps=4",
          "data.val_fraction=0.2", "checkpoint.save_every_steps=4", "checkpoint.adapter_only=true",
          "logging.progress=plain", "logging.tensorboard=true"]


def scalars(out):
    """{tag: [(step, value)]} as TensorBoard reads OUT/tb."""
    ea = EventAccumulator(os.path.join(out, "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def expected(out):
    """{tag: [(step, float32 value)]} from metrics.jsonl's finite numbers."""
    want = {}
    for row in metrics_rows(out):
        for k, v in row.items():
            if k not in ("step", "epoch") and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                want.setdefault(k, []).append((row["step"], float(np.float32(v))))
    return want


def same(check, got, want, label, must=()):
    missing = [t for t in must if t not in got]
    check(not missing, f"{label}: tags {sorted(must)} present (missing {missing})")
    bad = [t for t in want if sorted(got.get(t, [])) != sorted(want[t])]
    check(set(got) == set(want) and not bad,
          f"{label}: {len(want)} tags equal metrics.jsonl step by step (differing: {bad[:3]})")


def main():
    a = recipe_args()
    check = Checks()
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731
    must = ["loss", "val_loss", "lr", "grad_norm", "tokens_per_second", "peak_memory_bytes"]

    r = run_recipe(a.qlora, w("full"), *COMMON)
    check(r.returncode == 0, "a run with logging.tensorboard = true exits 0")
    check(len(glob.glob(os.path.join(w("full"), "tb", "events.out.tfevents.*"))) == 1, "one event file in tb/")
    same(check, scalars(w("full")), expected(w("full")), "uninterrupted run", must)

    r = run_recipe(a.qlora_faults, w("killed"), *COMMON, fault="kill_after_step=10", expect_rc=-9)
    check(r.returncode == -9 and max(s for s, _ in scalars(w("killed"))["loss"]) == 10,
          "the killed run logged up to step 10")
    r = run_recipe(a.qlora, w("killed"), *COMMON, "checkpoint.resume=true")
    got = scalars(w("killed"))
    check(r.returncode == 0 and [s for s, _ in got.get("loss", [])] == list(range(1, 13)),
          "resumed: each step's loss once, steps 1..12")
    same(check, got, expected(w("killed")), "resumed run", must)
    check(sorted(got["loss"]) == sorted(expected(w("full"))["loss"]), "resumed: the losses are the uninterrupted run's")

    r = run_recipe(a.qlora, w("ranks2"), *COMMON, "training.batch_size=8", nproc=2)
    check(r.returncode == 0 and len(glob.glob(os.path.join(w("ranks2"), "tb", "events.out.tfevents.*"))) == 1,
          "2 ranks: one event file (rank 0's)")

    r = run_recipe(a.qlora, w("dpo"), "--config", os.path.join(ROOT, "configs", "tiny_qlora_dpo.toml"),
                   f"data.path={ROOT}/tests/data/tiny_preferences.jsonl",
                   f"data.val_path={ROOT}/tests/data/tiny_preferences_heldout.jsonl", "training.epochs=1",
                   "training.max_steps_per_epoch=4", "training.eval_every_steps=2", "logging.progress=plain",
                   "logging.tensorboard=true", recipe="lora_dpo")
    check(r.returncode == 0, "a lora_dpo run with logging.tensorboard = true exits 0")
    same(check, scalars(w("dpo")), expected(w("dpo")), "lora_dpo",
         ["loss", "rewards/margins", "rewards/accuracies", "val_rewards/margins", "val_rewards/accuracies"])

    r = run_recipe(a.qlora, w("off"), "training.epochs=1", "training.max_steps_per_epoch=2", "logging.progress=plain")
    check(r.returncode == 0 and not os.path.exists(os.path.join(w("off"), "tb")), "without the key no tb/ is written")
    return check.summary()


if __name__ == "__main__":
    raise SystemExit(main())
