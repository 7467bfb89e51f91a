"""Parquet and Arrow IPC data files, read by qlora as `datasets` reads them:

1. records: files written by `datasets` (Dataset.to_parquet; instruct rows with nulls, unicode, ints,
   floats, bools, lists; chat rows whose messages are a list of structs; preference pairs; a float32
   column), by pyarrow (large_string, large_list, nested nulls, two row groups; and dictionary
   strings, fixed_size_list, binary, which datasets does not load, against pyarrow's rows), a sharded data
   set directory (data/train-0000N-of-00002.parquet: its train split, its directory, a glob), an Arrow
   IPC file (pyarrow.feather) and an Arrow IPC stream (Dataset.save_to_disk's file): the records
   qlora reads (hub_tool's read_json_records) equal datasets.load_dataset(...)'s rows, row for row;
2. a damaged Parquet file (truncated), and a JSON file named .parquet: a clear error naming the file,
   from hub_tool and from `qlora run` (exit code 1, not a crash); files with 16 bytes overwritten at
   ~24 places inside (footer intact): the records or an error naming the file, never a crash;
3. training: `qlora run lora_finetune` (the embedded default, 2 steps) on the bundled tiny_tasks as
   Parquet shards (data.path = their directory) logs the same losses as on the JSONL file itself.
Prints "N passed, M failed".

    python tests/conformance/test_parquet.py --tool build/hub_tool --qlora build/qlora --workdir build/pq
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes"))
from recipe_common import Checks, losses, run_recipe  # noqa: E402

check = Checks()
TOOL = None
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")


def tool(*requests):
    """hub_tool's answers to its requests (lists of args): one process."""
    lines = "".join(json.dumps({"args": list(a)}) + "\n" for a in requests)
    r = subprocess.run([TOOL], input=lines, capture_output=True, text=True, timeout=60)
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    return answers if len(answers) == len(requests) else [{"error": f"rc {r.returncode}: {r.stderr[-300:]}"}] * len(requests)


def reference_rows(builder, files):
    import datasets
    return [dict(row) for row in datasets.load_dataset(builder, data_files=files, split="train")]


def first_difference(ours, ref):
    if len(ours) != len(ref):
        return f"{len(ours)} records, datasets {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return f"row {i}: qlora {a!r} != datasets {b!r}"
    return None


def check_same_rows(label, path, builder, files):
    """qlora's records of `path` against datasets' rows of `files`."""
    (answer,) = tool(["records", path])
    ref = reference_rows(builder, files)
    ours = answer.get("records")
    diff = answer.get("error") if ours is None else first_difference(ours, ref)
    check(diff is None, f"{label}: {len(ref)} rows equal datasets.load_dataset({builder!r})'s" + (f" ({diff})" if diff else ""))
    return answer


def instruct_rows():
    return [
        {"instruction": "Add the numbers ✓", "input": "41 + 19", "output": "60", "id": 1, "score": 0.5, "ok": True,
         "tags": ["math", "easy"]},
        {"instruction": "Übersetze: 猫", "input": None, "output": "Katze 🐈", "id": -7, "score": None, "ok": False,
         "tags": []},
        {"instruction": "Say \"hi\"\n\ttabbed", "input": "", "output": "hi", "id": 2**40, "score": -1e-300, "ok": None,
         "tags": None},
    ]


def chat_rows():
    return [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? ½"},
                      {"role": "assistant", "content": "4"}], "source": {"name": "x", "turns": 3}},
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "…"}],
         "source": {"name": None, "turns": 2}},
        {"messages": [], "source": None},
    ]


