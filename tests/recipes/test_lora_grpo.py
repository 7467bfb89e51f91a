"""`qlora run lora_grpo` end to end through the real binary, on configs/tiny_qlora_grpo.toml (the
embedded tiny base asked 512 sums with a full stop after them, a layout it never saw, rewarded by the
numeric answer):

1. the embedded default learns what its base cannot do: `qlora generate` (greedy) answers the 50
   held-out sums right on the base as a user loads it (dense) few times, and on the run's last export
   (the merged model a user receives) at least MARGIN more; metrics.jsonl has TRL's reward and
   completion names; `qlora plot` draws the reward and completion length;
2. every loss type, sequence-level importance sampling, batch-scaled rewards and beta != 0 (with its
   KL logged) run with finite losses;
3. 2 ranks give one process's rewards exactly (the same completions: each is seeded by its place in
   the step) and its losses and adapters within RANKS_TOL;
4. a run killed by SIGKILL with its rollouts half reused (num_iterations 2) resumes to the
   uninterrupted run's losses exactly and byte-identical adapters (on the same ranks; another number
   is refused for that checkpoint); between rollouts a 1-process checkpoint resumes on 2 ranks;
5. the reward program: its failure stops the run naming the command, and the checkpoint saved before
   stays and resumes; a prompt that fills the context is refused naming its line; lora_grpo refuses
   another recipe's data format.
"""
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

from recipe_common import (RANKS_TOL, Checks, adapter, losses, max_diff, max_tensor_diff, recipe_args, run_recipe,
                           step_rows)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_qlora_grpo.toml")
DATA = [f"data.path={ROOT}/tests/data/tiny_prompts.jsonl", f"data.val_path={ROOT}/tests/data/tiny_prompts_heldout.jsonl"]
HELDOUT = os.path.join(ROOT, "tests", "data", "tiny_prompts_heldout.jsonl")
# Held-out sums (of 50) the export must answer beyond the base: the bar; measured 9 -> 33.
MARGIN = 16


def grpo(exe, out, *overrides, **kw):
    return run_recipe(exe, out, "--config", CONFIG, *DATA, "logging.progress=plain", *overrides, recipe="lora_grpo", **kw)


def answered(exe, model_dir):
    """How many held-out sums `qlora generate --prompt` answers right, greedy (two at a time)."""
    with open(HELDOUT) as f:
        records = [json.loads(line) for line in f]

    def right(r):
        p = subprocess.run([exe, "generate", "--checkpoint", model_dir, "--prompt", r["prompt"], "--max-new-tokens", "8"],
                           capture_output=True, text=True)
        return p.returncode == 0 and p.stdout.strip() == r["answer"]
    with ThreadPoolExecutor(2) as pool:
        return sum(pool.map(right, records)), len(records)


def learns(a, check, w):
    r = grpo(a.qlora, w("full"))
    check(r.returncode == 0, "the tiny GRPO run exits 0")
    base, n = answered(a.qlora, os.path.join(w("full"), "tiny_base"))
    after, _ = answered(a.qlora, os.path.join(w("full"), "epoch_1"))
    print(f"held-out sums answered right by qlora generate (greedy): {base}/{n} by the base (dense), "
          f"{after}/{n} by the export")
    check(base <= n // 4 and after >= base + MARGIN,
          f"the export answers {after}/{n} held-out sums, the base {base}/{n} (a task it cannot do; >= +{MARGIN})")
    first = step_rows(w("full"))[0]
    names = ["reward", "reward_std", "rewards/answer/mean", "completions/mean_length", "completions/max_length",
             "completions/clipped_ratio", "clip_ratio/region_mean", "entropy", "frac_reward_zero_std"]
    check(all(k in first for k in names), f"metrics.jsonl has TRL's names: {sorted(first)}")
    svg = os.path.join(w("full"), "curves.svg")
    p = subprocess.run([a.qlora, "plot", w("full"), "-o", svg], capture_output=True, text=True)
    check(p.returncode == 0 and 'data-panel="reward"' in open(svg).read() and 'data-panel="completion_length"' in
          open(svg).read(), f"qlora plot draws the reward and completion length {p.stderr}")


def objectives(a, check, w):
    short = ["training.epochs=1", "training.max_steps_per_epoch=2", "training.batch_size=4"]
    for name, extra in (("grpo", ["grpo.loss_type=grpo"]), ("dr_grpo", ["grpo.loss_type=dr_grpo"]),
                        ("bnpo", ["grpo.loss_type=bnpo"]), ("cispo", ["grpo.loss_type=cispo", "grpo.epsilon_high=5"]),
                        ("gspo", ["grpo.importance_sampling_level=sequence", "grpo.scale_rewards=batch"]),
                        ("kl", ["grpo.beta=0.04", "grpo.num_iterations=2", "grpo.temperature=0.7"])):
        r = grpo(a.qlora, w(name), *short, *extra)
        rows = step_rows(w(name)) if r.returncode == 0 else []
        ok = len(rows) == 2 and all(abs(x["loss"]) < 1e3 for x in rows)
        check(ok and (name != "kl" or all("kl" in x for x in rows)), f"{name}: 2 steps with finite losses")


