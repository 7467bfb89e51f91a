"""`qlora CMD --help` / `-h` print CMD's usage (stdout, exit 0); an unknown option prints the error
naming it and the usage (stderr, non-zero); `qlora config` prints every key of the schema with its
value and default, after --config files and key=value overrides."""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each subcommand, with options its usage must name.
COMMANDS = {
    "run": ["--nproc-per-node", "--config", "qlora config"],
    "config": ["--config"],
    "data": ["--config", "-n"],
    "generate": ["--checkpoint", "--prompt", "--message", "--max-new-tokens"],
    "plot": ["-o"],
    "ls": [],
    "tokenize": ["--tokenizer", "--text", "--decode"],
    "quantize": ["IN OUT", "--out"],
    "dequantize": ["--dtype"],
    "gguf": ["--type", "-o", "--name", "--adapter"],
}


def qlora(exe, *args):
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def test_help(exe):
    top = qlora(exe, "--help")
    check(top.returncode == 0, "qlora --help exits 0")
    for cmd in COMMANDS:
        check(re.search(r"^  " + cmd + r"\b", top.stdout, re.M), f"qlora --help lists {cmd}")
    for cmd, options in COMMANDS.items():
        for flag in ("--help", "-h"):
            r = qlora(exe, cmd, flag)
            check(r.returncode == 0, f"qlora {cmd} {flag} exits 0 (got {r.returncode}: {r.stderr})")
            check(cmd in r.stdout and all(o in r.stdout for o in options),
                  f"qlora {cmd} {flag} names {options}: {r.stdout}")
        r = qlora(exe, cmd, "--no-such-option")
        check(r.returncode != 0, f"qlora {cmd} --no-such-option fails")
        check("--no-such-option" in r.stderr and "usage:" in r.stderr and cmd in r.stderr,
              f"qlora {cmd} --no-such-option names the option and prints the usage: {r.stderr}")
    for recipe in ("lora_finetune", "lora_dpo"):
        r = qlora(exe, "run", recipe, "--help")
        check(r.returncode == 0 and "qlora config" in r.stdout, f"qlora run {recipe} --help points to qlora config")


def schema_keys():
    text = open(os.path.join(ROOT, "src/qlora/config/config.cpp")).read()
    keys = [f"{s}.{k}" for s, k in re.findall(r'\bv\("(\w+)", "(\w+)"', text)]
    check(len(keys) > 30, "the key table of config.cpp parses")
    return keys


descriptions = {}


def config_lines(exe, *args):
    r = qlora(exe, "config", *args)
    check(r.returncode == 0, f"qlora config {args} exits 0: {r.stderr}")
    out, last = {}, None
    for line in r.stdout.splitlines():
        m = re.match(r"^(\w+\.\w+) = (.*?)\s+# default: (.*)$", line)
        if m:
            last = m.group(1)
            out[last] = (m.group(2), m.group(3))
        elif last and line.strip():  # the key's description, on the line after it
            descriptions[last] = line.strip()
            last = None
    return out


def test_config(exe, workdir):
    lines = config_lines(exe)
    for key in schema_keys():
        check(key in lines, f"qlora config prints {key}")
        check(descriptions.get(key), f"qlora config describes {key} (src/qlora/config/key_docs.cpp)")
    check(lines["lora.rank"][1] == "8", f"lora.rank's default is 8: {lines['lora.rank']}")
    over = config_lines(exe, "lora_finetune", "lora.rank=32", "optim.lr=0.001")
    check(over["lora.rank"] == ("32", "8"), f"override lora.rank=32: {over['lora.rank']}")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "c.toml")
    with open(path, "w") as f:
        f.write("[lora]\nrank = 4\n[training]\nepochs = 3\n")
    from_file = config_lines(exe, "--config", path, "training.epochs=5")
    check(from_file["lora.rank"][0] == "4", f"--config sets lora.rank=4: {from_file['lora.rank']}")
    check(from_file["training.epochs"][0] == "5", "key=value overrides the --config file")
    bad = qlora(exe, "config", "lora.no_such_key=1")
    check(bad.returncode != 0 and "no_such_key" in bad.stderr, "qlora config refuses an unknown key")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    test_help(a.qlora)
    test_config(a.qlora, a.workdir)
    print("ok")


if __name__ == "__main__":
    main()
