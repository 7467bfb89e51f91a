"""Hub ids in the local Hugging Face cache, checked against huggingface_hub and datasets themselves,
offline (HF_HUB_OFFLINE=1; nothing is downloaded):

1. caches laid out with huggingface_hub's own cache writers (blobs, snapshot links, refs including
   refs/pr/N, a tree listing), confirmed by scan_cache_dir: for branches, tags, a PR ref and commit
   hashes, and for a model and a data set, qlora's snapshot directory (hub_tool) is the one
   snapshot_download(local_files_only=True) returns, and what it refuses qlora refuses;
2. the cache directory from the environment (HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME,
   XDG_CACHE_HOME, HOME; "~" and $VARS): for each setting, in a fresh process, huggingface_hub's
   snapshot_download and qlora resolve the same directory;
3. data set layouts: the splits and their files are the ones datasets' get_data_patterns +
   DataFilesDict.from_patterns give on the same tree;
4. end to end: `qlora run lora_finetune` trains 2 steps on data.path = a cached data set id
   (JSONL train/test files, data.split=train and test) with model.checkpoint_dir = a cached model id
   (the embedded default's tiny base), records the id as base_model_name_or_path; an id that is not
   cached is refused naming the cache and `hf download`.
Prints "N passed, M failed".

    python tests/conformance/test_hub_cache.py --tool build/hub_tool --qlora build/qlora --workdir build/hub
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes"))
from recipe_common import Checks, run_recipe, step_rows  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
from huggingface_hub import scan_cache_dir, snapshot_download  # noqa: E402
from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache  # noqa: E402
from huggingface_hub.file_download import (_cache_commit_hash_for_specific_revision, _create_symlink,  # noqa: E402
                                           repo_folder_name)

check = Checks()
TOOL = None
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")


def commit_of(*parts):
    return hashlib.sha1("/".join(parts).encode()).hexdigest()


def put_snapshot(cache, repo_id, repo_type, files, revisions, listing=False):
    """files {path: bytes} as one commit, blobs linked into snapshots/<commit> by huggingface_hub's
    _create_symlink; each revision's ref written by its _cache_commit_hash_for_specific_revision.
    listing: the commit's tree listing too (write_tree_cache). Returns the commit."""
    storage = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type=repo_type))
    commit = commit_of(repo_id, *sorted(files), *revisions)
    entries = {}
    for path, data in files.items():
        blob_id = hashlib.sha256(data).hexdigest()
        blob = os.path.join(storage, "blobs", blob_id)
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        dst = os.path.join(storage, "snapshots", commit, *path.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        _create_symlink(blob, dst, new_blob=False)
        entries[path] = TreeCacheEntry(size=len(data), blob_id=blob_id)
    for rev in revisions:
        _cache_commit_hash_for_specific_revision(storage, rev, commit)
    if listing:
        write_tree_cache(storage, commit, entries)
    return commit


def tool(*requests):
    """hub_tool's answers to (args, env) requests, env {NAME: value or None (unset)}: one process."""
    lines = "".join(json.dumps({"args": list(args), "env": env or {}}) + "\n" for args, env in requests)
    r = subprocess.run([TOOL], input=lines, capture_output=True, text=True, timeout=60)
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    return answers if len(answers) == len(requests) else [{"error": r.stderr[-300:]}] * len(requests)


def hub_snapshot(repo_id, revision, cache, repo_type="model"):
    try:
        return snapshot_download(repo_id, revision=revision, repo_type=repo_type, cache_dir=cache,
                                 local_files_only=True)
    except Exception as e:  # noqa: BLE001 - what huggingface_hub refuses, by class name
        return type(e).__name__


def check_snapshots(work):
    cache = os.path.join(work, "cache")
    a = put_snapshot(cache, "org/model", "model", {"config.json": b"{}", "sub/x.txt": b"x"}, ["main", "v1.0"])
    b = put_snapshot(cache, "org/model", "model", {"config.json": b"{\"b\": 1}"}, ["dev", "refs/pr/3"], listing=True)
    c = put_snapshot(cache, "gpt2", "model", {"config.json": b"{}"}, ["main"])
    broken = put_snapshot(cache, "org/broken", "model", {"config.json": b"{}", "model.safetensors": b"w"}, ["main"],
                          listing=True)
    os.remove(os.path.join(cache, "models--org--broken", "snapshots", broken, "model.safetensors"))
    put_snapshot(cache, "org/tasks", "dataset", {"train.jsonl": b"{}\n"}, ["main"])
    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    check(set(repos) == {"org/model", "gpt2", "org/broken", "org/tasks"} and
          {"main", "v1.0", "dev", "refs/pr/3"} <= set().union(*(r.refs for r in repos["org/model"].revisions)),
          "huggingface_hub's scan_cache_dir reads the cache these helpers wrote")
    cases = [("org/model", None), ("org/model", "v1.0"), ("org/model", "dev"), ("org/model", "refs/pr/3"),
             ("org/model", a), ("org/model", b), ("gpt2", None), ("gpt2", c), ("org/model", "nope"),
             ("org/model", "0" * 40), ("org/absent", None), ("org/broken", None)]
    specs = [rid + (f"@{rev}" if rev else "") for rid, rev in cases]
    answers = tool(*[(("snapshot", spec, cache), None) for spec in specs],
                   (("data", "org/tasks", "train"), {"HF_HUB_CACHE": cache}))
    for (rid, rev), spec, got in zip(cases, specs, answers):
        want = hub_snapshot(rid, rev, cache)
        ok = got.get("dir") == want if os.path.sep in want else f"'{rid}'" in got.get("error", "")
        check(ok, f"snapshot {spec}: huggingface_hub {want!r}, qlora {got}")
    want = hub_snapshot("org/tasks", None, cache, "dataset")
    check(answers[-1].get("file") == os.path.join(want, "train.jsonl"), f"data set org/tasks: {want} vs {answers[-1]}")


ENV_KEYS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME")
PROBE = ("import sys, json; from huggingface_hub import constants, snapshot_download as s\n"
         "print(json.dumps([constants.HF_HUB_CACHE, s('org/model', local_files_only=True)]))")


def check_environment(work):
    home = os.path.join(work, "home")
    layouts = {  # cache directory -> the environment that names it
        os.path.join(home, ".cache", "huggingface", "hub"): {"HOME": home},
        os.path.join(work, "xdg", "huggingface", "hub"): {"HOME": home, "XDG_CACHE_HOME": os.path.join(work, "xdg")},
        os.path.join(work, "hfhome", "hub"): {"HOME": home, "XDG_CACHE_HOME": "/nowhere", "HF_HOME": "~/../hfhome"},
        os.path.join(work, "legacy"): {"HOME": home, "HF_HOME": "/nowhere", "HUGGINGFACE_HUB_CACHE": "~/../legacy"},
        os.path.join(work, "hubcache"): {"HOME": home, "HF_HOME": "/nowhere", "HUGGINGFACE_HUB_CACHE": "/nowhere",
                                         "QLORA_T": work, "HF_HUB_CACHE": "${QLORA_T}/hubcache"},
    }
    requests = []
    for cache_dir, env in layouts.items():
        put_snapshot(cache_dir, "org/model", "model", {"config.json": cache_dir.encode()}, ["main"])
        full = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
        full.update(env)
        py = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=full, timeout=60)
        hub_cache, hub_dir = json.loads(py.stdout) if py.returncode == 0 else (py.stderr[-300:], None)
        requests.append((cache_dir, env, hub_cache, hub_dir))
    tool_env = [{**{k: None for k in ENV_KEYS}, **env} for _, env, _, _ in requests]
    answers = tool(*[(a, e) for e in tool_env for a in (("cache",), ("model", "org/model"))])
    for k, (cache_dir, env, hub_cache, hub_dir) in enumerate(requests):
        cache, got = answers[2 * k], answers[2 * k + 1]
        check(hub_dir is not None and got.get("dir") == hub_dir and cache.get("cache") == hub_cache,
              f"environment {env}: huggingface_hub cache {hub_cache}, snapshot {hub_dir}; qlora {cache}, {got}")


