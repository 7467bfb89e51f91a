#!/usr/bin/env python3
"""qlora's QLoRA training step against PyTorch + torchao on the same weights: bench_train_step's
device mode draws every weight from seeds on the device (bench/random_llama.h seeded_model) and
bench/peer_train_step.py --spec draws the same ones, so both sides start from the same NF4 base,
the same LoRA A (B = 0), the same tokens, and run the same step (forward, chunked cross-entropy,
backward through activation checkpointing, AdamW). The first three losses (before any update,
after one, after two) must agree:
  - on the CPU in fp32, to 2e-5 relative (measured: 1.5e-7), on the Llama-3.1-8B shape (GQA,
    llama3 RoPE scaling) cut to one layer and a 4096-token vocabulary (minutes less on 2 cores);
  - on a CUDA device when one is visible, in bf16, to 2e-3 relative (rounding differs, the step
    does not), on the Llama-2-7B shape cut to two layers.
The losses must also fall: an update happened. On CUDA the second peer, transformers'
LlamaForCausalLM + peft LoRA on the same torchao NF4 base (bench/hf_peer_train_step.py, "hf"),
runs too and must agree as closely.

The second peer's first loss is also checked on the CPU, in seconds, through bench_train_step's
CPU mode (qlora, the torchtune-structured peer and the HF peer on one random bf16 checkpoint of a
tiny Llama, the same tokens): the three first losses must agree
  - in fp32 to 2e-5 relative (the same ops in other summation orders; measured: 8e-8 qlora
    against the peer, 0 the HF peer against it);
  - in bf16 to 2e-3 relative, the CUDA case's tolerance: bf16 keeps 8 significant bits (up to
    2^-9 ~ 2e-3 relative per rounding) and the sides round at other points (qlora's own bf16
    GEMMs, torch.autocast's), so single logits may differ by an ulp; the loss, an fp32 mean over
    tokens, differs far less (measured: 8e-5 qlora against the peer, 0 the HF peer against it).
(The device mode's CPU case runs only the torchtune-structured peer: the HF peer on that shape
costs two more minutes on a 2-core CPU; by hand, its first three losses there equal the peer's
bit for bit in fp32.)

    test_train_step_peer.py --bench build/bench_train_step
Prints "N passed, M failed"; exits non-zero on any failure.
"""
import argparse
import json
import subprocess
import sys
import tempfile

import torch


def run(bench, args):
    out = subprocess.run([bench] + args, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{bench} {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def check(name, r, tol, results, peer="peer_eager"):
    q, p = r["figures"]["qlora"], r["figures"].get(peer, {})
    if "losses" not in q or "losses" not in p:
        results.append((name, False, f"a side failed: {json.dumps(r.get('peers', r))[:3000]}"))
        return
    ql, pl = q["losses"][:3], p["losses"][:3]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ql, pl))
    ok = len(ql) == 3 and len(pl) == 3 and worst <= tol and ql[2] < ql[0] and pl[2] < pl[0]
    results.append((name, ok, f"qlora {ql} {peer} {pl}: max relative difference {worst:.2e} (tolerance {tol:.0e})"))


def check_first_losses(name, r, tol, results):
    """bench_train_step's CPU mode: qlora's, the peer's and the HF peer's first losses."""
    first = {side: r.get(side, {}).get("losses", [None])[0] for side in ("qlora", "peer", "peer_hf")}
    if None in first.values():
        results.append((name, False, f"a side failed: {json.dumps({k: r.get(k) for k in first})[:3000]}"))
        return
    worst = max(abs(first[side] - first["peer"]) / abs(first["peer"]) for side in ("qlora", "peer_hf"))
    results.append((name, worst <= tol, f"first losses {first}: max relative difference to the peer's {worst:.2e} "
                                        f"(tolerance {tol:.0e})"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:  # the tiny random checkpoint, written once
        for dtype, tol in [("fp32", 2e-5), ("bf16", 2e-3)]:
            r = run(a.bench, ["--hidden", "128", "--inter", "256", "--layers", "2", "--heads", "4", "--vocab", "256",
                              "--seq", "16", "--steps", "1", "--no-profile", "--dtype", dtype, "--workdir", workdir])
            check_first_losses(f"cpu {dtype}, tiny Llama, qlora = peer = HF peer", r, tol, results)
    common = ["--steps", "2", "--batch", "2"]
    r = run(a.bench, ["--device", "cpu", "--dtype", "fp32", "--shape", "llama3.1-8b", "--layers", "1",
                      "--vocab", "4096", "--seq", "48", "--peer-modes", "eager"] + common)
    check("cpu fp32, llama3.1-8b shape, 1 layer, vocab 4096", r, 2e-5, results)
    if torch.cuda.is_available():
        r = run(a.bench, ["--device", "cuda", "--dtype", "bf16", "--shape", "llama2-7b", "--layers", "2",
                          "--seq", "256", "--peer-modes", "eager,hf"] + common)
        check("cuda bf16, llama2-7b shape, 2 layers", r, 2e-3, results)
        check("cuda bf16, llama2-7b shape, 2 layers, HF peer", r, 2e-3, results, "peer_hf")
    else:
        print("SKIP cuda bf16: no CUDA device visible to torch")
    for name, ok, msg in results:
        print(("PASS " if ok else "FAIL ") + name + ": " + msg)
    failed = sum(not ok for _, ok, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
