"""Two launchers on one machine standing in for two nodes (`qlora run --nproc-per-node 1 --nnodes 2
--node-rank 0|1 --master-addr 127.0.0.1 --master-port P`):

1. the embedded default (no model.checkpoint_dir) in one fresh shared output dir: one writer of
   the tiny base (rank 0), so both nodes start, and the run's losses equal --nproc-per-node 2 on
   one node (the same job);
2. a node-local output dir on each node (two directories): both nodes refuse it before training,
   naming checkpoint.output_dir and what to do, instead of losing the run at its first export.
"""
import os
import socket
import subprocess

from recipe_common import RANKS_TOL, Checks, losses, max_diff, recipe_args, run_recipe

COMMON = ["training.epochs=1", "training.max_steps_per_epoch=4", "training.batch_size=8",
          "checkpoint.adapter_only=true", "logging.progress=plain"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(qlora, out0, out1, *overrides):
    """Both nodes' launchers at once; returns their CompletedProcess-like (rc, stdout, stderr)."""
    port = str(free_port())
    procs = [subprocess.Popen([qlora, "run", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(k),
                               "--master-addr", "127.0.0.1", "--master-port", port, "lora_finetune",
                               f"checkpoint.output_dir={out}", *COMMON, *overrides],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, out in enumerate((out0, out1))]
    res = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, res)]


def main():
    a = recipe_args()
    check = Checks()
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731

    r = run_recipe(a.qlora, w("one_node"), *COMMON, nproc=2)
    check(r.returncode == 0, "2 ranks on one node exit 0")
    res = two_nodes(a.qlora, w("shared"), w("shared"))
    check(all(rc == 0 for rc, _, _ in res), "2 nodes, one shared output dir, embedded default: both exit 0 "
          f"({[(rc, e[-300:]) for rc, _, e in res if rc]})")
    check(max_diff(losses(w("shared")), losses(w("one_node"))) <= RANKS_TOL,
          "2 nodes: losses equal 2 ranks on one node")

    res = two_nodes(a.qlora, w("local0"), w("local1"))
    check(all(rc != 0 and "checkpoint.output_dir" in e and "not one filesystem" in e for rc, _, e in res),
          "node-local output dirs: both nodes refuse before training, naming checkpoint.output_dir "
          f"({[e.strip().splitlines()[-1][:200] if e.strip() else '' for _, _, e in res]})")
    check(not os.path.exists(os.path.join(w("local0"), "epoch_0")) and not os.path.exists(os.path.join(w("local1"), "metrics.jsonl")),
          "node-local output dirs: nothing trained or exported")
    return check.summary()


if __name__ == "__main__":
    raise SystemExit(main())
