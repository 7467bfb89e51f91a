#!/usr/bin/env python3
"""Conformance: the vision towers (models/vision/, through tests/tools/vision_tool) against transformers 5.23's
model.model.get_image_features(...).pooler_output, the features that land at the image tokens.

Tiny random VLMs written by transformers' save_pretrained, one per family: Qwen3.5 (_families.QWEN35_VISION, 2
blocks), Gemma 3 (_families.GEMMA3_VISION: SigLIP + the pooled projector) and Gemma 4 (_families.GEMMA4_VISION
with 2 layers, one K/V head for 2 query heads, clamped linears whose bounds bite, standardize on). Every tower
tensor is drawn so activations are O(1) (transformers' init: std 0.02 linears, a zero Gemma 3 projection,
uninitialised Gemma 4 standardisation buffers, which would hide a skipped op). Two images of different sizes each,
as the processors shape them: Qwen3.5 grids (1, 6, 4) and (1, 4, 10) against a 4 x 4 position table (both
resampled), Gemma 3 two 32 x 32 images, Gemma 4 6 x 6 and 3 x 9 patches (4 and 3 soft tokens) padded to 54.
  reference  each ablation (a feature switched off) moves transformers' features by far more than the fp32
             tolerance, so the case exercises it
  fp32       our features against transformers' in fp32; the tower holds every tensor of transformers' tower
             and projector (none skipped)
  bf16       --dtype bf16 against the model cast to bf16
  nf4        --nf4: the encoder linears in NF4; the reference runs on the weights our tool dequantized
             (--dump-weights), every other tensor as written
  padding    Gemma 4: junk pixels in the padding patches change nothing (transformers masks them)
  lora       QLoRA: the encoder linears in NF4 with LoRA on every one (random A and B) and the projector trained
             (peft's modules_to_save): the gradients of sum(features * G) equal peft's on transformers' model
             holding the same dequantized weights
  hub        Gemma 3 from the Hub's key layout (vision_tower.vision_model.*): the same features
  errors     inputs that do not fit (a Qwen3.5 grid that does not match the pixel rows, a Gemma 4 position past
             the table, a Gemma 3 image of another size) are refused with a message naming the tensor

Usage: test_vision_towers.py --tool PATH/vision_tool --workdir DIR
Prints one line per check and "N passed, M failed"; exit status 1 on any failure.
"""
import copy
import os
import shutil
import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import _families as F
from _common import Checks, parse_tool_args, run_tool

# fp32: we run transformers' ops in its order (conv patches, fp32 interpolation weights and angles, SDPA per
# image with its materialised mask, Gemma 4's pow-based RMSNorm, the one-hot pooling matmul) on the same LibTorch
# kernels, and the features are bit-identical today (max|diff| 0 in fp32, bf16 and NF4 on every tower). The
# tolerances leave room for a kernel that sums in another order (a GEMM blocked otherwise, another SIMD width):
# 1e-5 per unit of the largest reference feature is ~100 fp32 ulps of it, while every ablation moves the
# features by O(0.1 .. 1).
ATOL_FP32_PER_UNIT = 1e-5
# bf16 on both sides (transformers as from_pretrained(dtype=bf16) loads it): about 2 bf16 ulps of the largest
# feature, for the same reason.
ATOL_BF16_PER_UNIT = 1e-2
# Gradients (fp32 on both sides), each tensor within GRAD_RTOL of its largest reference entry: our LoRA linears
# run as one fused node (the update accumulated inside the base GEMM, five GEMMs in backward) where peft adds
# two products, and backward sums over every patch in other orders. Measured from peft's fp32: 5e-6 (Qwen3.5),
# 7e-6 (Gemma 3), 1.9e-5 (Gemma 4) on the NF4 base, 1.6e-5 / 6e-6 / 4e-5 on a dense one; against peft in
# float64 ours and peft's own fp32 are equally far (3.2e-5 on Gemma 4, whose pooler runs in fp32 even there).
# A wrong scale or a missing term is off by > 1e-2.
GRAD_RTOL = 1e-4
ABLATION_MARGIN = 100.0
LORA_R, LORA_ALPHA = 4, 8.0