LAYOUTS = [
    ["README.md", "train.jsonl", "test.jsonl"],
    ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-00000-of-00001.parquet",
     "data/extra.split-00000-of-00001.json"],
    ["train/a.jsonl", "train/b.jsonl", "data/dev-2/c.json", "test.jsonl"],
    ["alpaca_train.jsonl", "my_eval.json", "val.json", "trainer.json", "notes.txt"],
    ["alpaca_data_cleaned.json", ".gitattributes", ".hidden/x.json", "__pycache__/y.json", "sub/z.json"],
    ["logs/run.eval", "train.jsonl"],
    ["training/x.jsonl", "validation/y.jsonl", "testing-1/z.jsonl", "evaluation.jsonl"],
]


def check_splits(work):
    from datasets.data_files import DataFilesDict, get_data_patterns
    bases = [os.path.join(work, "layouts", str(i)) for i in range(len(LAYOUTS))]
    for base, files in zip(bases, LAYOUTS):
        for f in files:
            os.makedirs(os.path.dirname(os.path.join(base, f)), exist_ok=True)
            with open(os.path.join(base, f), "w") as out:
                out.write("{}\n")
    for base, files, got in zip(bases, LAYOUTS, tool(*[(("splits", base), None) for base in bases])):
        theirs = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
        want = {s: sorted({os.path.relpath(p, base) for p in fl}) for s, fl in theirs.items()}
        check(got.get("splits") == want and got.get("order") == list(theirs),
              f"layout {files}: datasets {want}, qlora {got}")


