"""The lora_finetune recipe end to end through the real `qlora` binary, on the embedded default
(tiny Llama, NF4 base, LoRA on every projection, bundled tokenizer and data):

1. it learns visibly and writes metrics.jsonl and an inference export per epoch;
2. a run killed by SIGKILL mid-epoch and resumed with checkpoint.resume=true gives the same
   per-step losses and a byte-identical final adapter as the uninterrupted run (CPU, fp32);
3. resuming with a changed lr is refused by name; a changed logging key is allowed; resuming on an
   edited data file is refused naming the file, on the same data moved elsewhere allowed;
4. `qlora generate` runs on the export.
QLORA_TEST_DEVICE=cuda runs every recipe run here with model.device=cuda (the GPU machine's check
of bit-identical resume on CUDA); default: the recipe's own device (cpu).
Prints "N passed, M failed"; exit code 1 on any failure.
"""
import json
import os
import shutil
import subprocess
import sys

from recipe_common import Checks, recipe_args, run_recipe, step_rows

check = Checks()
FAULTS = None  # --qlora-faults
DEVICE = os.environ.get("QLORA_TEST_DEVICE", "")


def run(qlora, out, *overrides, fault=None, expect_rc=0):
    """fault: a QLORA_FAULT_PLAN for the qlora_faults test binary (the same command line)."""
    return run_recipe(FAULTS if fault else qlora, out, "logging.progress=plain", "training.epochs=2",
                      "training.max_steps_per_epoch=10", "checkpoint.save_every_steps=4",
                      *([f"model.device={DEVICE}"] if DEVICE else []), *overrides,
                      fault=fault, expect_rc=expect_rc)


def losses(out):
    rows = step_rows(out)
    return [(r["step"], r["loss"]) for r in rows], rows


