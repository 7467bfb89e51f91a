"""`qlora tokenize` on the bundled sentencepiece tokenizer (given as its directory): one {"ids"} line
per input line, equal to the sentencepiece package's ids; --decode of JSON and comma-separated id
lists; errors that name the file and line (bad id list, id outside the vocab), the missing
tokenizer directory, and wrong arguments. Prints "N passed, M failed".

    python tests/recipes/test_tokenize_cli.py --qlora build/qlora [--workdir build/cli_tokenize]
"""
import argparse
import json
import os
import subprocess
import sys

import sentencepiece

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tokenizer")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", default="cli_tokenize")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(DATA, "tokenizer.model"))
    results = []

    def run(*extra):
        return subprocess.run([args.qlora, "tokenize", *extra], capture_output=True, text=True, encoding="utf-8")

    def expect(name, ok, detail=""):
        results.append(ok)
        if not ok:
            print(f"FAIL {name}: {detail}")

    r = run("--tokenizer", DATA, "--text", "Hello world\nCafé 12")
    lines = r.stdout.split("\n")[:-1]
    want = [sp.encode("Hello world"), sp.encode("Café 12")]
    expect("encode", r.returncode == 0 and [json.loads(x)["ids"] for x in lines] == want, r.stdout + r.stderr)

    ids_file = os.path.join(args.workdir, "ids.txt")
    with open(ids_file, "w") as f:
        f.write(json.dumps(want[0]) + "\n" + ",".join(map(str, want[1])) + "\n")
    r = run("--tokenizer", DATA, "--file", ids_file, "--decode")
    got = [json.loads(x)["text"] for x in r.stdout.split("\n")[:-1]]
    expect("decode", r.returncode == 0 and got == ["Hello world", "Café 12"], r.stdout + r.stderr)

    with open(ids_file, "w") as f:
        f.write("[1, 2]\n[3, x]\n")
    r = run("--tokenizer", DATA, "--file", ids_file, "--decode")
    expect("bad list names file and line", r.returncode == 1 and ids_file in r.stderr and "line 2" in r.stderr, r.stderr)
    with open(ids_file, "w") as f:
        f.write(f"1\n2, {sp.get_piece_size()}\n")
    r = run("--tokenizer", DATA, "--file", ids_file, "--decode")
    expect("id outside the vocab names file and line", r.returncode == 1 and "line 2" in r.stderr and
           "outside the vocab" in r.stderr, r.stderr)

    missing = os.path.join(args.workdir, "no_such_model")
    os.makedirs(missing, exist_ok=True)
    r = run("--tokenizer", missing, "--text", "x")
    expect("directory without a tokenizer", r.returncode == 1 and missing in r.stderr and
           "tokenizer.json" in r.stderr, r.stderr)
    r = run("--tokenizer", DATA, "--text", "x", "--file", ids_file)
    expect("--text and --file", r.returncode == 1 and "exactly one" in r.stderr, r.stderr)
    r = run("--text", "x")
    expect("no --tokenizer", r.returncode == 1 and "--tokenizer" in r.stderr, r.stderr)
    r = run("--tokenizer", DATA, "--file", os.path.join(args.workdir, "absent.txt"))
    expect("missing input file", r.returncode == 1 and "absent.txt" in r.stderr, r.stderr)

    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