# The language model beside each tower is never run here: one small layer keeps writing the model quick.
TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_hidden_layers=1, vocab_size=128, layer_types=["full_attention"])
QWEN_GRIDS = [[1, 6, 4], [1, 4, 10]]
GEMMA4_SHAPES = [(6, 6), (3, 9)]  # patches (h, w): 4 and 3 soft tokens at pooling kernel 3
GEMMA4_MAX_SOFT = 6


def atol_for(ref, per_unit):
    return per_unit * max(1.0, ref.abs().max().item())


def randomize_tower(model, prefixes, seed):
    """Tower and projector tensors drawn so activations are O(1): matrices ~ N(0, 1/fan_in), norm weights
    ~ 1 + 0.2 N(0, 1) (Gemma 3's projector norm, 1 + w: 0.2 N(0, 1)), biases ~ 0.1 N(0, 1), position tables
    ~ 0.5 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            # Not the rotary's frequencies (computed from the config, not stored) nor scalar clamp bounds.
            if not n.startswith(prefixes) or not p.is_floating_point() or p.dim() == 0 or "inv_freq" in n:
                continue
            r = torch.randn(p.shape, generator=g)
            if n.endswith("mm_soft_emb_norm.weight"):
                p.copy_(0.2 * r)
            elif "norm" in n and n.endswith(".weight") or n.endswith("std_scale"):
                p.copy_(1.0 + 0.2 * r)
            elif n.endswith(".bias") or n.endswith("std_bias"):
                p.copy_(0.1 * r)
            elif "pos" in n:
                p.copy_(0.5 * r)
            elif n.endswith("mm_input_projection_weight"):
                p.copy_(r / p.shape[0] ** 0.5)
            else:
                p.copy_(r / (p[0].numel() ** 0.5))


def set_clamps(model, bound_in, bound_out):
    with torch.no_grad():
        for n, b in model.named_buffers():
            for key, v in (("input_min", -bound_in), ("input_max", bound_in), ("output_min", -bound_out),
                           ("output_max", bound_out)):
                if n.endswith(key):
                    b.fill_(v)


# ---- The three towers: model, inputs, reference ----

def qwen_case():
    config = F.qwen35_multimodal_config(**TEXT)
    config.vision_config.depth = 2
    model = F.Qwen3_5ForConditionalGeneration(config).eval()
    prefixes = ("model.visual.",)
    randomize_tower(model, prefixes, 1)
    grid = torch.tensor(QWEN_GRIDS)
    g = torch.Generator().manual_seed(2)
    vc = config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    inputs = {"pixel_values": torch.randn(int(grid.prod(-1).sum()), dim, generator=g), "image_grid_thw": grid}
    features = lambda m, i, **kw: torch.cat(m.model.get_image_features(
        i["pixel_values"], image_grid_thw=i["image_grid_thw"], **kw).pooler_output)
    rows = int(grid.prod(-1).sum())
    ablations = [("one attention segment over both images",
                  lambda m: setattr(m, "extra", {"cu_seqlens": torch.tensor([0, rows], dtype=torch.int32)})),("position table 0", lambda m: m.model.visual.pos_embed.weight.data.zero_()),
                 ("rotary frequencies cubed", lambda m: m.model.visual.rotary_pos_emb.inv_freq.data.pow_(3.0))]
    return dict(model=model, prefixes=prefixes, inputs=inputs, features=features, ablations=ablations,
                targets=["qkv", "proj", "linear_fc1", "linear_fc2"],
                peft_targets=r"model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])",
                projector="merger")


def gemma3_case():
    config = F.gemma3_multimodal_config(**TEXT)
    config.vision_config.num_hidden_layers = 2
    model = F.Gemma3ForConditionalGeneration(config).eval()
    prefixes = ("model.vision_tower.", "model.multi_modal_projector.")
    randomize_tower(model, prefixes, 3)
    g = torch.Generator().manual_seed(4)
    size = config.vision_config.image_size
    inputs = {"pixel_values": torch.rand(2, 3, size, size, generator=g) * 2 - 1}
    features = lambda m, i, **kw: m.model.get_image_features(i["pixel_values"], **kw).pooler_output.flatten(0, 1)
    ablations = [("position table 0",
                  lambda m: m.model.vision_tower.embeddings.position_embedding.weight.data.zero_()),
                 ("projector norm weight 0 (scale 1)",
                  lambda m: m.model.multi_modal_projector.mm_soft_emb_norm.weight.data.zero_())]
    return dict(model=model, prefixes=prefixes, inputs=inputs, features=features, ablations=ablations,
                targets=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
                peft_targets=r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])",
                projector="multi_modal_projector")


def gemma4_inputs(config, seed, junk_padding=False):
    """The processor's layout: each image's patches in raster order, (x, y) positions, then padding with
    position (-1, -1) and zero pixels (junk_padding: random pixels instead, which must change nothing)."""
    vc = config.vision_config
    per_patch, max_patches = 3 * vc.patch_size ** 2, GEMMA4_MAX_SOFT * vc.pooling_kernel_size ** 2
    g = torch.Generator().manual_seed(seed)
    pixels = torch.zeros(len(GEMMA4_SHAPES), max_patches, per_patch)
    positions = torch.full((len(GEMMA4_SHAPES), max_patches, 2), -1, dtype=torch.long)
    for i, (h, w) in enumerate(GEMMA4_SHAPES):
        pixels[i, :h * w] = torch.rand(h * w, per_patch, generator=g)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[i, :h * w] = torch.stack([xs.flatten(), ys.flatten()], -1)
        if junk_padding:
            pixels[i, h * w:] = torch.randn(max_patches - h * w, per_patch) * 3
    return {"pixel_values": pixels, "image_position_ids": positions}


def gemma4_case():
    config = F.gemma4_multimodal_config(**dict(TEXT, global_head_dim=32, hidden_size_per_layer_input=0))
    vc = config.vision_config
    vc.num_hidden_layers, vc.num_key_value_heads, vc.use_clipped_linears, vc.standardize = 2, 1, True, True
    model = F.Gemma4ForConditionalGeneration(config).eval()
    prefixes = ("model.vision_tower.", "model.embed_vision.")
    randomize_tower(model, prefixes, 5)
    set_clamps(model, 1.5, 1.0)
    features = lambda m, i, **kw: torch.cat(m.model.get_image_features(
        i["pixel_values"], image_position_ids=i["image_position_ids"], **kw).pooler_output)

    def no_clamps(m):
        set_clamps(m, float("inf"), float("inf"))

    ablations = [("clamps off", no_clamps),
                 ("std_scale 1", lambda m: m.model.vision_tower.std_scale.data.fill_(1.0)),
                 ("position table 0",
                  lambda m: m.model.vision_tower.patch_embedder.position_embedding_table.data.zero_())]
    return dict(model=model, prefixes=prefixes, inputs=gemma4_inputs(config, 6), features=features, ablations=ablations,
                targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                peft_targets=r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                             r"\.linear",
                projector="embed_vision")


CASES = {"qwen3_5": qwen_case, "gemma3": gemma3_case, "gemma4": gemma4_case}


# ---- Checks ----

class Run:
    def __init__(self, args, name, ckpt):
        self.args, self.name, self.ckpt = args, name, ckpt

    def path(self, tag):
        return os.path.join(self.args.workdir, f"{self.name}_{tag}.safetensors")

    def tool(self, inputs, tag, *extra):
        inp = self.path(f"{tag}_in")
        save_file({k: v.contiguous() for k, v in inputs.items()}, inp)
        out = self.path(tag)
        return run_tool([self.args.tool, "--checkpoint", self.ckpt, "--inputs", inp, "--out", out, *extra], out)


def reference(case, model, inputs):
    """transformers' features; an ablation may leave keyword arguments for get_image_features in model.extra."""
    with torch.no_grad():
        return case["features"](model, inputs, **getattr(model, "extra", {})).float()


