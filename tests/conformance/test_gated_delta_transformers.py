#!/usr/bin/env python3
"""Conformance: qlora's chunked gated delta rule against transformers' torch_chunk_gated_delta_rule
(Qwen3.5's Gated DeltaNet, the reference we did not write), values and gradients.

For each case the inputs are drawn as Qwen3_5GatedDeltaNet draws them (g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b), q and k L2-normalised inside the kernel), transformers
runs forward and autograd backward with the given output and final-state gradients, and
tests/tools/gated_delta_tool.cpp does the same with our op.

    test_gated_delta_transformers.py --tool build/gated_delta_tool --workdir build/conformance_gdn
Prints "N passed, M failed"; exits non-zero on any failure.
"""
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from _common import Checks, parse_tool_args, run_tool

CASES = [  # (name, batch, seq, k_heads, v_heads, dk, dv, initial_state, l2norm, dtype)
    ("t1", 1, 1, 2, 4, 16, 32, False, True, torch.float32),
    ("t64_state", 2, 64, 2, 4, 16, 32, True, True, torch.float32),
    ("t65", 1, 65, 2, 2, 32, 16, False, True, torch.float32),
    ("t200_state_qwen_dims", 1, 200, 1, 2, 128, 128, True, True, torch.float32),
    ("t130_no_l2", 1, 130, 2, 2, 16, 16, True, False, torch.float32),
    ("t150_bf16", 1, 150, 2, 4, 32, 32, True, True, torch.bfloat16),
    ("t330_state_blocks", 1, 330, 2, 2, 16, 16, True, True, torch.float32),  # 6 chunks: two blocks of 4
]

# Both sides compute in fp32, in different orders (our per-chunk triangular inverse against its two
# triangular solves; our analytic backward against autograd's): <= 2e-7 of max|ref| measured, 1e-4
# allowed. bf16: both take the same bf16 inputs and round the output and each input's gradient once
# to bf16 (2^-9 relative; <= 4e-3 of max|ref| measured, a one-ulp difference): 1e-2 of max|ref|.
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def make_inputs(case, gen):
    _, b, t, hk, hv, dk, dv, with_state, l2, dtype = case
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    k_scale = 1.0 if l2 else 0.5 / dk ** 0.5  # without the norm the rule is stable only for beta |k|^2 < 2
    a_log = torch.empty(hv).uniform_(0.01, 16, generator=gen).log()  # Qwen3_5GatedDeltaNet's A_log init
    dt_bias = torch.ones(hv)
    x = {
        "q": randn(b, t, hk, dk).to(dtype),
        "k": (randn(b, t, hk, dk) * k_scale).to(dtype),
        "v": randn(b, t, hv, dv).to(dtype),
        "g": -a_log.exp() * F.softplus(randn(b, t, hv) + dt_bias),  # fp32, as the module computes it
        "beta": randn(b, t, hv).sigmoid().to(dtype),
    }
    if with_state:
        x["initial_state"] = randn(b, hv, dk, dv) * 0.5
    return x


def reference(x, l2, d_out, d_final):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    out, final = torch_chunk_gated_delta_rule(
        leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"], chunk_size=64,
        initial_state=leaves.get("initial_state"), output_final_state=True, use_qk_l2norm_in_kernel=l2)
    torch.autograd.backward([out, final], [d_out, d_final])
    result = {"out": out.detach(), "final_state": final.detach()}
    result.update({"d_" + n: t.grad for n, t in leaves.items()})
    return result


def main():
    args = parse_tool_args()
    checks = Checks()
    gen = torch.Generator().manual_seed(37)
    for case in CASES:
        name, b, t, _, hv, dk, dv, _, l2, dtype = case
        try:
            x = make_inputs(case, gen)
            d_out = torch.randn(b, t, hv, dv, generator=gen).to(dtype)
            d_final = torch.randn(b, hv, dk, dv, generator=gen)
            src, dst = (os.path.join(args.workdir, f"{name}_{s}.safetensors") for s in ("in", "out"))
            save_file({**x, "d_out": d_out, "d_final": d_final}, src, metadata={"use_qk_l2norm": str(int(l2))})
            ours = run_tool([args.tool, src, dst], dst)
            ref = reference(x, l2, d_out, d_final)
        except Exception as e:  # noqa: BLE001 - one case's crash is that case's failure
            checks.crashed(name, e)
            continue
        for key, want in ref.items():
            tol = REL_TOL[torch.float32 if key == "final_state" else dtype] * max(want.abs().max().item(), 1e-30)
            checks.check(f"{name}.{key} dtype", ours[key].dtype == want.dtype, f"{ours[key].dtype} (ref {want.dtype})")
            checks.compare(f"{name}.{key}", ours[key], want, tol)
    return checks.summary()


if __name__ == "__main__":
    raise SystemExit(main())
