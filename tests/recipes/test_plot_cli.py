"""`qlora plot` on real runs: two short trainings of the embedded default (one with validation rows),
plotted alone and side by side, a lora_dpo run (its reward margin and accuracy panels), and a metrics.jsonl with the rows a run can also write (validation rows, skipped non-finite
steps, null losses, losses spanning decades). The SVG is parsed with xml.etree; for every series
(<polyline data-run data-series>) its points are mapped back to (step, value) through the panel's
axes, whose transform is recovered from the tick labels and tick positions, and must equal the
metrics.jsonl values exactly as many as there are; every panel's ticks must cover its data; each
run must be in the legend with its own colour. Errors: a directory without metrics.jsonl, a
malformed line (file and line named), no arguments.

The README's picture is docs/plot.svg, the plot of the default run (`qlora run lora_finetune`, no
overrides); QLORA_UPDATE_DOCS=1 regenerates it. It is checked like the others either way.

    python tests/recipes/test_plot_cli.py --qlora build/qlora --qlora-faults build/qlora_faults --workdir build/cli_plot
"""
import json
import math
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recipe_common import Checks, recipe_args, metrics_rows, run_recipe  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOCS_PLOT = os.path.join(ROOT, "docs", "plot.svg")
SVG = "{http://www.w3.org/2000/svg}"
PANELS = {"loss": ["loss", "val_loss"], "lr": ["lr"], "tokens_per_second": ["tokens_per_second"]}
# A lora_dpo run's plot adds its reward metrics (training and validation).
PANELS_DPO = {**PANELS, "reward_margins": ["rewards/margins", "val_rewards/margins"],
              "reward_accuracies": ["rewards/accuracies", "val_rewards/accuracies"]}


def expected_series(rows, series):
    """(step, value) of every row with a finite number under `series`; skipped rows have no loss."""
    out = []
    for r in rows:
        v = r.get(series)
        if series == "loss" and r.get("skipped") is True:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((r["step"], float(v)))
    return sorted(out, key=lambda p: p[0])


def axis_map(ticks, log):
    """value -> pixel and pixel -> value from [(label value, pixel)]; checks the ticks lie on one line."""
    t = (lambda v: math.log10(v)) if log else (lambda v: v)
    (v0, p0), (v1, p1) = ticks[0], ticks[-1]
    scale = (p1 - p0) / (t(v1) - t(v0))
    for v, p in ticks:
        assert abs(p0 + (t(v) - t(v0)) * scale - p) < 0.02, f"tick {v} at {p} is off the axis line"
    inv = (lambda u: 10 ** u) if log else (lambda u: u)
    return lambda px: inv(t(v0) + (px - p0) / scale)


def panel_axes(g):
    """The panel's ticks (value, pixel) on x and y, parsed from the labels and the tick lines."""
    def ticks(cls, coord):
        out = []
        for tick in g.iter(SVG + "g"):
            if tick.get("class") == cls:
                out.append((float(tick.find(SVG + "text").text), float(tick.find(SVG + "line").get(coord))))
        return out
    return ticks("xtick", "x1"), ticks("ytick", "y1")