def check_forwards(checks, run, case, ref):
    model, inputs = case["model"], case["inputs"]
    atol = atol_for(ref, ATOL_FP32_PER_UNIT)
    for label, edit in case["ablations"]:
        ablated = copy.deepcopy(model)
        edit(ablated)
        moved = (reference(case, ablated, inputs) - ref).abs().max().item()
        checks.check(f"{run.name} reference exercises: {label}", moved > ABLATION_MARGIN * atol,
                     f"max|ablated - ref| {moved:.3e} (want > {ABLATION_MARGIN:g} x atol {atol:.1e})")
    got = run.tool(inputs, "fp32")
    checks.compare(f"{run.name} fp32", got["features"], ref, atol)
    with safe_open(run.path("fp32"), "pt") as f:
        held = set(f.metadata()["tensors"].split(","))
    stored = {k for k in model.state_dict() if k.startswith(case["prefixes"])}
    checks.check(f"{run.name} holds every tower and projector tensor", held == stored,
                 f"{len(held)} held, {len(stored)} in the model; only held {sorted(held - stored)[:3]}, "
                 f"not held {sorted(stored - held)[:3]}")
    check_checkpoint_keys(checks, run, run.path("fp32"))
    counts = [int(c) for c in got["tokens_per_image"]]
    checks.check(f"{run.name} tokens per image", sum(counts) == ref.shape[0], f"{counts} for {ref.shape[0]} rows")
    # As users load it: from_pretrained(dtype=bf16) keeps the rotary's computed frequencies in fp32 (a
    # .to(bfloat16) of the model would round them too) and makes the stored buffers bf16.
    ref16 = reference(case, type(model).from_pretrained(run.ckpt, dtype=torch.bfloat16).eval(), inputs)
    checks.compare(f"{run.name} bf16", run.tool(inputs, "bf16", "--dtype", "bf16")["features"], ref16,
                   atol_for(ref16, ATOL_BF16_PER_UNIT))
    ours = run.tool(inputs, "nf4", "--nf4", "--dump-weights", run.path("nf4_weights"))
    nf4_model = copy.deepcopy(model)
    weights = load_file(run.path("nf4_weights"))
    missing = set(weights) - set(dict(nf4_model.named_parameters()))
    nf4_model.load_state_dict(weights, strict=False)
    ref_nf4 = reference(case, nf4_model, inputs)
    moved = (ref_nf4 - ref).abs().max().item()
    checks.check(f"{run.name} nf4 weights are the encoder's", not missing and moved > 0,
                 f"{len(weights)} linears, unknown {sorted(missing)[:3]}, features moved {moved:.2e}")
    checks.compare(f"{run.name} nf4", ours["features"], ref_nf4, atol_for(ref_nf4, ATOL_FP32_PER_UNIT))


