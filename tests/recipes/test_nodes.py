"""Two launchers on one machine standing in for two nodes (`qlora run --nproc-per-node 1 --nnodes 2
--node-rank 0|1 --master-addr 127.0.0.1 --master-port P`):

1. the embedded default (no model.checkpoint_dir) in one fresh shared output dir: one writer of
   the tiny base (rank 0), so both nodes start, and the run's losses equal --nproc-per-node 2 on
   one node (the same job);
2. a node-local output dir on each node (two directories): the losses and the exports (written
   into node 0's directory only) equal one node's bit for bit; each directory keeps its own rank's
   resume files, and a run whose either node is killed resumes and ends as the uninterrupted one;
3. a save interrupted between the two nodes' commits (the newest step in node 0's directory only)
   resumes from the step before it, setting node 0's lone copy aside; a node-local checkpoint
   resumed on another layout (one node of 2 ranks) is refused by name; a shared directory's
   checkpoint copied into each node's resumes there;
4. lora_dpo with a precomputed reference on node-local dirs: the table kept in each, and read on
   both nodes by a resume after node 1 is killed.
"""
import filecmp
import json
import os
import shutil
import socket
import subprocess

from recipe_common import RANKS_TOL, Checks, losses, max_diff, recipe_args, run_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["training.epochs=2", "training.max_steps_per_epoch=4", "training.batch_size=8",
          "checkpoint.save_every_steps=2", "checkpoint.adapter_only=false", "logging.progress=plain"]
EXPORTED = [os.path.join(f"epoch_{e}", f) for e in (0, 1)
            for f in ("model.safetensors", "config.json", os.path.join("adapter", "adapter_model.safetensors"))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(qlora, out0, out1, *overrides, fault=None, recipe="lora_finetune", common=COMMON):
    """Both nodes' launchers at once; returns [(rc, stdout, stderr)] per node. `fault`: a
    QLORA_FAULT_PLAN for the qlora_faults binary (pass it as `qlora`)."""
    port = str(free_port())
    procs = [subprocess.Popen([qlora, "run", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(k),
                               "--master-addr", "127.0.0.1", "--master-port", port, recipe,
                               f"checkpoint.output_dir={out}", *common, *overrides],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "QLORA_FAULT_PLAN": fault or ""})
             for k, out in enumerate((out0, out1))]
    res = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, res)]


def ok(res):
    return all(rc == 0 for rc, _, _ in res)


def tails(res):
    return [e.strip().splitlines()[-1][:300] if e.strip() else "" for _, _, e in res]


def same_exports(a, b):
    return all(os.path.exists(os.path.join(a, f)) and filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)
               for f in EXPORTED)


def rank_files(out):
    """{step dir: sorted rank files} of OUT/checkpoints."""
    root = os.path.join(out, "checkpoints")
    return {d: sorted(f for f in os.listdir(os.path.join(root, d)) if f.startswith("rank_"))
            for d in sorted(os.listdir(root)) if d.startswith("step_") and "." not in d}


