"""OpenMP's wait policy of qlora's processes (engine/omp_wait_policy.h), as libgomp itself reports it
(OMP_DISPLAY_ENV=verbose prints its settings to stderr when it starts):
  - neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT set: `qlora ls` and both ranks that
    `qlora run --nproc-per-node 2` starts spin 3000 times before sleeping (GOMP_SPINCOUNT '3000';
    libgomp's own default spins 300000 times);
  - the user's OMP_WAIT_POLICY=ACTIVE or GOMP_SPINCOUNT wins, in the process and in its ranks.
No timing. Prints "N passed, M failed".

    python tests/recipes/test_omp_wait_policy.py --qlora build/qlora
"""
import argparse
import os
import re
import subprocess
import sys

SETTING = re.compile(r"^(\[rank \d+\] )?  (OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '([^']*)'$", re.M)


def settings(cmd, **env_vars):
    """{prefix: {name: value}} of libgomp's wait settings per process ("" for the launcher)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_DISPLAY_ENV="verbose", **env_vars)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    found = {}
    for m in SETTING.finditer(out.stderr):
        found.setdefault((m.group(1) or "").strip(), {})[m.group(2)] = m.group(3)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    a = ap.parse_args()
    ls = [a.qlora, "ls"]
    # Two ranks that start (libgomp reports before main) and then refuse the unknown key.
    ranks = [a.qlora, "run", "--nproc-per-node", "2", "lora_finetune", "no_such.key=1"]
    short_spin = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}
    cases = [
        ("unset: qlora spins briefly", settings(ls), {"": short_spin}),
        ("unset: the launcher and both ranks spin briefly", settings(ranks),
         {"": short_spin, "[rank 0]": short_spin, "[rank 1]": short_spin}),
        ("OMP_WAIT_POLICY=ACTIVE is kept", settings(ls, OMP_WAIT_POLICY="ACTIVE"),
         {"": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000000000"}}),
        ("GOMP_SPINCOUNT=1234 is kept, in the ranks too", settings(ranks, GOMP_SPINCOUNT="1234"),
         {p: {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1234"} for p in ("", "[rank 0]", "[rank 1]")}),
    ]
    failed = 0
    for name, got, want in cases:
        ok = got == want
        failed += not ok
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": libgomp reported {got}, want {want}"))
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