def peft_name(n):
    """peft's live parameter name -> the adapter file's (and vision_tool's)."""
    return n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.").replace(
        ".modules_to_save.default.", ".")


def check_lora(checks, run, case):
    from peft import LoraConfig, get_peft_model
    model = copy.deepcopy(case["model"])
    # QLoRA, as users run it: the encoder linears in NF4 (our tool's --nf4), peft's base on the same values
    # (the nf4 check's --dump-weights of this checkpoint).
    model.load_state_dict(load_file(run.path("nf4_weights")), strict=False)
    peft_model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                  target_modules=case["peft_targets"],
                                                  modules_to_save=[case["projector"]]))
    g = torch.Generator().manual_seed(7)
    trainable = {}
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if p.requires_grad:
                if ".lora_" in n:  # B nonzero, so A's gradient is too
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                trainable[peft_name(n)] = p
    inputs = dict(case["inputs"])
    feats = case["features"](peft_model.base_model.model, inputs)
    grad_output = torch.randn(feats.shape, generator=g)
    (feats.float() * grad_output).sum().backward()
    save_file({k: v.detach().contiguous() for k, v in trainable.items()}, run.path("trainable"))
    inputs["grad_output"] = grad_output
    got = run.tool(inputs, "lora", "--nf4", "--lora-targets", ",".join(case["targets"]), "--lora-r", str(LORA_R),
                   "--lora-alpha", str(LORA_ALPHA), "--train-projector", "--trainable", run.path("trainable"))
    names = sorted(trainable)
    ours = {k[len("grad."):] for k in got if k.startswith("grad.")}
    checks.check(f"{run.name} lora trainable tensors", ours == set(names),
                 f"{len(ours)} ours, {len(names)} peft's; only ours {sorted(ours - set(names))[:2]}, "
                 f"only peft's {sorted(set(names) - ours)[:2]}")
    rel = {}
    for n in names:
        ours_g = got.get("grad." + n)
        ref_g = trainable[n].grad
        scale = max(ref_g.abs().max().item(), 1e-6)
        rel[n] = (ours_g - ref_g).abs().max().item() / scale if ours_g is not None and ours_g.shape == ref_g.shape \
            else float("inf")
    worst = max(rel, key=rel.get)
    checks.check(f"{run.name} qlora + projector gradients ({len(names)} tensors)", rel[worst] <= GRAD_RTOL,
                 f"worst max|diff| / max|ref| {rel[worst]:.2e} at {worst} (rtol {GRAD_RTOL:g})")