def check_svg(check, path, runs, label, panels_want=PANELS):
    """runs: {legend name: metrics rows}. Checks series, axes and legend of the SVG at path."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        check(False, f"{label}: {path} parses as XML ({e})")
        return
    panels = {g.get("data-panel"): g for g in root.iter(SVG + "g") if g.get("class") == "panel"}
    check(set(panels) == set(panels_want), f"{label}: panels {sorted(panels)}")
    colours = {}
    for key, series_names in panels_want.items():
        g = panels.get(key)
        if g is None:
            continue
        xt, yt = panel_axes(g)
        log = g.get("data-scale") == "log"
        x_of, y_of = axis_map(xt, False), axis_map(yt, log)
        lines = {(p.get("data-run"), p.get("data-series")): p for p in g.iter(SVG + "polyline")}
        for name, rows in runs.items():
            for s in series_names:
                want = expected_series(rows, s)
                line = lines.get((name, s))
                if not want:
                    check(line is None, f"{label}: {name} has no {s} and none is drawn")
                    continue
                if not check(line is not None, f"{label}: {name} {s} is drawn"):
                    continue
                colours.setdefault(name, set()).add(line.get("stroke"))
                pts = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
                got = [(x_of(x), y_of(y)) for x, y in pts]
                ys = [v for _, v in want]
                lo, hi = min(yt)[0], max(yt)[0]
                tol = 1e-4 * ((math.log10(hi) - math.log10(lo)) if log else (hi - lo))
                err = max(abs((math.log10(g_) - math.log10(w)) if log else (g_ - w)) for (_, g_), (_, w) in zip(got, want))
                check(len(got) == len(want) == int(line.get("data-count")) and
                      all(round(gx) == w for (gx, _), (w, _) in zip(got, want)) and err <= tol,
                      f"{label}: {name} {s}: {len(got)} points map back to the metrics (max error {err:.2e}, tol {tol:.1e})")
                check(lo <= min(ys) and hi >= max(ys) and min(xt)[0] <= want[0][0] and max(xt)[0] >= want[-1][0],
                      f"{label}: {key} axes [{lo:g}, {hi:g}] x [{min(xt)[0]:g}, {max(xt)[0]:g}] cover {name}'s {s}")
    legend = [g for g in root.iter(SVG + "g") if g.get("class") == "legend"]
    named = {g.get("data-run") for g in legend[0].iter(SVG + "g")} if legend else set()
    check(set(runs) <= named, f"{label}: legend names {sorted(runs)}")
    check(all(len(c) == 1 for c in colours.values()) and len({min(c) for c in colours.values()}) == len(colours),
          f"{label}: one colour per run, distinct ({colours})")
    return root


def plot(qlora, *args, cwd=None):
    return subprocess.run([qlora, "plot", *args], capture_output=True, text=True, cwd=cwd)


def synthetic_run(workdir):
    """Rows the lead's validation and non-finite handling add, and losses over three decades."""
    d = os.path.join(workdir, "synthetic")
    os.makedirs(d, exist_ok=True)
    rows = []
    for step in range(1, 41):
        rows.append({"step": step, "epoch": 0, "loss": 8.0 * 0.85 ** step, "lr": 1e-4 * min(1, step / 10),
                     "tokens_per_second": 1000 + 10 * step, "tokens": 100})
        if step % 10 == 0:
            rows.append({"step": step, "epoch": 0, "val_loss": 9.0 * 0.86 ** step, "val_perplexity": 1.0})
    rows[5] = {"step": 6, "epoch": 0, "loss": None, "lr": 6e-5, "skipped": True}
    rows[12]["loss"] = None
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return d


