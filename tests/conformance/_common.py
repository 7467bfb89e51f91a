"""Helpers shared by the conformance tests that compare our model tools with transformers/peft.

  parse_tool_args  --tool and --workdir
  Checks           counts PASS/FAIL lines; compare() prints max|diff| against a tolerance
  randomize_norms  random norm weights and biases (HF initialises them to 1 / 0, which would hide a
                   norm or bias we skip or apply the wrong way)
  nf4_roundtrip_projections  each decoder *_proj.weight (and Qwen3.5's in_proj_*) replaced by torchao's to_nf4 dequantized
  save_sharded     save_pretrained split into >= 2 shards (model.safetensors.index.json)
  run_tool         runs a tests/tools program, returns the tensors it wrote; stderr in the error
"""
import argparse
import json
import os
import subprocess

import torch
import transformers
from safetensors.torch import load_file

transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars in the test log

# torchao's to_nf4 needs numel % (block_size 64 * scaler_block_size 256) == 0.
NF4_NUMEL_MULTIPLE = 64 * 256


def parse_tool_args(add=None):
    """--tool PATH --workdir DIR (created), plus what `add(parser)` adds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--workdir", required=True)
    if add is not None:
        add(ap)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    return args


class Checks:
    def __init__(self):
        self.passed = self.failed = 0

    def check(self, label, ok, detail):
        ok = bool(ok)
        print(f"{'PASS' if ok else 'FAIL'} {label}: {detail}", flush=True)
        self.passed += ok
        self.failed += not ok
        return ok

    def compare(self, label, ours, ref, atol):
        """Tensors equal within atol (and finite, and of one shape); prints max|diff|."""
        same_shape = tuple(ours.shape) == tuple(ref.shape)
        diff = (ours.float() - ref.float()).abs().max().item() if same_shape else float("inf")
        ok = same_shape and diff <= atol and torch.isfinite(ours).all().item()
        return self.check(label, ok, f"shape {tuple(ours.shape)} (ref {tuple(ref.shape)}) max|diff| {diff:.3e} "
                                     f"(atol {atol:g}, max|ref| {ref.abs().max().item():.3f})")

    def crashed(self, label, e):
        """A crash in one case is a failure of that case, not the end of the run."""
        return self.check(label, False, f"{type(e).__name__}: {e}")

    def summary(self):
        print(f"{self.passed} passed, {self.failed} failed")
        return 1 if self.failed else 0


def randomize_norms(model, seed):
    """Norm weights ~ 1 + 0.2 N(0, 1) and biases (gpt-oss's experts' *_proj_bias too) ~ 0.1 N(0, 1),
    drawn from `seed`; Gemma 4's layer_scalar buffers (1 at init, not in the checkpoints it ships) ~
    U(0.5, 1); Gemma 4's MoE norms (pre_feedforward_layernorm_2, post_feedforward_layernorm_1/_2) and
    its router's scale and per_expert_scale (1 at init) like norm weights."""
    g = torch.Generator().manual_seed(seed)
    gemma4_moe = ("layernorm_1.weight", "layernorm_2.weight", "router.scale", "router.per_expert_scale")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(gemma4_moe):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias") or n.endswith("_proj_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.5 + 0.5 * torch.rand(b.shape, generator=g))


def _our_layout(w, name):
    """A gpt-oss expert's matrix [in, out] (gate_up_proj: gate and up interleaved along out) as qlora holds
    it: [out, in], gate's rows then up's."""
    w = w.t()
    return torch.cat([w[0::2], w[1::2]]) if name.endswith("gate_up_proj") else w


def _gpt_oss_layout(w, name):
    """_our_layout's inverse."""
    if name.endswith("gate_up_proj"):
        half = w.size(0) // 2
        w = torch.stack([w[:half], w[half:]], 1).flatten(0, 1)
    return w.t()


def _nf4_roundtrip(w):
    from torchao.dtypes.nf4tensor import to_nf4
    if w.numel() % NF4_NUMEL_MULTIPLE:
        raise ValueError(f"numel {w.numel()} is not a multiple of {NF4_NUMEL_MULTIPLE} (torchao)")
    return to_nf4(w.detach().contiguous().clone()).get_original_weight()


def nf4_roundtrip_projections(model):
    """What our --nf4 base computes with: every decoder projection weight through torchao's NF4.

    A fused projection (Phi-3's qkv_proj, gate_up_proj) is quantized as the one tensor the checkpoint
    stores, as bitsandbytes/torchao would quantize that nn.Linear."""
    from torchao.dtypes.nf4tensor import to_nf4
    with torch.no_grad():
        for n, p in model.named_parameters():
            decoder = n.startswith("model.layers.") or n.startswith("model.language_model.layers.")
            per_layer = n.endswith("per_layer_input_gate.weight") or n.endswith("per_layer_projection.weight")
            # A MoE layer's fused experts [E, out, in]: each expert's matrix its own NF4 tensor.
            experts = n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")
            if decoder and experts and getattr(model.config, "model_type", "") == "gpt_oss":
                for w in p:  # [in, out], gate/up interleaved: qlora quantizes [out, in], gate's rows then up's
                    w.copy_(_gpt_oss_layout(_nf4_roundtrip(_our_layout(w, n)), n))
            elif decoder and (n.endswith("_proj.weight") or ".in_proj_" in n or per_layer or experts):
                for w in (p if experts else [p]):
                    if w.numel() % NF4_NUMEL_MULTIPLE:
                        raise ValueError(f"{n}: numel {w.numel()} is not a multiple of {NF4_NUMEL_MULTIPLE} (torchao)")
                    w.copy_(to_nf4(w.detach().clone()).get_original_weight())


def save_sharded(model, directory, max_shard_size="1MB"):
    """save_pretrained in several shards; returns the number of shard files (the index's values)."""
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return 1
    with open(index) as f:
        return len(set(json.load(f)["weight_map"].values()))


def tokens_arg(tokens):
    """[batch, seq] ids -> "1,2,3;4,5,6" (llama_logits --tokens)."""
    return ";".join(",".join(str(int(t)) for t in row) for row in tokens.tolist())


def run_checked(cmd):
    """Runs a tool; on a non-zero exit raises with the tool's stderr."""
    cmd = [str(c) for c in cmd]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        # stderr first (it names the cause); the command without its long --tokens value.
        shown = " ".join("..." if i and cmd[i - 1] == "--tokens" else c for i, c in enumerate(cmd))
        raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()} [{shown}]")


def run_tool(cmd, out):
    """Runs cmd (which writes the safetensors file `out`) and returns its tensors."""
    run_checked(cmd)
    return load_file(out)


def logits_tool(tool, ckpt, tokens, out, nf4=False, extra=()):
    """llama_logits on [batch, seq] tokens -> float32 logits [batch, seq, vocab]."""
    cmd = [tool, "--checkpoint", ckpt, "--tokens", tokens_arg(tokens), "--dtype", "fp32", "--out", out, *extra]
    if nf4:
        cmd.append("--nf4")
    return run_tool(cmd, out)["logits"]