def main():
    a = recipe_args()
    global FAULTS
    FAULTS = a.qlora_faults
    full, killed = os.path.join(a.workdir, "full"), os.path.join(a.workdir, "killed")

    # 1. uninterrupted run
    r = run(a.qlora, full)
    check(r.returncode == 0, "default run exits 0")
    ref, rows = losses(full)
    check([s for s, _ in ref] == list(range(1, 21)), "metrics.jsonl has steps 1..20")
    check(all(k in rows[0] for k in ("step", "epoch", "loss", "lr", "tokens_per_second", "peak_memory_bytes")),
          "metrics rows carry step, epoch, loss, lr, tokens_per_second, peak_memory_bytes")
    first, last = sum(l for _, l in ref[:3]) / 3, sum(l for _, l in ref[-3:]) / 3
    check(last < first - 0.3, f"loss falls: first steps {first:.3f}, last steps {last:.3f}")
    for e in (0, 1):
        d = os.path.join(full, f"epoch_{e}")
        check(all(os.path.exists(os.path.join(d, f)) for f in
                  ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "config.json",
                   "tokenizer.model")) and any(f.endswith(".safetensors") for f in os.listdir(d)),
              f"epoch_{e}: PEFT adapter, merged model, config and tokenizer")

    # 2. SIGKILL at several steps, then resume: before the first checkpoint (3: resume finds none
    #    and starts fresh), on an epoch's last step before its checkpoint and export (10), and
    #    mid-epoch two steps after a checkpoint (14; the last one is at step 12).
    full_adapters = [open(os.path.join(full, f"epoch_{e}", "adapter", "adapter_model.safetensors"), "rb").read()
                     for e in (0, 1)]
    for kill in (3, 10, 14):
        out = f"{killed}_{kill}"
        r = run(a.qlora, out, fault=f"kill_after_step={kill}", expect_rc=-9)
        check(r.returncode == -9, f"the run dies by SIGKILL at step {kill}")
        r = run(a.qlora, out, "checkpoint.resume=true")
        check(r.returncode == 0, f"resume after a kill at step {kill} exits 0")
        got, _ = losses(out)
        check(got == ref, f"kill at {kill}: per-step losses equal the uninterrupted run's exactly")
        same = all(open(os.path.join(out, f"epoch_{e}", "adapter", "adapter_model.safetensors"), "rb").read() ==
                   full_adapters[e] for e in (0, 1))
        check(same, f"kill at {kill}: the adapters of both epochs are byte-identical")
    killed = f"{killed}_14"

    # 3. changed config on resume
    r = run(a.qlora, killed, "checkpoint.resume=true", "optim.lr=5e-4", expect_rc=1)
    check(r.returncode == 1 and "optim.lr" in r.stderr, "resume with a changed optim.lr is refused, naming the key")
    r = run(a.qlora, killed, "checkpoint.resume=true", "logging.log_every_steps=5")
    check(r.returncode == 0, "resume with a changed logging key is allowed")

    # 3b. the data is matched by content (data.path may move): two steps on a copy of the bundled
    #     data, then resume on an edited copy (refused) and on the original moved (allowed)
    inputs = os.path.join(a.workdir, "inputs")
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tiny_tasks.jsonl")
    data_a, data_b = os.path.join(a.workdir, "data_a.jsonl"), os.path.join(a.workdir, "data_b.jsonl")
    shutil.copy(bundled, data_a)
    short = ("training.epochs=1", "training.max_steps_per_epoch=2")
    r = run(a.qlora, inputs, f"data.path={data_a}", *short)
    check(r.returncode == 0, "two steps on a copy of the bundled data")
    with open(data_a) as f:
        records = f.readlines()
    edited = json.loads(records[0])
    edited["output"] += "x"
    with open(data_a, "w") as f:
        f.writelines([json.dumps(edited) + "\n"] + records[1:])
    r = run(a.qlora, inputs, "checkpoint.resume=true", f"data.path={data_a}", *short, expect_rc=1)
    check(r.returncode == 1 and "data file changed" in r.stderr and data_a in r.stderr and
          "new output_dir" in r.stderr, "resume on an edited data file is refused, naming the file")
    os.remove(data_a)
    with open(data_b, "w") as f:
        f.writelines(records)
    r = run(a.qlora, inputs, "checkpoint.resume=true", f"data.path={data_b}", *short)
    check(r.returncode == 0 and "resumed from" in r.stdout, "resume on the same data at another path is allowed")

    # 4. packed rows train too (block-causal attention, positions restarting per sample)
    packed = os.path.join(a.workdir, "packed")
    r = run(a.qlora, packed, "data.packing=true", "training.batch_size=1")
    pl, _ = losses(packed) if r.returncode == 0 else ([], None)
    check(r.returncode == 0 and len(pl) == 20 and pl[-1][1] < pl[0][1], "a packed run trains (loss falls)")

    # 5. a fresh run in a used output_dir sets the old checkpoints aside instead of mixing them in
    r = run(a.qlora, full, "training.epochs=1", "training.max_steps_per_epoch=2")
    aside = [d for d in os.listdir(full) if d.startswith("checkpoints.prev-")]
    steps = sorted(os.listdir(os.path.join(full, "checkpoints")))
    check(r.returncode == 0 and len(aside) == 1 and steps == ["step_00000002"],
          f"fresh run in a used output_dir: old checkpoints set aside ({aside}), new ones alone ({steps})")

    # 6. generation from the export
    g = subprocess.run([a.qlora, "generate", "--checkpoint", os.path.join(full, "epoch_1"), "--prompt",
                        "Add the numbers.", "--max-new-tokens", "8"], capture_output=True, text=True)
    check(g.returncode == 0, "qlora generate runs on the epoch export")

    # 7. an HF Llama-3 layout keeps tokenizer.model under original/; a tokenizer bigger than the
    #    model's vocab (another model's) is refused by name
    l3 = os.path.join(a.workdir, "llama3_layout")
    shutil.copytree(os.path.join(full, "tiny_base"), l3)
    os.makedirs(os.path.join(l3, "original"))
    os.rename(os.path.join(l3, "tokenizer.model"), os.path.join(l3, "original", "tokenizer.model"))
    l3out = os.path.join(a.workdir, "llama3_out")
    r = run(a.qlora, l3out, f"model.checkpoint_dir={l3}", "training.epochs=1", "training.max_steps_per_epoch=2")
    check(r.returncode == 0 and os.path.isfile(os.path.join(l3out, "epoch_0", "tokenizer.model")),
          "original/tokenizer.model is found and exported beside the model")
    tik = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tokenizer_tiktoken", "tokenizer.model")
    r = run(a.qlora, l3out, f"model.tokenizer={tik}", "training.epochs=1", "training.max_steps_per_epoch=2",
            expect_rc=1)
    check(r.returncode == 1 and "vocab_size" in r.stderr and "tokenizer_tiktoken" in r.stderr,
          "a tokenizer larger than the model's vocab is refused, naming both")

    # 8. a checkpoint in the single-process format of earlier releases (tests/data/legacy_resume,
    #    written by the recipe before the engine was one for 1..N ranks) still resumes, converted on
    #    load, and continues with the losses that recipe computed (fp32 on the CPU; 1e-5 leaves room
    #    for another CPU's kernels, a wrong conversion moves them by ~1e-2)
    #    It resumes on what that recipe's default had: its random base with the 512-piece BPE
    #    tokenizer (written again by tiny_base_tool where the default keeps its base), its data
    #    (make_fixtures.legacy_tiny_tasks), its batch size and lr.
    legacy = os.path.join(a.workdir, "legacy")
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
    fixture = os.path.join(data_dir, "legacy_resume")
    shutil.copytree(os.path.join(fixture, "step_00000002"), os.path.join(legacy, "checkpoints", "step_00000002"))
    tool = os.path.join(os.path.dirname(a.qlora), "tiny_base_tool")  # built beside qlora (CMakeLists.txt)
    subprocess.run([tool, os.path.join(legacy, "tiny_base"),
                    os.path.join(data_dir, "tokenizer", "tokenizer.model"), "512"], check=True)
    sys.path.insert(0, data_dir)
    from make_fixtures import legacy_tiny_tasks
    legacy_data = os.path.join(a.workdir, "legacy_tiny_tasks.jsonl")
    legacy_tiny_tasks(legacy_data)
    with open(os.path.join(fixture, "expected.json")) as f:
        expected = json.load(f)["losses"]
    r = run(a.qlora, legacy, "training.epochs=1", "training.max_steps_per_epoch=4", "checkpoint.save_every_steps=2",
            "checkpoint.resume=true", f"data.path={legacy_data}", "training.batch_size=8", "optim.lr=3e-3")
    got, _ = losses(legacy) if r.returncode == 0 else ([], None)
    check(r.returncode == 0 and "single-process format" in r.stdout and [s for s, _ in got] == [3, 4] and
          all(abs(l - expected[str(s)]) < 1e-5 for s, l in got),
          f"a legacy single-process checkpoint resumes and continues as that recipe did ({got} vs {expected})")

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
