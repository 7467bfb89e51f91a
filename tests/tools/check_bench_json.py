"""Runs a benchmark and checks figures of the JSON it prints, so that a smoke test fails when a figure is
missing, not a number, or outside what the shape allows (not only when the program crashes):

    python tests/tools/check_bench_json.py 'speedup_2_ranks_vs_1>0' 'two_ranks.gathers_per_step>=1' -- \
        build/bench_dist --layers 2 ...

Each check is PATH OP VALUE: PATH a dotted path into the JSON object (list items by index), OP one of
== >= <= > <. Every figure must also be finite. Exit 1, naming each failed check, on any failure.
"""
import json
import math
import operator
import re
import subprocess
import sys

OPS = {"==": operator.eq, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
CHECK = re.compile(r"^([\w.\-]+)(==|>=|<=|>|<)(-?[\d.eE+\-]+)$")


def lookup(obj, path):
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def main():
    if "--" not in sys.argv:
        sys.exit("usage: check_bench_json.py CHECK... -- COMMAND ARGS...")
    split = sys.argv.index("--")
    checks, command = sys.argv[1:split], sys.argv[split + 1:]
    r = subprocess.run(command, capture_output=True, text=True)
    sys.stderr.write(r.stderr[-2000:])
    if r.returncode != 0:
        print(f"FAIL {command[0]} exited with {r.returncode}")
        return 1
    try:
        result = json.loads(r.stdout[r.stdout.index("{"):])
    except ValueError as e:
        print(f"FAIL {command[0]} printed no JSON object ({e}): {r.stdout[-500:]}")
        return 1
    failed = 0
    for c in checks:
        m = CHECK.match(c)
        if not m:
            sys.exit(f"check_bench_json.py: malformed check {c!r} (PATH OP VALUE)")
        path, op, want = m[1], m[2], float(m[3])
        try:
            got = lookup(result, path)
        except (KeyError, IndexError, TypeError, ValueError):
            got = None
        ok = isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got) and OPS[op](got, want)
        print(f"{'PASS' if ok else 'FAIL'} {path} = {got} ({op} {m[3]})")
        failed += not ok
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
