"""The lora_finetune recipe on several ranks (`qlora run --nproc-per-node N`) trains like one process.

Same global batch: one process with batch_size 12 against W ranks with batch_size 12 / W (each rank
trains on its slice of the same sampled rows) for W = 2, 3, 4 and HSDP 2x2 (dist.shard_size=2).
Per-step losses and the final exported adapter must agree within RANKS_TOL (recipe_common.py says
why 1e-4).

Failure: a rank SIGKILLed mid-run (ranks started by hand with torchrun's variables, no launcher)
makes every other rank exit non-zero within 60 s naming it; under the launcher, the launcher names
it and exits non-zero.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from recipe_common import Checks, RANKS_TOL as TOL, adapter, losses, max_diff, max_tensor_diff, recipe_args, run_recipe

check = Checks()
COMMON = ["training.epochs=1", "training.max_steps_per_epoch=6", "training.grad_accum=1",
          "checkpoint.save_every_steps=0", "logging.progress=plain", "checkpoint.adapter_only=true"]


def run(qlora, out, nproc, *overrides):
    return run_recipe(qlora, out, *COMMON, *overrides, nproc=nproc)


def trace(out):
    return losses(out), adapter(out)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    a = recipe_args()

    ref_dir = os.path.join(a.workdir, "one")
    r = run(a.qlora, ref_dir, 1, "training.batch_size=12")
    check(r.returncode == 0, "single process, batch 12")
    ref_losses, ref_adapter = trace(ref_dir)

    for name, nproc, extra in [("2 ranks", 2, ["training.batch_size=6"]),
                               ("3 ranks", 3, ["training.batch_size=4"]),
                               ("4 ranks", 4, ["training.batch_size=3"]),
                               ("HSDP 2x2", 4, ["training.batch_size=3", "dist.shard_size=2"])]:
        out = os.path.join(a.workdir, name.replace(" ", "_"))
        r = run(a.qlora, out, nproc, *extra)
        if r.returncode != 0:
            check(False, f"{name}: run exits 0")
            continue
        got_losses, got_adapter = trace(out)
        dl = max_diff(got_losses, ref_losses)
        check(dl < TOL, f"{name}: per-step losses equal one process's (max diff {dl:.2e})")
        da = max_tensor_diff(got_adapter, ref_adapter)
        check(da < TOL, f"{name}: final adapter equals one process's (max diff {da:.2e})")
        check(not any(l.startswith("[rank") and "error" in l for l in r.stderr.splitlines()),
              f"{name}: no rank reported an error")

    # Gradient accumulation with packed rows, the engine's other schedule (reduce-scatter every
    # micro-batch, no prefetch, no reshard) and a merged export written by rank 0.
    extra = ["training.grad_accum=2", "data.packing=true", "checkpoint.adapter_only=false"]
    ref2 = os.path.join(a.workdir, "one_accum")
    r = run(a.qlora, ref2, 1, "training.batch_size=4", *extra)
    two = os.path.join(a.workdir, "two_accum")
    r2 = run(a.qlora, two, 2, "training.batch_size=2", *extra, "dist.reduce_scatter_every_micro_batch=true",
             "dist.prefetch=false", "dist.reshard_after_forward=false")
    if r.returncode == 0 and r2.returncode == 0:
        l1, _ = trace(ref2)
        l2, _ = trace(two)
        dl = max_diff(l1, l2)
        check(dl < TOL, f"2 ranks, packed rows, 2 micro-batches, other schedule: losses equal (max diff {dl:.2e})")
        g = subprocess.run([a.qlora, "generate", "--checkpoint", os.path.join(two, "epoch_0"), "--prompt", "Add",
                            "--max-new-tokens", "4"], capture_output=True, text=True)
        check(g.returncode == 0 and os.path.isfile(os.path.join(two, "epoch_0", "model.safetensors")),
              "the merged export of a sharded run loads and generates")
    else:
        check(False, "gradient accumulation / packing / merged export runs exit 0")

    # Sharded resume checkpoints: every rank writes its shards, rank 0 commits. A 2-rank run killed
    # after step 3 resumes from step 2 bit for bit; the same checkpoint resumes on 3 ranks and as
    # HSDP 2x2 (state resharded; global batch kept at 12) within TOL; a damaged shard is named.
    ck = ["checkpoint.save_every_steps=2", "checkpoint.keep_last_n=5"]
    full2 = os.path.join(a.workdir, "ck_full")
    r = run(a.qlora, full2, 2, "training.batch_size=6", *ck)
    check(r.returncode == 0 and os.path.isfile(os.path.join(full2, "checkpoints", "step_00000002", "rank_00001.safetensors")),
          "a 2-rank run writes sharded resume checkpoints")
    killed2 = os.path.join(a.workdir, "ck_killed")
    cmd = [a.qlora_faults, "run", "--nproc-per-node", "2", "lora_finetune", f"checkpoint.output_dir={killed2}", *COMMON,
           "training.batch_size=6", *ck]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "QLORA_FAULT_PLAN": "kill_after_step=3"})
    check(r.returncode != 0, "a 2-rank run killed after step 3 stops")
    copies = {}
    for name in ("remesh3", "hsdp", "damaged"):
        copies[name] = os.path.join(a.workdir, "ck_" + name)
        shutil.copytree(killed2, copies[name])
    r = run(a.qlora, killed2, 2, "training.batch_size=6", *ck, "checkpoint.resume=true")
    if r.returncode == 0:
        l_ref, ad_ref = trace(full2)
        l_res, ad_res = trace(killed2)
        check(l_res == l_ref, f"resumed on 2 ranks: per-step losses identical ({l_res} vs {l_ref})")
        same = ad_res.keys() == ad_ref.keys() and all(np.array_equal(ad_res[k], ad_ref[k]) for k in ad_ref)
        check(same, "resumed on 2 ranks: final adapter identical")
    else:
        check(False, "resume on 2 ranks exits 0")
    for name, nproc, extra in (("remesh3", 3, ["training.batch_size=4"]),
                               ("hsdp", 4, ["training.batch_size=3", "dist.shard_size=2"])):
        r = run(a.qlora, copies[name], nproc, *extra, *ck, "checkpoint.resume=true")
        if r.returncode != 0:
            check(False, f"resume the 2-rank checkpoint as {name} exits 0")
            continue
        l_ref, ad_ref = trace(full2)
        l_res, ad_res = trace(copies[name])
        dl = max_diff(l_res, l_ref)
        da = max_tensor_diff(ad_res, ad_ref)
        check(dl < TOL and da < TOL, f"2-rank checkpoint resumed as {name}: losses and adapter within {TOL} "
                                     f"(max diffs {dl:.1e}, {da:.1e})")
    # 4 -> 2 and HSDP -> full sharding: the HSDP 2x2 run above saved step 4 on 4 ranks.
    back = os.path.join(a.workdir, "ck_back_to_2")
    shutil.copytree(copies["hsdp"], back)
    shutil.rmtree(os.path.join(back, "checkpoints", "step_00000006"))
    with open(os.path.join(back, "checkpoints", "step_00000004", "manifest.json")) as f:
        man = json.load(f)
    r = run(a.qlora, back, 2, "training.batch_size=6", *ck, "checkpoint.resume=true")
    if r.returncode == 0 and man.get("world_size") == 4 and man.get("mesh", {}).get("shard_size") == 2:
        l_ref, ad_ref = trace(full2)
        l_res, ad_res = trace(back)
        dl = max_diff(l_res, l_ref)
        da = max_tensor_diff(ad_res, ad_ref)
        check(dl < TOL and da < TOL, f"a 4-rank HSDP checkpoint resumed on 2 ranks: within {TOL} ({dl:.1e}, {da:.1e})")
    else:
        check(False, f"resume a 4-rank HSDP checkpoint on 2 ranks exits 0 (manifest {man})")
    shard = os.path.join(copies["damaged"], "checkpoints", "step_00000002", "rank_00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    r = run(a.qlora, copies["damaged"], 2, "training.batch_size=6", *ck, "checkpoint.resume=true")
    check(r.returncode != 0 and "rank_00001.safetensors fails its checksum" in r.stderr,
          "a damaged shard is named by its checksum")

    # One engine, one checkpoint format: a one-process checkpoint resumes on 2 ranks, and a 2-rank
    # checkpoint in one process (global batch kept at 12), each within TOL of the uninterrupted run.
    full1 = os.path.join(a.workdir, "ck_one")
    r = run(a.qlora, full1, 1, "training.batch_size=12", *ck)
    for name, src, nproc, bs in (("one process -> 2 ranks", full1, 2, 6), ("2 ranks -> one process", full2, 1, 12)):
        dst = os.path.join(a.workdir, "ck_" + name.replace(" ", "_").replace(">", ""))
        shutil.copytree(src, dst)
        for later in ("step_00000004", "step_00000006"):
            shutil.rmtree(os.path.join(dst, "checkpoints", later), ignore_errors=True)
        r = run(a.qlora, dst, nproc, f"training.batch_size={bs}", *ck, "checkpoint.resume=true")
        if r.returncode != 0 or "resumed from" not in r.stdout:
            check(False, f"resume {name} exits 0")
            continue
        l_ref, ad_ref = trace(src)
        l_res, ad_res = trace(dst)
        dl = max_diff(l_res, l_ref)
        da = max_tensor_diff(ad_res, ad_ref)
        check(dl < TOL and da < TOL, f"resume {name}: losses and adapter within {TOL} ({dl:.1e}, {da:.1e})")

    # A rank killed while saving (its part written, the checkpoint not committed) leaves the
    # previous checkpoint as the newest complete one; the run resumes from it.
    dying = os.path.join(a.workdir, "ck_dying")
    r = subprocess.run([a.qlora_faults, "run", "--nproc-per-node", "2", "lora_finetune", f"checkpoint.output_dir={dying}",
                        *COMMON, "training.batch_size=6", *ck], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "QLORA_FAULT_PLAN": "kill_in_save_at_step=4,rank=1"})
    steps = sorted(d for d in os.listdir(os.path.join(dying, "checkpoints")) if not d.endswith(".tmp"))
    check(r.returncode != 0 and steps == ["step_00000002"],
          f"a rank killed during the step-4 save leaves step 2 the newest checkpoint ({steps})")
    r = run(a.qlora, dying, 2, "training.batch_size=6", *ck, "checkpoint.resume=true")
    if r.returncode == 0:
        l_ref, _ = trace(full2)
        l_res, _ = trace(dying)
        check("resumed from" in r.stdout and "step_00000002" in r.stdout and l_res == l_ref,
              "the run resumes from step 2 and finishes as the uninterrupted one")
    else:
        check(False, "resume after a death during save exits 0")

    # A rank dies mid-run: ranks started by hand (torchrun's variables, no launcher).
    port = free_port()
    out = os.path.join(a.workdir, "killed")
    procs = []
    t0 = time.time()
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "QLORA_FAULT_PLAN": "kill_after_step=2,rank=1"}
        cmd = [a.qlora_faults, "run", "lora_finetune", f"checkpoint.output_dir={out}", *COMMON, "training.batch_size=4",
               "training.max_steps_per_epoch=50"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=120) for p in procs]
    elapsed = time.time() - t0
    check(procs[1].returncode == -signal.SIGKILL, f"rank 1 was killed (rc {procs[1].returncode})")
    for rank in (0, 2):
        err = results[rank][1]
        check(procs[rank].returncode not in (0, None) and "rank 1" in err,
              f"rank {rank} exits non-zero naming rank 1 (rc {procs[rank].returncode}): {err.strip()[-300:]}")
    check(elapsed < 60, f"all ranks ended within 60 s ({elapsed:.1f} s)")

    # A rank that hangs alive (its heartbeat goes on, its loop stalls): the others fail after
    # dist.collective_timeout_s, naming it; the launcher then stops it.
    t0 = time.time()
    r = subprocess.run([a.qlora_faults, "run", "--nproc-per-node", "2", "lora_finetune", f"checkpoint.output_dir={out}3",
                        *COMMON, "training.batch_size=6", "training.max_steps_per_epoch=50",
                        "dist.collective_timeout_s=5"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "QLORA_FAULT_PLAN": "hang_at_step=3,rank=1"})
    elapsed = time.time() - t0
    check(r.returncode != 0 and "rank 1 is alive but hangs (in step 3" in r.stderr and elapsed < 60,
          f"a hung rank is named by the others after the collective timeout ({elapsed:.1f} s): {r.stderr.strip()[-300:]}")

    # Under the launcher: it names the dead rank and exits non-zero.
    r = subprocess.run([a.qlora_faults, "run", "--nproc-per-node", "2", "lora_finetune", f"checkpoint.output_dir={out}2",
                        *COMMON, "training.batch_size=6", "training.max_steps_per_epoch=50"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "QLORA_FAULT_PLAN": "kill_after_step=2,rank=1"})
    check(r.returncode != 0 and "[launcher] rank 1 was killed by signal 9" in r.stderr,
          f"the launcher names the killed rank and exits non-zero (rc {r.returncode})")

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
