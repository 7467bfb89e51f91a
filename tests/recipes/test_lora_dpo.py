"""`qlora run lora_dpo` end to end through the real binary, on configs/tiny_qlora_dpo.toml (the
embedded tiny base, 512 add/reverse preference pairs, 100 held out in the conversational form):

1. the first step's sigmoid loss is ln 2 (policy = reference: the adapters start with B = 0) and
   its rewards are 0; IPO's first loss is (1/(2 beta))^2, hinge's 1, SimPO's its formula on the
   logged average log-probs; ORPO runs;
2. started, as users run it, from a supervised fine-tune (the SFT default's merged export of epoch 4),
   the held-out rewards/accuracies (chosen over rejected) ends >= 0.9;
3. dpo.precompute_reference = true gives the per-step reference's losses, keeps the table in the
   output dir, and a resume after SIGKILL reads it back and continues exactly;
4. 2 and 3 ranks give one process's losses and adapters, and grad_accum 2 x 6 pairs one batch of 12;
5. a run killed by SIGKILL mid-epoch and resumed gives the uninterrupted run's losses exactly and
   byte-identical adapters; a lora_finetune checkpoint is not resumed by lora_dpo, nor preference
   data trained by lora_finetune.
"""
import math
import os

from recipe_common import (RANKS_TOL, Checks, adapter, losses, max_diff, max_tensor_diff, recipe_args, run_recipe,
                           step_rows, val_rows)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_qlora_dpo.toml")
DATA = [f"data.path={ROOT}/tests/data/tiny_preferences.jsonl",
        f"data.val_path={ROOT}/tests/data/tiny_preferences_heldout.jsonl"]
# Precomputed or per step, the reference's log-probs come from batches of other shapes: fp32 sums in
# another order (~1e-7 relative), nothing a wrong pair or a missed reference would keep below 1e-2.
PRECOMPUTE_TOL = 1e-4


def dpo(exe, out, *overrides, **kw):
    return run_recipe(exe, out, "--config", CONFIG, *DATA, "logging.progress=plain", *overrides,
                      recipe="lora_dpo", **kw)


