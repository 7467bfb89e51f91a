"""`qlora gguf` on a Llama-2-7B-shaped checkpoint (random bf16 weights, 3 shards + index, 13.5 GB,
a sentencepiece tokenizer): seconds and peak RSS per type, beside llama.cpp's own quantizer
(`llama_model_quantize` from the PyPI llama-cpp-python, on our f16 file, as many threads as cores)
making the same k-quant file, and the floor (reading the input and writing a file of the output's
size), all in the same run. Prints one JSON object.

    .venv/bin/python bench/bench_gguf.py --qlora build/qlora --workdir /tmp/g7b
        [--layers 32] [--types f16,q4_k_m] [--no-peer] [--keep]

Targets (issue 24): peak RSS <= 1 GB; q4_k_m no slower than llama.cpp's quantizer.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_quantize_checkpoint import HIDDEN, INTER, VOCAB, bench_args, dir_bytes, make_checkpoint  # noqa: E402
from peak_rss import SNIPPET_IMPORT  # noqa: E402

PEER = SNIPPET_IMPORT + r'''
import ctypes, sys, llama_cpp
src, dst, ftype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = ftype, threads
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
print(f"peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
sys.exit(rc)
'''
# llama.cpp's LLAMA_FTYPE_* of the types its quantizer makes from an f16 file.
PEER_FTYPES = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}


def cpu():
    name, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = [i for i in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if i in flags]
    return {"cpu": name, "isa": isa, "logical_cpus": os.cpu_count()}


def timed(cmd):
    """Runs cmd; returns (seconds, the peak RSS in MiB it printed, stdout+stderr, exit code). The
    process reads its own VmHWM: getrusage's ru_maxrss would be this (large) parent's at fork."""
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m = re.search(r"peak RSS (\d+) MiB", r.stdout)
    return time.time() - t0, float(m.group(1)) if m else float("nan"), r.stdout, r.returncode


def floor_seconds(src, size, scratch):
    """Reading every input byte and writing `size` bytes, fsynced: what no converter can beat."""
    t0 = time.time()
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f:
            while f.read(1 << 24):
                pass
    block = b"\0" * (1 << 24)
    with open(scratch, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.write(block[:size % len(block)])
        f.flush()
        os.fsync(f.fileno())
    os.remove(scratch)
    return time.time() - t0


def make_model(src, layers):
    make_checkpoint(src, layers)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": VOCAB,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shutil.copy(os.path.join(HERE, "..", "tests", "data", "tokenizer", "tokenizer.model"), src)


def main():
    ap = bench_args()
    ap.add_argument("--types", default="f16,q4_k_m")
    a = ap.parse_args()
    src, out = os.path.join(a.workdir, "bf16"), os.path.join(a.workdir, "gguf")
    if not os.path.exists(os.path.join(src, "config.json")):
        shutil.rmtree(a.workdir, ignore_errors=True)
        make_model(src, a.layers)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    report = {"benchmark": "gguf", "model": f"Llama-2-7B shape, {a.layers} layers, bf16 safetensors",
              "input_bytes": dir_bytes(src), "machine": cpu(),
              "qlora": {}, "llama_cpp_quantizer": {}, "floor": {}}
    types = a.types.split(",")
    if not a.no_peer and "f16" not in types:
        types.insert(0, "f16")  # the peer's input
    for t in types:
        path = os.path.join(out, f"qlora-{t}.gguf")
        secs, rss, log, rc = timed([a.qlora, "gguf", src, "--type", t, "-o", path])
        if rc != 0:
            sys.exit(f"qlora gguf --type {t} failed:\n{log}")
        size = os.path.getsize(path)
        report["qlora"][t] = {"seconds": round(secs, 2), "peak_rss_mib": round(rss, 1), "output_bytes": size}
        report["floor"][t] = {"seconds": round(floor_seconds(src, size, os.path.join(out, "floor.bin")), 2)}
        if not a.no_peer and t in PEER_FTYPES:
            peer_out = os.path.join(out, f"llama_cpp-{t}.gguf")
            secs, rss, log, rc = timed([sys.executable, "-c", PEER, os.path.join(out, "qlora-f16.gguf"), peer_out,
                                        str(PEER_FTYPES[t]), str(os.cpu_count())])
            if rc != 0:
                report["llama_cpp_quantizer"][t] = {"error": log[-2000:]}
                continue
            report["llama_cpp_quantizer"][t] = {"seconds": round(secs, 2), "peak_rss_mib": round(rss, 1),
                                                "output_bytes": os.path.getsize(peer_out), "input": "our f16 file"}
            report["qlora"][t]["speedup_vs_llama_cpp"] = round(secs / report["qlora"][t]["seconds"], 2)
            os.remove(peer_out)
    print(json.dumps(report, indent=2))
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
