"""Validation loss: data.val_path or a held-out data.val_fraction, evaluated every
training.eval_every_steps and at each epoch end, on 1..N ranks.

1. It measures what training measures: with the validation file equal to the training set and
   one batch holding all of it, the validation loss after step k equals the training loss of
   step k + 1 (same weights, same tokens; 1e-6 relative leaves room for summation order only).
2. It changes nothing: a run with validation (and LoRA dropout, which draws random numbers) has
   exactly the training losses and adapters of the same run without it.
3. Where it appears: metrics.jsonl rows (val_loss, val_perplexity = exp(val_loss), val_tokens) at
   every eval_every_steps and once at each epoch end, the progress output and the epoch summary;
   val_fraction holds its records out of training (fewer samples trained on).
4. 2 ranks (the last global batch short, so a rank fills its share with masked rows) report the
   same validation losses as one process.
5. A run killed and resumed logs the same validation rows as the uninterrupted one.
6. Errors: eval_every_steps without validation data; a missing val_path; data whose every
   response is truncated away.
"""
import json
import math
import os
import sys

from recipe_common import Checks, RANKS_TOL, adapter, max_diff, recipe_args, run_recipe, step_rows, val_rows

SHORT = ["training.epochs=1", "training.max_steps_per_epoch=6", "logging.progress=plain"]
TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tiny_tasks.jsonl")


def same_as_training(check, a):
    # 1. validation on the training batch itself
    small = os.path.join(a.workdir, "eight.jsonl")
    with open(TASKS) as f, open(small, "w") as g:
        g.writelines(f.readlines()[:8])
    out = os.path.join(a.workdir, "same")
    r = run_recipe(a.qlora, out, f"data.path={small}", f"data.val_path={small}", "data.shuffle=false",
                   "training.batch_size=8", "training.epochs=5", "logging.progress=plain")  # one step per epoch
    val = {x["step"]: x["val_loss"] for x in val_rows(out)}
    train = {x["step"]: x["loss"] for x in step_rows(out)}
    pairs = [(val[k], train[k + 1]) for k in range(1, 5) if k in val and k + 1 in train]
    check(r.returncode == 0 and len(pairs) == 4 and all(abs(v - t) <= 1e-6 * abs(t) for v, t in pairs),
          f"validation after step k = training loss of step k+1 on the same batch ({pairs})")


def changes_nothing(check, a):
    # 2. and 3.
    plain = os.path.join(a.workdir, "plain")
    run_recipe(a.qlora, plain, "data.val_fraction=0.05", "lora.dropout=0.1", *SHORT)
    val = os.path.join(a.workdir, "val")
    r = run_recipe(a.qlora, val, "data.val_fraction=0.05", "lora.dropout=0.1", "training.eval_every_steps=2", *SHORT)
    check(r.returncode == 0 and [x["loss"] for x in step_rows(val)] == [x["loss"] for x in step_rows(plain)] and
          max_diff_adapters(val, plain) == 0.0,
          "with dropout on, validating every 2 steps leaves the training losses and adapters bit for bit")
    rows = val_rows(val)
    check([x["step"] for x in rows] == [2, 4, 6] and all(
        abs(x["val_perplexity"] - math.exp(x["val_loss"])) < 1e-9 * x["val_perplexity"] and x["val_tokens"] > 0
        for x in rows), f"metrics.jsonl: val rows at steps 2, 4, 6 (the epoch end once) with perplexity and tokens")
    check(rows[-1]["val_loss"] < rows[0]["val_loss"], f"the validation loss falls ({rows[0]['val_loss']:.4f} -> "
          f"{rows[-1]['val_loss']:.4f})")
    lines = [l for l in r.stdout.splitlines() if "val_loss" in l]
    check(len(lines) == 4 and "epoch 1/1 done:" in lines[-1] and "train loss" in lines[-1],
          f"progress prints each validation and the epoch summary carries the last ({lines[-1:]})")
    check("1900 samples" in r.stdout, "val_fraction=0.05 holds 100 of the 2000 records out of training")
    return rows


def max_diff_adapters(x_out, y_out):
    x, y = adapter(x_out), adapter(y_out)
    return max(float(abs(x[k] - y[k]).max()) for k in x) if x.keys() == y.keys() else float("inf")


def on_ranks(check, a):
    # 4. 100 validation records: 12 full global batches of 8 and one of 4, which rank 0 takes whole
    #    while rank 1 fills its share with masked rows (no dropout: ranks draw their own masks)
    args = ["data.val_fraction=0.05", "training.eval_every_steps=2", *SHORT]
    one = os.path.join(a.workdir, "ranks1")
    run_recipe(a.qlora, one, *args, "training.batch_size=8")
    one_rows = val_rows(one)
    out = os.path.join(a.workdir, "ranks2")
    r = run_recipe(a.qlora, out, *args, "training.batch_size=4", nproc=2)
    got = [x["val_loss"] for x in val_rows(out)]
    check(r.returncode == 0 and max_diff(got, [x["val_loss"] for x in one_rows]) < RANKS_TOL and
          [x["val_tokens"] for x in val_rows(out)] == [x["val_tokens"] for x in one_rows],
          f"2 ranks: the same validation losses and token counts as one process ({got})")


def resumed(check, a, one_rows):
    # 5. killed after step 3, resumed from step 2
    out = os.path.join(a.workdir, "killed")
    args = ["data.val_fraction=0.05", "lora.dropout=0.1", "training.eval_every_steps=2",
            "checkpoint.save_every_steps=2", *SHORT]
    run_recipe(a.qlora_faults, out, *args, fault="kill_after_step=3", expect_rc=-9)
    r = run_recipe(a.qlora, out, *args, "checkpoint.resume=true")
    check(r.returncode == 0 and val_rows(out) == one_rows, "killed after step 3 and resumed: the same validation rows")


def default_has_heldout(check, a):
    # The embedded default (data.path "") validates on its bundled held-out file.
    out = os.path.join(a.workdir, "default")
    r = run_recipe(a.qlora, out, *SHORT)
    rows = val_rows(out)
    check(r.returncode == 0 and [x["step"] for x in rows] == [6] and "val_loss" in r.stdout,
          "the embedded default validates on its held-out file at the epoch end")


def errors(check, a):
    # 6.
    out = os.path.join(a.workdir, "errors")
    r = run_recipe(a.qlora, out, f"data.path={TASKS}", "training.eval_every_steps=5", *SHORT, expect_rc=1)
    check(r.returncode == 1 and "data.val_path or data.val_fraction" in r.stderr,
          "eval_every_steps without validation data is refused, naming the keys")
    r = run_recipe(a.qlora, out, "data.val_path=/nonexistent/val.jsonl", *SHORT, expect_rc=1)
    check(r.returncode == 1 and "/nonexistent/val.jsonl" in r.stderr, "a missing val_path is named")
    # Every response cut by max_seq_len: training data with nothing to learn is refused (it used to
    # "train" with loss 0.0); validation data likewise.
    # (the default's prompts are at least 9 tokens: BOS, 5 template pieces, an input of >= 3)
    r = run_recipe(a.qlora, out, "data.max_seq_len=8", *SHORT, expect_rc=1)
    check(r.returncode == 1 and "no sample has a trained token" in r.stderr and "data.max_seq_len = 8" in r.stderr,
          "a data set whose every response is truncated away is refused, naming data.max_seq_len")


def main():
    a = recipe_args()
    check = Checks()
    same_as_training(check, a)
    rows = changes_nothing(check, a)
    on_ranks(check, a)
    resumed(check, a, rows)
    default_has_heldout(check, a)
    errors(check, a)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