def check_errors(check, qlora, workdir):
    empty = os.path.join(workdir, "no_metrics")
    os.makedirs(empty, exist_ok=True)
    r = plot(qlora, empty)
    check(r.returncode == 1 and empty in r.stderr and "no metrics.jsonl" in r.stderr, f"dir without metrics: {r.stderr.strip()}")
    bad = os.path.join(workdir, "bad")
    os.makedirs(bad, exist_ok=True)
    with open(os.path.join(bad, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "loss": \n{"step": 4, "loss": 1.7}\n')
    r = plot(qlora, bad)
    check(r.returncode == 1 and os.path.join(bad, "metrics.jsonl") in r.stderr and "line 3" in r.stderr,
          f"malformed line named: {r.stderr.strip()}")
    r = plot(qlora)
    check(r.returncode == 1 and "usage: qlora plot" in r.stderr, "no arguments: usage")


def main():
    args = recipe_args()
    wd = os.path.abspath(args.workdir)
    check = Checks()

    run_a, run_b = os.path.join(wd, "lr3e-3"), os.path.join(wd, "lr1e-3")
    short = ["training.epochs=1", "logging.progress=plain"]
    check(run_recipe(args.qlora, run_a, *short, "training.max_steps_per_epoch=20", "data.val_fraction=0.2",
                     "training.eval_every_steps=5").returncode == 0, "run A trains (validation every 5 steps)")
    check(run_recipe(args.qlora, run_b, *short, "training.max_steps_per_epoch=12", "optim.lr=1e-3").returncode == 0,
          "run B trains")
    rows_a, rows_b = metrics_rows(run_a), metrics_rows(run_b)
    check(len(expected_series(rows_a, "val_loss")) == 4, "run A logged 4 validation losses")

    r = plot(args.qlora, run_a)
    out_a = os.path.join(run_a, "plot.svg")
    check(r.returncode == 0 and out_a in r.stdout and os.path.isfile(out_a), f"one run -> {out_a}: {r.stdout}{r.stderr}")
    check_svg(check, out_a, {"lr3e-3": rows_a}, "one run")

    both = os.path.join(wd, "both.svg")
    r = plot(args.qlora, run_a, run_b + "/", "-o", both)
    check(r.returncode == 0 and both in r.stdout, f"two runs -> {both}: {r.stdout}{r.stderr}")
    check_svg(check, both, {"lr3e-3": rows_a, "lr1e-3": rows_b}, "two runs")

    syn = synthetic_run(wd)
    r = plot(args.qlora, syn)
    check(r.returncode == 0, f"validation/skipped rows plot: {r.stderr}")
    root = check_svg(check, os.path.join(syn, "plot.svg"), {"synthetic": metrics_rows(syn)}, "val+skipped rows")
    if root is not None:
        loss = [g for g in root.iter(SVG + "g") if g.get("data-panel") == "loss"][0]
        check(loss.get("data-scale") == "log", "losses over three decades: log scale")
        marks = [p for p in loss.iter(SVG + "path") if p.get("data-series") == "skipped"]
        check(len(marks) == 1 and marks[0].get("data-count") == "1", "the skipped step is marked")

    dpo = os.path.join(wd, "dpo")
    check(run_recipe(args.qlora, dpo, "--config", os.path.join(ROOT, "configs", "tiny_qlora_dpo.toml"),
                     f"data.path={ROOT}/tests/data/tiny_preferences.jsonl",
                     f"data.val_path={ROOT}/tests/data/tiny_preferences_heldout.jsonl", *short,
                     "training.max_steps_per_epoch=8", "training.eval_every_steps=4", recipe="lora_dpo").returncode == 0,
          "a lora_dpo run trains (validation every 4 steps)")
    r = plot(args.qlora, dpo)
    check(r.returncode == 0, f"lora_dpo run plots: {r.stderr}")
    check_svg(check, os.path.join(dpo, "plot.svg"), {"dpo": metrics_rows(dpo)}, "lora_dpo rewards", PANELS_DPO)

    check_errors(check, args.qlora, wd)

    if os.environ.get("QLORA_UPDATE_DOCS") == "1":
        default = os.path.join(wd, "docs", "tiny")  # the legend says "tiny", as out/tiny would
        check(run_recipe(args.qlora, default, "logging.progress=plain").returncode == 0, "default run trains")
        os.makedirs(os.path.dirname(DOCS_PLOT), exist_ok=True)
        r = plot(args.qlora, default, "-o", DOCS_PLOT)
        check(r.returncode == 0, f"docs picture regenerated: {r.stdout}{r.stderr}")
        shutil.copy(os.path.join(default, "metrics.jsonl"), os.path.join(ROOT, "docs", "plot_metrics.jsonl"))
    docs_metrics = os.path.join(ROOT, "docs", "plot_metrics.jsonl")
    if check(os.path.isfile(DOCS_PLOT) and os.path.isfile(docs_metrics), "docs/plot.svg and its metrics are committed"):
        with open(docs_metrics) as f:
            check_svg(check, DOCS_PLOT, {"tiny": [json.loads(x) for x in f]}, "docs/plot.svg")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
