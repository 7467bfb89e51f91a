"""Conformance: qlora's NF4 is byte-identical to torchao's to_nf4 (the reference we did not write).

Random tensors (bf16 and fp32, shapes up to Llama-2-7B's 11008x4096) go through `qlora quantize`
and `qlora dequantize`; torchao quantizes the same tensors. Codes, int8 scalers, factors and the
mean must be equal bit for bit, and so must the dequantized values.

    python tests/conformance/test_nf4_torchao.py --qlora build/qlora --workdir /tmp/conf
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torchao.dtypes.nf4tensor import to_nf4

CASES = [  # (name, shape, dtype, scale)
    ("l0.self_attn.q_proj.weight", (4096, 4096), torch.bfloat16, 0.02),
    ("l0.mlp.down_proj.weight", (11008, 4096), torch.bfloat16, 0.02),
    ("l1.self_attn.q_proj.weight", (4096, 4096), torch.float32, 0.02),
    ("l1.mlp.up_proj.weight", (11008, 4096), torch.float32, 0.02),
    ("l2.self_attn.k_proj.weight", (256, 64), torch.bfloat16, 1.0),
    ("l2.self_attn.v_proj.weight", (64, 1024), torch.float32, 30.0),
    ("l2.mlp.gate_proj.weight", (512, 512), torch.float16, 0.5),
]

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    src, q, dq = (os.path.join(args.workdir, n) for n in ("in.safetensors", "nf4.safetensors", "deq.safetensors"))

    g = torch.Generator().manual_seed(1234)
    inputs = {}
    for name, shape, dtype, scale in CASES:
        x = torch.randn(*shape, generator=g) * scale
        x[: max(1, shape[0] // 64)] *= 8  # an outlier band: a wide spread of block absmax
        inputs[name] = x.to(dtype)
    inputs["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)  # copied, not quantized
    save_file(inputs, src)

    for cmd in ([args.qlora, "quantize", src, q], [args.qlora, "dequantize", q, dq]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            print(f"0 passed, 1 failed")
            return 1

    passed = failed = 0

    def check(ok: bool, what: str) -> None:
        nonlocal passed, failed
        passed += ok
        failed += not ok
        print(("PASS " if ok else "FAIL ") + what, flush=True)

    with safe_open(q, "pt") as fq, safe_open(dq, "pt") as fd:
        meta = fq.metadata()
        check(meta.get("format") == "qlora-nf4-v1", "file format tag")
        check(torch.equal(fq.get_tensor("model.norm.weight"), inputs["model.norm.weight"]), "non-projection copied")
        for name, shape, dtype, _ in CASES:
            ref = to_nf4(inputs[name])  # block_size 64, scaler_block_size 256
            label = f"{name} {tuple(shape)} {dtype}"
            check(json.loads(meta[name + ".nf4.shape"]) == list(shape), label + ": shape metadata")
            check(meta[name + ".nf4.block_size"] == "64" and meta[name + ".nf4.scaler_block_size"] == "256",
                  label + ": block size metadata")
            pairs = [("codes", ref.quantized_data), ("scalers", ref.quantized_scalers),
                     ("factors", ref.quantization_factor), ("mean", ref.scaler_mean)]
            for part, expect in pairs:
                got = fq.get_tensor(f"{name}.nf4.{part}")
                same = got.dtype == expect.dtype and torch.equal(bits(got).flatten(), bits(expect).flatten())
                if not same and got.shape == expect.reshape(got.shape).shape:
                    diff = (bits(got).flatten() != bits(expect).flatten()).sum().item()
                    print(f"  {part}: {diff} of {got.numel()} differ")
                check(same, f"{label}: {part} byte-identical")
            deq = fd.get_tensor(name)
            expect = ref.get_original_weight()
            check(deq.dtype == expect.dtype and torch.equal(bits(deq), bits(expect)), f"{label}: dequantized bit-identical")
            del ref, expect, deq
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