def main():
    a = recipe_args()
    check = Checks()
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731

    r = run_recipe(a.qlora, w("one_node"), *COMMON, nproc=2)
    check(r.returncode == 0, "2 ranks on one node exit 0")
    ref = losses(w("one_node"))
    res = two_nodes(a.qlora, w("shared"), w("shared"))
    check(ok(res), f"2 nodes, one shared output dir, embedded default: both exit 0 ({tails(res)})")
    check(max_diff(losses(w("shared")), ref) <= RANKS_TOL, "2 nodes: losses equal 2 ranks on one node")

    # Node-local output dirs: one directory per node.
    local = (w("local0"), w("local1"))
    res = two_nodes(a.qlora, *local)
    check(ok(res) and "not one filesystem for every rank" in res[0][1],
          f"node-local output dirs: both nodes exit 0, rank 0 saying what it does ({tails(res)})")
    check(losses(local[0]) == ref, "node-local output dirs: losses equal one node's bit for bit")
    check(same_exports(local[0], w("one_node")), "node-local output dirs: both epochs' merged model and adapter, "
          "written into node 0's directory, are byte-identical to one node's")
    check(not any(os.path.exists(os.path.join(local[1], f)) for f in ("epoch_0", "epoch_1", "metrics.jsonl")),
          "node-local output dirs: node 1's directory has no export and no metrics")
    files = [rank_files(d) for d in local]
    manifest = json.load(open(os.path.join(local[1], "checkpoints", "step_00000008", "manifest.json")))
    check(files[0] and all(v == ["rank_00000.safetensors"] for v in files[0].values()) and
          files[1].keys() == files[0].keys() and all(v == ["rank_00001.safetensors"] for v in files[1].values()) and
          manifest.get("ranks_here") == [1] and manifest.get("world_size") == 2,
          f"node-local output dirs: each directory keeps its own rank's resume files ({files}, ranks_here "
          f"{manifest.get('ranks_here')})")

    # Either node killed (SIGKILL, mid-run), then both relaunched with checkpoint.resume=true.
    for node, step, resumed in ((1, 7, "step_00000006"), (0, 3, "step_00000002")):
        dirs = (w(f"kill{node}_0"), w(f"kill{node}_1"))
        res = two_nodes(a.qlora_faults, *dirs, fault=f"kill_after_step={step},rank={node}")
        check(not ok(res), f"node {node} killed after step {step}: the job stops ({[rc for rc, _, _ in res]})")
        res = two_nodes(a.qlora, *dirs, "checkpoint.resume=true")
        check(ok(res) and f"resumed from {dirs[0]}/checkpoints/{resumed}" in res[0][1],
              f"node {node} killed: both resume from {resumed} and exit 0 ({tails(res)})")
        check(losses(dirs[0]) == ref and same_exports(dirs[0], w("one_node")),
              f"node {node} killed: losses and exports equal the uninterrupted run's")

    # A save interrupted between the nodes' commits: step 8 committed on node 0 only.
    torn = (w("torn0"), w("torn1"))
    for src, dst in zip(local, torn):
        shutil.copytree(src, dst)
    shutil.rmtree(os.path.join(torn[1], "checkpoints", "step_00000008"))
    res = two_nodes(a.qlora, *torn, "checkpoint.resume=true")
    check(ok(res) and "resumed from" in res[0][1] and "step_00000006" in res[0][1] and
          os.path.isdir(os.path.join(torn[0], "checkpoints", "step_00000008.superseded")),
          f"step 8 in node 0's directory only: both resume from step 6, node 0's lone copy set aside ({tails(res)})")
    check(losses(torn[0]) == ref and same_exports(torn[0], w("one_node")) and
          "step_00000008" in rank_files(torn[1]),
          "after it: losses and exports equal the uninterrupted run's, and node 1 has step 8 again")

    # A checkpoint from one shared directory (every rank's file) copied into each node's resumes there.
    copied = (w("copied0"), w("copied1"))
    for dst in copied:
        shutil.copytree(w("one_node"), dst)
        shutil.rmtree(os.path.join(dst, "checkpoints", "step_00000008"))
    res = two_nodes(a.qlora, *copied, "checkpoint.resume=true")
    check(ok(res) and losses(copied[0]) == ref and same_exports(copied[0], w("one_node")),
          f"a shared-directory checkpoint copied into each node's directory resumes on two nodes ({tails(res)})")

    # lora_dpo with dpo.precompute_reference: the table is kept in each node's directory, and a resume
    # after node 1 is killed reads it on both.
    dpo = ["--config", os.path.join(ROOT, "configs", "tiny_qlora_dpo.toml"),
           f"data.path={ROOT}/tests/data/tiny_preferences.jsonl",
           f"data.val_path={ROOT}/tests/data/tiny_preferences_heldout.jsonl", "training.epochs=1", "training.batch_size=8",
           "training.max_steps_per_epoch=8", "checkpoint.save_every_steps=4", "dpo.precompute_reference=true",
           "logging.progress=plain"]
    r = run_recipe(a.qlora, w("dpo_one_node"), *dpo, nproc=2, recipe="lora_dpo")
    dirs = (w("dpo0"), w("dpo1"))
    two_nodes(a.qlora_faults, *dirs, fault="kill_after_step=6,rank=1", recipe="lora_dpo", common=dpo)
    tables = all(os.path.isfile(os.path.join(d, "dpo_reference.safetensors")) for d in dirs)
    res = two_nodes(a.qlora, *dirs, "checkpoint.resume=true", recipe="lora_dpo", common=dpo)
    check(r.returncode == 0 and tables and ok(res) and "reference log-probabilities read from" in res[0][1] and
          losses(dirs[0]) == losses(w("dpo_one_node")),
          "lora_dpo, node-local dirs: each keeps the reference table; node 1 killed, both resume reading it, and "
          f"the losses equal one node's ({tails(res)})")

    # Checkpoints in node 0's directory only (a shared run's, not copied to node 1): refused by name.
    lonely = (w("lonely0"), w("lonely1"))
    shutil.copytree(w("one_node"), lonely[0])
    res = two_nodes(a.qlora, *lonely, "checkpoint.resume=true")
    check(all(rc != 0 and "no step's resume checkpoint is in every rank's checkpoint.output_dir" in e for rc, _, e in res),
          f"checkpoints in node 0's directory only: both nodes refuse by name ({tails(res)})")

    # Node 0 holding a shared directory's checkpoint, node 1 its node-local one, at the same step: refused.
    mixed = (w("mixed0"), w("mixed1"))
    shutil.copytree(w("one_node"), mixed[0])
    shutil.copytree(local[1], mixed[1])
    res = two_nodes(a.qlora, *mixed, "checkpoint.resume=true")
    check(all(rc != 0 for rc, _, _ in res) and "written with one shared directory and others" in res[0][2],
          f"a shared-directory checkpoint on one node and a node-local one on the other: refused by name ({tails(res)})")

    # Another layout: node 0's directory resumed by one node of 2 ranks.
    other = w("other_layout")
    shutil.copytree(local[0], other)
    r = run_recipe(a.qlora, other, *COMMON, "checkpoint.resume=true", nproc=2, expect_rc=1)
    check(r.returncode == 1 and "kept one output_dir per node" in r.stderr and "--nproc-per-node" in r.stderr,
          f"a node-local checkpoint on another layout is refused by name ({r.stderr.strip()[-300:]})")
    return check.summary()


if __name__ == "__main__":
    raise SystemExit(main())
