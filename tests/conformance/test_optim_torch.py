#!/usr/bin/env python3
"""Bit-exact conformance of qlora's AdamW, gradient clipping and LR schedules against torch.

For each scenario this runs torch.optim.AdamW(foreach=False, fused=False) with
torch.nn.utils.clip_grad_norm_(foreach=False) and a LambdaLR using torchtune's
get_cosine_schedule_with_warmup formula (or constant-with-warmup) for a few steps on seeded random
params and grads, saves the inputs (and torch's results, for debugging) as safetensors, runs
tests/tools/optim_replay.cpp on the inputs, and compares every param after every step, the final
moments, the total norms and the learning rates bit for bit.

Both sides use the same CPU and default intra-op thread count: ATen's elementwise kernels round
differently on their vectorized and scalar-tail paths, so bit-identity is only defined for equal
layouts, CPU capability and threads.

    test_optim_torch.py --replay build/qlora_optim_replay --workdir build/conformance_optim
Prints "N passed, M failed"; exits non-zero on any failure.
"""
import argparse
import math
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from torch.optim.lr_scheduler import LambdaLR


def torchtune_cosine(warmup, total, num_cycles=0.5):
    # torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup's lr_lambda, verbatim in
    # arithmetic (torchtune is not a dependency of this repo).
    def lr_lambda(current_step):
        if current_step < warmup:
            return current_step / max(1, warmup)
        progress = (current_step - warmup) / max(1, total - warmup)
        cosine_lr_multiple = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        return max(0.0, cosine_lr_multiple)
    return lr_lambda


def constant_with_warmup(warmup):
    def lr_lambda(current_step):
        if current_step < warmup:
            return current_step / max(1, warmup)
        return 1.0
    return lr_lambda


SCENARIOS = [
    # Clipping active on some steps (grad scale varies), decay on, cosine to zero, no resume.
    dict(name="cosine_clip", seed=0, steps=20, lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8,
         weight_decay=0.01, max_norm=1.0, schedule="cosine", warmup_steps=5, total_steps=20,
         resume_at=0),
    # No decay, no clipping, other betas, constant schedule, state saved and reloaded at step 7.
    dict(name="constant_resume", seed=1, steps=12, lr=1e-3, beta1=0.8, beta2=0.95, eps=1e-6,
         weight_decay=0.0, max_norm=0.0, schedule="constant", warmup_steps=3, total_steps=12,
         resume_at=7),
    # Warmup-free cosine, strong decay, tiny max_norm so every step clips, resume mid-cosine.
    dict(name="cosine_always_clip_resume", seed=2, steps=15, lr=5e-2, beta1=0.9, beta2=0.999,
         eps=1e-8, weight_decay=0.1, max_norm=0.05, schedule="cosine", warmup_steps=0,
         total_steps=15, resume_at=9),
]

# Sizes off the SIMD width (33, 7x5) exercise the scalar tails; 300x129 > 32768 elements spans
# several intra-op chunks.
SHAPES = [(16, 64), (33,), (7, 5), (300, 129), (1,)]


def run_torch(sc):
    gen = torch.Generator().manual_seed(sc["seed"])
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    inputs = {f"param.{i}": p.detach().clone() for i, p in enumerate(params)}
    grads = []
    for s in range(sc["steps"]):
        scale = 0.02 * (1 + 10 * (s % 3))  # total norms straddle max_norm
        step_grads = [torch.randn(p.shape, generator=gen) * scale for p in params]
        grads.append(step_grads)
        for i, g in enumerate(step_grads):
            inputs[f"grad.{s}.{i}"] = g.clone()

    opt = torch.optim.AdamW(params, lr=sc["lr"], betas=(sc["beta1"], sc["beta2"]), eps=sc["eps"],
                            weight_decay=sc["weight_decay"], foreach=False, fused=False)
    lam = (torchtune_cosine(sc["warmup_steps"], sc["total_steps"]) if sc["schedule"] == "cosine"
           else constant_with_warmup(sc["warmup_steps"]))
    sched = LambdaLR(opt, lam)
    expected, norms, lrs = {}, [], []
    for s in range(sc["steps"]):
        for p, g in zip(params, grads[s]):
            p.grad = g.clone()
        if sc["max_norm"] > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, sc["max_norm"], foreach=False)
        else:  # clipping disabled: only measured, as the C++ side does
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=False)
        norms.append(norm.item())
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        for i, p in enumerate(params):
            expected[f"param.{i}.step{s}"] = p.detach().clone()
    for i, p in enumerate(params):
        expected[f"exp_avg.{i}"] = opt.state[p]["exp_avg"].clone()
        expected[f"exp_avg_sq.{i}"] = opt.state[p]["exp_avg_sq"].clone()
    expected["norm"] = torch.tensor(norms, dtype=torch.float32)
    expected["lr"] = torch.tensor(lrs, dtype=torch.float64).view(torch.int64)
    return inputs, expected


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replay", required=True, help="path to the optim_replay binary")
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)

    passed = failed = 0
    for sc in SCENARIOS:
        inputs, expected = run_torch(sc)
        meta = {k: repr(v) if isinstance(v, float) else str(v) for k, v in sc.items()
                if k not in ("name", "seed")}
        meta["num_params"] = str(len(SHAPES))
        in_path = os.path.join(args.workdir, f"{sc['name']}.in.safetensors")
        out_path = os.path.join(args.workdir, f"{sc['name']}.out.safetensors")
        save_file(inputs, in_path, metadata=meta)
        save_file(expected, os.path.join(args.workdir, f"{sc['name']}.expected.safetensors"))
        r = subprocess.run([args.replay, in_path, out_path], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL {sc['name']}: replay exited {r.returncode}: {r.stderr.strip()}")
            failed += len(expected)
            continue
        got = load_file(out_path)
        for name, want in expected.items():
            have = got.get(name)
            if have is None:
                print(f"FAIL {sc['name']}/{name}: missing from replay output")
                failed += 1
            elif have.shape != want.shape or have.dtype != want.dtype:
                print(f"FAIL {sc['name']}/{name}: {have.dtype}{list(have.shape)} vs "
                      f"{want.dtype}{list(want.shape)}")
                failed += 1
            elif not torch.equal(bits(have), bits(want)):
                diff = (bits(have) != bits(want)).sum().item()
                extra = ""
                if want.dtype == torch.float32:
                    extra = f", max |diff| {(have - want).abs().max().item():.3g}"
                print(f"FAIL {sc['name']}/{name}: {diff} of {want.numel()} elements differ{extra}")
                failed += 1
            else:
                passed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