def ranks_and_resume(a, check, w):
    short = ["training.epochs=1", "training.max_steps_per_epoch=6", "checkpoint.save_every_steps=3", "grpo.num_iterations=2",
             "training.batch_size=4"]
    r = grpo(a.qlora, w("ref"), *short)
    ref = losses(w("ref"))
    check(r.returncode == 0 and len(ref) == 6, "the short run exits 0 after 6 steps")
    r = grpo(a.qlora, w("ranks2"), *short[:-1], "training.batch_size=2", nproc=2)
    rewards = lambda out: [x["reward"] for x in step_rows(out)]  # noqa: E731
    check(r.returncode == 0 and rewards(w("ranks2")) == rewards(w("ref")), "2 ranks: the same rewards (same completions)")
    check(max_diff(losses(w("ranks2")), ref) <= RANKS_TOL, f"2 ranks: losses within {RANKS_TOL} of one process's")
    check(max_tensor_diff(adapter(w("ranks2")), adapter(w("ref"))) <= RANKS_TOL, "2 ranks: adapters agree")
    r = grpo(a.qlora_faults, w("killed"), *short, fault="kill_after_step=4", expect_rc=-9)
    check(r.returncode == -9, "the run dies by SIGKILL at step 4 (its checkpoint of step 3 holds a half-used rollout)")
    r = grpo(a.qlora, w("killed"), *short[:-1], "training.batch_size=2", "checkpoint.resume=true", nproc=2, expect_rc=1)
    check(r.returncode == 1 and "only the same ranks can continue" in r.stderr,
          "a checkpoint holding a half-used rollout is not resumed on another number of ranks, saying why")
    r = grpo(a.qlora, w("killed"), *short, "checkpoint.resume=true")
    check(r.returncode == 0 and losses(w("killed")) == ref, "resume after the kill: losses equal the uninterrupted run's")
    check(max_tensor_diff(adapter(w("killed")), adapter(w("ref"))) == 0, "resume after the kill: adapters byte-identical")
    # 1 -> 2 ranks between rollouts (num_iterations 1): the resumed run continues within RANKS_TOL.
    once = [x for x in short if not x.startswith("grpo.num_iterations")]
    grpo(a.qlora, w("ref1"), *once)
    grpo(a.qlora_faults, w("remesh"), *once, fault="kill_after_step=4", expect_rc=-9)
    r = grpo(a.qlora, w("remesh"), *once[:-1], "training.batch_size=2", "checkpoint.resume=true", nproc=2)
    check(r.returncode == 0 and max_diff(losses(w("remesh")), losses(w("ref1"))) <= RANKS_TOL,
          f"a 1-process checkpoint resumed on 2 ranks: losses within {RANKS_TOL} of the uninterrupted run's")


def refusals(a, check, w):
    # While FLAG exists the program fails on its third batch (step 3): the checkpoint of step 2
    # stays and resumes (the same command: its text is part of the run's config).
    counter, flag = w("calls"), w("fail")
    open(flag, "w").close()
    cmd = (f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}; "
           f"if [ $n -ge 2 ] && [ -e {flag} ]; then echo boom >&2; exit 3; fi; while read l; do echo 0.5; done")
    short = ["training.epochs=1", "training.max_steps_per_epoch=4", "checkpoint.save_every_steps=2", "training.batch_size=2",
             f"grpo.reward_command={cmd}"]
    r = grpo(a.qlora, w("command"), *short, expect_rc=1)
    check(r.returncode == 1 and "exited with code 3" in r.stderr and "boom" in r.stderr and cmd in r.stderr and
          losses(w("command")) and len(losses(w("command"))) == 2, "a failing reward command stops the run after "
          f"step 2, naming the command, its exit code and its stderr: {r.stderr[-300:]}")
    os.remove(flag)
    r = grpo(a.qlora, w("command"), *short, "checkpoint.resume=true")
    check(r.returncode == 0 and "resumed from" in r.stdout and len(losses(w("command"))) == 4,
          "the checkpoint saved before the failure resumes")
    r = grpo(a.qlora, w("long"), "data.max_seq_len=10", expect_rc=1)
    check(r.returncode == 1 and "tiny_prompts.jsonl: line 1" in r.stderr and "data.max_seq_len = 10" in r.stderr,
          f"a prompt that fills the context is refused naming its line: {r.stderr[-300:]}")
    r = grpo(a.qlora, w("pairs"), f"data.path={ROOT}/tests/data/tiny_preferences.jsonl", "data.val_path=",
             "data.format=preference", expect_rc=1)
    check(r.returncode == 1 and 'data.format = "prompt"' in r.stderr, "lora_grpo refuses preference pairs, naming "
          f"data.format: {r.stderr[-200:]}")


def main():
    a = recipe_args()
    check = Checks()
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731
    learns(a, check, w)
    objectives(a, check, w)
    ranks_and_resume(a, check, w)
    refusals(a, check, w)
    return check.summary()


if __name__ == "__main__":
    raise SystemExit(main())