def preference_rows():
    return [{"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
            {"prompt": "2+2?", "chosen": "4", "rejected": "５"}]


def check_records(work):
    import datasets
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    for name, rows in (("instruct", instruct_rows()), ("chat", chat_rows()), ("preference", preference_rows())):
        path = os.path.join(work, f"{name}.parquet")
        datasets.Dataset.from_list(rows).to_parquet(path)
        check_same_rows(f"{name} rows (Dataset.to_parquet)", path, "parquet", [path])

    f32 = os.path.join(work, "float32.parquet")
    ds = datasets.Dataset.from_list([{"text": "a", "w": 0.1}, {"text": "b", "w": 3.25}])
    ds.cast_column("w", datasets.Value("float32")).to_parquet(f32)
    check_same_rows("a float32 column (widened exactly)", f32, "parquet", [f32])

    large = os.path.join(work, "large.parquet")
    table = pa.table({
        "text": pa.array(["large ✓", None, ""], pa.large_string()),
        "ids": pa.array([[1, 2], None, [None, 3]], pa.large_list(pa.int64())),
        "turns": pa.array([[{"role": "user", "content": "x"}], [], None],
                          pa.list_(pa.struct([("role", pa.string()), ("content", pa.large_string())]))),
    })
    pq.write_table(table, large, row_group_size=2)  # two row groups
    check_same_rows("large_string, large_list, nested nulls, 2 row groups (pyarrow)", large, "parquet", [large])
    # Types `datasets` does not load (dictionary) or gives as bytes: against pyarrow's own rows.
    other = os.path.join(work, "other_types.parquet")
    pq.write_table(pa.table({
        "kind": pa.array(["a", "b", None, "a"]).dictionary_encode(),
        "pair": pa.array([[1, 2], [3, 4], None, [5, None]], pa.list_(pa.uint64(), 2)),
        "raw": pa.array([b"\x00\xff", b"", None, b"x"], pa.binary()),
    }), other)
    (answer,) = tool(["records", other])
    ref = [{k: {"bytes": list(v), "subtype": None} if isinstance(v, bytes) else v for k, v in row.items()}
           for row in pq.read_table(other).to_pylist()]
    diff = answer.get("error") if "records" not in answer else first_difference(answer["records"], ref)
    check(diff is None, "dictionary strings, fixed_size_list<uint64>, binary: pyarrow's rows" + (f" ({diff})" if diff else ""))

    # A data set directory of shards, as the Hub names them: its train split, the directory, a glob.
    shards = os.path.join(work, "sharded")
    ds = datasets.Dataset.from_list(instruct_rows() * 3)
    files = []
    for i in range(2):
        files.append(os.path.join(shards, "data", f"train-{i:05d}-of-00002.parquet"))
        ds.shard(2, i, contiguous=True).to_parquet(files[-1])
    (split,) = tool(["data", shards, "train"])
    check(split.get("file") == os.path.join(shards, "data", "train-0000*-of-00002.parquet"),
          f"the sharded train split resolves to the glob of its shards: {split}")
    if "file" in split:
        check_same_rows("the sharded train split (2 shards, in order)", split["file"], "parquet", files)
    check_same_rows("the shards' directory", shards, "parquet", files)

    ipc = os.path.join(work, "chat.feather")
    feather.write_feather(datasets.Dataset.from_list(chat_rows()).data.table, ipc)
    check_same_rows("an Arrow IPC file (pyarrow.feather)", ipc, "arrow", [ipc])
    saved = os.path.join(work, "saved")
    datasets.Dataset.from_list(instruct_rows()).save_to_disk(saved)
    (stream,) = glob.glob(os.path.join(saved, "*.arrow"))
    answer = check_same_rows("an Arrow IPC stream (Dataset.save_to_disk)", stream, "arrow", [stream])
    origins = answer.get("origins") or [""]
    check(origins[0] == f"{stream}: row 1", f"a row's origin names the file and row: {origins[0]!r}")


def check_damaged(work, qlora):
    good = os.path.join(work, "instruct.parquet")
    truncated = os.path.join(work, "truncated.parquet")
    with open(good, "rb") as f:
        data = f.read()
    with open(truncated, "wb") as f:
        f.write(data[: len(data) // 2])
    mislabelled = os.path.join(work, "json.parquet")
    shutil.copy(os.path.join(DATA, "tiny_tasks.jsonl"), mislabelled)
    for path, what in ((truncated, "a truncated Parquet file"), (mislabelled, "a JSONL file named .parquet")):
        (answer,) = tool(["records", path])
        err = answer.get("error", "")
        check(path in err and "Parquet" in err, f"{what}: an error naming it: {err[:200]!r}")
    # Damaged inside (footer intact): every answer is the records or an error naming the file, never a crash.
    requests, paths = [], []
    for k, at in enumerate(range(4, len(data) - 64, max(1, (len(data) - 68) // 24))):
        paths.append(os.path.join(work, f"damaged_{k}.parquet"))
        with open(paths[-1], "wb") as f:
            f.write(data[:at] + b"\xff" * 16 + data[at + 16:])
        requests.append(["records", paths[-1]])
    answers = tool(*requests)
    bad = [(p, a) for p, a in zip(paths, answers) if "records" not in a and p not in a.get("error", "")]
    errors = sum("error" in a for a in answers)
    check(not bad, f"{len(paths)} files with 16 bytes overwritten inside: {errors} errors naming the file, "
                   f"{len(paths) - errors} read, no crash" + (f"; first bad answer: {bad[0]}" if bad else ""))
    r = run_recipe(qlora, os.path.join(work, "run_truncated"), "logging.progress=plain",
                   f"data.path={truncated}", expect_rc=1, timeout=120)
    msg = r.stdout + r.stderr
    check(r.returncode == 1 and truncated in msg, f"qlora run on it exits 1 naming the file (rc {r.returncode})")


def check_training(work, qlora):
    import datasets
    shards = os.path.join(work, "tasks")
    ds = datasets.load_dataset("json", data_files=os.path.join(DATA, "tiny_tasks.jsonl"), split="train")
    for i in range(2):
        ds.shard(2, i, contiguous=True).to_parquet(os.path.join(shards, "data", f"train-{i:05d}-of-00002.parquet"))
    short = ("logging.progress=plain", "training.epochs=1", "training.max_steps_per_epoch=2")
    runs = {}
    for name, path in (("jsonl", os.path.join(DATA, "tiny_tasks.jsonl")), ("parquet", shards)):
        out = os.path.join(work, f"run_{name}")
        r = run_recipe(qlora, out, *short, f"data.path={path}", timeout=300)
        runs[name] = losses(out) if r.returncode == 0 else None
    ok = runs["parquet"] is not None and len(runs["parquet"]) == 2 and runs["parquet"] == runs["jsonl"]
    check(ok, f"lora_finetune on the Parquet shards trains 2 steps with the JSONL file's losses: {runs}")


def main():
    global TOOL
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    TOOL = a.tool
    work = os.path.abspath(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # datasets' cache in the work directory, offline: nothing is downloaded, nothing left in ~/.cache.
    os.environ["HF_DATASETS_CACHE"] = os.path.join(work, "hf_datasets_cache")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets
    datasets.disable_progress_bars()
    for part in (lambda: check_records(work), lambda: check_damaged(work, a.qlora), lambda: check_training(work, a.qlora)):
        try:
            part()
        except Exception as e:  # a crash in one part is a failure of it, not the end of the run
            check(False, f"{type(e).__name__}: {e}")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