def check_recipe(work, qlora):
    cache = os.path.join(work, "run_cache")
    with open(os.path.join(DATA, "tiny_tasks.jsonl"), "rb") as f:
        lines = f.read().splitlines(keepends=True)
    put_snapshot(cache, "org/tiny-tasks", "dataset",
                 {"README.md": b"# tiny\n", "data/train.jsonl": b"".join(lines[:64]),
                  "data/test.jsonl": b"".join(lines[64:96])}, ["main"])
    env_before = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = cache
    short = ("logging.progress=plain", "training.epochs=1", "training.max_steps_per_epoch=2")
    first = os.path.join(work, "run_data")
    r = run_recipe(qlora, first, *short, "data.path=org/tiny-tasks", timeout=300)
    check(r.returncode == 0 and len(step_rows(first)) == 2, "qlora run trains 2 steps on data.path=org/tiny-tasks")
    # The tiny base this run wrote, cached as a model: a Hub id for model.checkpoint_dir.
    base = os.path.join(first, "tiny_base")
    files = {}
    for root, _, names in os.walk(base):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                files[os.path.relpath(os.path.join(root, n), base).replace(os.sep, "/")] = f.read()
    put_snapshot(cache, "org/tiny-base", "model", files, ["main"])
    second = os.path.join(work, "run_model")
    r = run_recipe(qlora, second, *short, "model.checkpoint_dir=org/tiny-base@main", "data.path=org/tiny-tasks",
                   "data.split=test", timeout=300)
    adapter = os.path.join(second, "epoch_0", "adapter", "adapter_config.json")
    named = json.load(open(adapter)).get("base_model_name_or_path") if os.path.exists(adapter) else None
    check(r.returncode == 0 and len(step_rows(second)) == 2 and named == "org/tiny-base",
          f"model.checkpoint_dir=org/tiny-base@main, data.split=test: 2 steps, base_model_name_or_path {named!r}")
    r = run_recipe(qlora, os.path.join(work, "run_absent"), *short, "model.checkpoint_dir=org/absent", expect_rc=1)
    msg = r.stdout + r.stderr
    check(r.returncode != 0 and "hf download org/absent" in msg and os.path.realpath(cache) in msg,
          "an id not cached is refused naming the cache and `hf download org/absent`")
    r = run_recipe(qlora, os.path.join(work, "run_split"), *short, "data.path=org/tiny-tasks", "data.split=validation",
                   expect_rc=1)
    check(r.returncode != 0 and "no split 'validation'" in r.stdout + r.stderr, "a missing split is refused by name")
    if env_before is None:
        del os.environ["HF_HUB_CACHE"]
    else:
        os.environ["HF_HUB_CACHE"] = env_before


def main():
    global TOOL
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    TOOL = a.tool
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    check_snapshots(a.workdir)
    check_environment(a.workdir)
    check_splits(a.workdir)
    check_recipe(a.workdir, a.qlora)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