def check_checkpoint_keys(checks, run, out):
    """Each tensor the tower holds maps to its own key of the checkpoint it was read from (Tower::checkpoint_key,
    under which a merged export writes a trained tower): the checkpoint's tower and projector keys, one each."""
    with safe_open(out, "pt") as f:
        keys = f.metadata()["checkpoint_keys"].split(",")
    with safe_open(os.path.join(run.ckpt, "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    checks.check(f"{run.name} names its tensors by the checkpoint's keys", len(set(keys)) == len(keys) and set(keys) <= stored,
                 f"{len(keys)} keys, not in the checkpoint: {sorted(set(keys) - stored)[:3]}")


def check_hub_layout(checks, run, case, ref):
    """Gemma 3 as the Hub ships it: the tower under vision_tower.vision_model.* (transformers 5 writes
    vision_tower.*); the same features."""
    hub = os.path.join(run.args.workdir, f"{run.name}_hub")
    os.makedirs(hub, exist_ok=True)
    shutil.copy(os.path.join(run.ckpt, "config.json"), hub)
    tensors = load_file(os.path.join(run.ckpt, "model.safetensors"))
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()},
              os.path.join(hub, "model.safetensors"))
    hub_run = Run(run.args, f"{run.name}_hub", hub)
    ours = hub_run.tool(case["inputs"], "fp32")["features"]
    check_checkpoint_keys(checks, hub_run, hub_run.path("fp32"))
    checks.compare(f"{run.name} the Hub's key layout (vision_tower.vision_model.*)", ours, ref,
                   atol_for(ref, ATOL_FP32_PER_UNIT))


def check_errors(checks, run, case):
    """Inputs that do not fit the tower are refused with a message naming the tensor."""
    if run.name == "qwen3_5":
        label, key, bad = "a grid that does not match the pixel rows", "image_grid_thw", dict(
            case["inputs"], image_grid_thw=torch.tensor([[1, 6, 4], [1, 4, 8]]))
    elif run.name == "gemma4":
        positions = case["inputs"]["image_position_ids"].clone()
        positions[0, 0, 0] = case["model"].config.vision_config.position_embedding_size
        label, key, bad = "a position past the table", "image_position_ids", dict(case["inputs"],
                                                                                  image_position_ids=positions)
    else:
        label, key, bad = "another image size", "pixel_values", {"pixel_values": case["inputs"]["pixel_values"][..., 1:]}
    inp = run.path("bad_in")
    save_file({k: v.contiguous() for k, v in bad.items()}, inp)
    r = subprocess.run([run.args.tool, "--checkpoint", run.ckpt, "--inputs", inp, "--out", run.path("bad")],
                       capture_output=True, text=True)
    checks.check(f"{run.name} {label} is refused", r.returncode == 1 and key in r.stderr,
                 f"exit {r.returncode}: {r.stderr.strip()[:200]}")


def main():
    args = parse_tool_args()
    checks = Checks()
    for name, make in CASES.items():
        try:
            torch.manual_seed(0)
            case = make()
            ckpt = os.path.join(args.workdir, name)
            case["model"].save_pretrained(ckpt)
            run = Run(args, name, ckpt)
            ref = reference(case, case["model"], case["inputs"])
            check_forwards(checks, run, case, ref)
            if name == "gemma3":
                check_hub_layout(checks, run, case, ref)
            if name == "gemma4":
                junk = gemma4_inputs(case["model"].config, 6, junk_padding=True)
                checks.compare(f"{name} junk in padding patches", run.tool(junk, "junk")["features"], ref,
                               atol_for(ref, ATOL_FP32_PER_UNIT))
            check_lora(checks, run, case)
            check_errors(checks, run, case)
        except Exception as e:
            checks.crashed(name, e)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