def main():
    a = recipe_args()
    check = Checks()
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731

    # 1 + 2. the full run, on the SFT default's export. The tiny base itself never saw Alpaca's
    # no-input layout that the pairs render to: there DPO learns the sums but only memorises the
    # reversals (held-out reversals at chance, 0.54, with the base an AVX2 machine pre-trains).
    r = run_recipe(a.qlora, w("sft_default"), "logging.progress=plain")
    check(r.returncode == 0, "the SFT default exits 0 (the base of the full run)")
    r = dpo(a.qlora, w("full"), f"model.checkpoint_dir={w('sft_default')}/epoch_3")
    check(r.returncode == 0, "the tiny DPO run exits 0")
    rows = step_rows(w("full"))
    first = rows[0]
    check(abs(first["loss"] - math.log(2)) < 1e-6, f"first sigmoid loss is ln 2 ({first['loss']:.7f})")
    check(all(first[k] == 0 for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")),
          "first step's rewards are 0 (policy = reference)")
    names = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"]
    check(all(k in first for k in names), "metrics.jsonl has TRL's reward and log-prob names")
    vals = val_rows(w("full"))
    acc = vals[-1].get("val_rewards/accuracies", 0.0)
    check(acc >= 0.9, f"held-out rewards/accuracies {acc:.2f} >= 0.9")
    check(os.path.exists(os.path.join(w("full"), "epoch_3", "adapter", "adapter_model.safetensors")),
          "each epoch is exported (PEFT adapter)")

    beta = 0.3
    for loss, want in (("ipo", (1 / (2 * beta)) ** 2), ("hinge", 1.0)):
        r = dpo(a.qlora, w(loss), f"dpo.loss={loss}", "training.epochs=1", "training.max_steps_per_epoch=2")
        got = losses(w(loss))[0] if r.returncode == 0 else float("nan")
        check(abs(got - want) < 1e-5, f"first {loss} loss {got:.6f} == {want:.6f}")
    r = dpo(a.qlora, w("simpo"), "dpo.loss=simpo", "training.epochs=1", "training.max_steps_per_epoch=2")
    if check(r.returncode == 0, "simpo runs"):
        s = step_rows(w("simpo"))[0]
        z = beta * (s["logps/chosen"] - s["logps/rejected"]) - 0.5  # per pair in the step; the logged values are means
        check(s["loss"] > 0 and math.isfinite(s["loss"]), f"simpo's first loss is finite and positive ({s['loss']:.4f}, z of means {z:.3f})")
    r = dpo(a.qlora, w("orpo"), "dpo.loss=orpo", "training.epochs=1", "training.max_steps_per_epoch=4")
    check(r.returncode == 0 and all(math.isfinite(x) for x in losses(w("orpo"))), "orpo runs with finite losses")

    # 3 + 4 + 5 on two epochs of 8 steps, checkpoints every 4 steps
    short = ["training.epochs=2", "training.max_steps_per_epoch=8", "checkpoint.save_every_steps=4"]
    r = dpo(a.qlora, w("ref"), *short)
    ref = losses(w("ref"))
    check(r.returncode == 0 and len(ref) == 16, "the short run exits 0 after 16 steps")
    pre = dpo(a.qlora, w("pre"), *short, "dpo.precompute_reference=true")
    check(max_diff(losses(w("pre")), ref) <= PRECOMPUTE_TOL,
          f"precomputed reference: losses within {PRECOMPUTE_TOL} of the per-step reference's")
    check("computed, kept in" in pre.stdout and os.path.isfile(os.path.join(w("pre"), "dpo_reference.safetensors")),
          "precomputed reference: kept with the run (dpo_reference.safetensors)")
    dpo(a.qlora_faults, w("pre_killed"), *short, "dpo.precompute_reference=true", fault="kill_after_step=10", expect_rc=-9)
    r = dpo(a.qlora, w("pre_killed"), *short, "dpo.precompute_reference=true", "checkpoint.resume=true")
    check(r.returncode == 0 and "read from" in r.stdout and losses(w("pre_killed")) == losses(w("pre")),
          "precomputed reference: a resume reads the kept table and gives the uninterrupted losses exactly")
    r = dpo(a.qlora, w("ranks2"), *short, "training.batch_size=8", nproc=2)
    check(r.returncode == 0 and max_diff(losses(w("ranks2")), ref) <= RANKS_TOL,
          f"2 ranks: losses within {RANKS_TOL} of one process's")
    check(max_tensor_diff(adapter(w("ranks2"), 1), adapter(w("ref"), 1)) <= RANKS_TOL, "2 ranks: adapters agree")
    # The same global batch of 12 pairs as one process, 3 ranks x 4, and 1 process x 6 x grad_accum 2.
    g12 = ["training.epochs=1", "training.max_steps_per_epoch=6"]
    dpo(a.qlora, w("b12"), *g12, "training.batch_size=12")
    ref12 = losses(w("b12"))
    r = dpo(a.qlora, w("ranks3"), *g12, "training.batch_size=4", nproc=3)
    check(r.returncode == 0 and len(ref12) == 6 and max_diff(losses(w("ranks3")), ref12) <= RANKS_TOL,
          f"3 ranks: losses within {RANKS_TOL} of one process's")
    check(max_tensor_diff(adapter(w("ranks3")), adapter(w("b12"))) <= RANKS_TOL, "3 ranks: adapters agree")
    r = dpo(a.qlora, w("accum2"), *g12, "training.batch_size=6", "training.grad_accum=2")
    check(r.returncode == 0 and max_diff(losses(w("accum2")), ref12) <= RANKS_TOL,
          f"grad_accum 2 x 6 pairs: losses within {RANKS_TOL} of one batch of 12")
    r = dpo(a.qlora_faults, w("killed"), *short, fault="kill_after_step=10", expect_rc=-9)
    check(r.returncode == -9, "the run dies by SIGKILL at step 10")
    r = dpo(a.qlora, w("killed"), *short, "checkpoint.resume=true")
    check(r.returncode == 0 and losses(w("killed")) == ref, "resume after the kill: losses equal the uninterrupted run's exactly")
    check(all(max_tensor_diff(adapter(w("killed"), e), adapter(w("ref"), e)) == 0 for e in (0, 1)),
          "resume after the kill: both epochs' adapters byte-identical")

    r = run_recipe(a.qlora, w("ref"), "checkpoint.resume=true", expect_rc=1)
    check(r.returncode == 1 and "written by `qlora run lora_dpo`" in r.stderr, "lora_finetune refuses to resume a lora_dpo run")
    r = run_recipe(a.qlora, w("sft"), *DATA, "data.format=preference", expect_rc=1)
    check(r.returncode == 1 and "qlora run lora_dpo" in r.stderr, "lora_finetune refuses preference data, naming lora_dpo")
    return check.summary()


if __name__ == "__main__":
    raise SystemExit(main())
