#!/usr/bin/env python3
"""Conformance: a vision-language model's language side with images (issue 52), against transformers.

The image features are given (random, of the tower's output width), so this checks what the language
model does with them, apart from the tower: placed at the image tokens (masked_scatter) and, for
Qwen3.5, the image tokens' 3-D M-RoPE positions (get_rope_index: temporal, height, width over the
merged grid, the text after an image continuing at its start + max(h, w) / merge). transformers takes
the features through `mm_encoder_outputs` (its forward's precomputed-encoder input) with the grids
and mm_token_type_ids, as its processor would give them.
  qwen3_5_vision  a batch of 2 rows, each with two images of other grids (2x4 and 6x2 merged
                  patches, 8 and 12 image tokens) between text; fp32 logits. An ablation (the same
                  features with 1-D positions) moves transformers' logits by far more than the
                  tolerance, so the check sees the 3-D positions. Then the same two samples packed
                  in one row (positions restart) equal transformers run on each alone.

  gemma3          Gemma3ForConditionalGeneration (token_type_ids): each image's tokens see each other on
                  every layer, the text causal; an image run (10 tokens) longer than the sliding
                  window (4), so the window still hides keys too far back while the image's later
                  tokens stay visible; 1-D positions. Ablation: causal image tokens.
  gemma4          Gemma4ForConditionalGeneration with use_bidirectional_attention "vision"
                  (mm_token_type_ids): the same on its sliding layers only; image tokens embedded as
                  its pad token for the per-layer inputs. Ablation: causal image tokens.

Then end to end, per family (*_tower): image files (odd sizes) through our image processor (the tiny
model's own preprocessor_config.json, sized to its tiny tower) and tower (models/vision) into the
language model (llama_logits --image-files), against transformers' processor + the whole
ConditionalGeneration forward on pixel_values: fp32 logits.

Usage: test_vision_language.py --tool PATH/llama_logits --workdir DIR
Prints one line per check and "N passed, M failed"; exit status 1 on any failure.
"""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_outputs import BaseModelOutputWithPooling

import _families as F
from _common import Checks, parse_tool_args
from test_vision_towers import randomize_tower

IMAGE_TOKEN = 100  # within the tiny vocabulary (the Hub's 248056 is not)
GREEDY = 12
# fp32: the order of operations differs (our attention and DeltaNet kernels vs torch, packed rows vs
# alone). The differences follow the hidden states' scale, not the logits': ~2e-4 absolute on every
# family on a 2-core Xeon (AVX-512), while Gemma 4's soft cap holds its logits under 3. So 1e-4 of the
# largest logit, and never less than 1e-3: the ablations below move the logits by 0.1 and more.
ATOL_PER_UNIT = 1e-4
ATOL_FLOOR_UNITS = 10.0


def qwen35_rows(merge):
    """Two rows of text with two images each, and the images' grids (t, h, w patches) in token order."""
    grids = [(1, 2 * merge, 4 * merge), (1, 6 * merge, 2 * merge), (1, 4 * merge, 4 * merge), (1, 2 * merge, 2 * merge)]
    n = [t * h * w // merge ** 2 for t, h, w in grids]
    g = torch.Generator().manual_seed(5)
    text = lambda k: torch.randint(3, 90, (k,), generator=g).tolist()
    rows = [text(3) + [IMAGE_TOKEN] * n[0] + text(4) + [IMAGE_TOKEN] * n[1] + text(5),
            text(6) + [IMAGE_TOKEN] * n[2] + text(2) + [IMAGE_TOKEN] * n[3] + text(8)]
    width = max(len(r) for r in rows)
    rows = [r + text(width - len(r)) for r in rows]  # equal lengths: no padding in either model
    return torch.tensor(rows), grids


def run_tool(tool, ckpt, tokens, images, out, packed=None):
    cmd = [tool, "--checkpoint", ckpt, "--tokens", ";".join(",".join(map(str, r)) for r in tokens.tolist()),
           "--images", images, "--out", out] + (["--packed", ",".join(map(str, packed))] if packed else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip()[-500:])
    return load_file(out)["logits"]


def theirs(model, tokens, features, grids, mm=True):
    mask = tokens == IMAGE_TOKEN
    splits = [t * h * w // model.config.vision_config.spatial_merge_size ** 2 for t, h, w in grids]
    enc = BaseModelOutputWithPooling(pooler_output=torch.split(features, splits))
    kw = dict(image_grid_thw=torch.tensor(grids), mm_token_type_ids=mask.int()) if mm else \
        dict(position_ids=torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1))
    with torch.no_grad():
        return model(input_ids=tokens, mm_encoder_outputs={"image": enc}, **kw).logits


def check_qwen35(checks, args):
    name = "qwen3_5_vision"
    model = F.build(name, seed=52)
    model.config.image_token_id = IMAGE_TOKEN
    ckpt = os.path.join(args.workdir, name)
    model.save_pretrained(ckpt)
    merge = model.config.vision_config.spatial_merge_size
    tokens, grids = qwen35_rows(merge)
    features = torch.randn(int((tokens == IMAGE_TOKEN).sum()), model.config.text_config.hidden_size,
                           generator=torch.Generator().manual_seed(6))
    images = os.path.join(args.workdir, f"{name}_images.safetensors")
    save_file({"features": features, "mask": (tokens == IMAGE_TOKEN).to(torch.uint8),
               "grids": torch.tensor(grids), "spatial_merge": torch.tensor([merge])}, images)
    ref = theirs(model, tokens, features, grids)
    atol = ATOL_PER_UNIT * max(ATOL_FLOOR_UNITS, ref.abs().max().item())
    flat = theirs(model, tokens, features, grids, mm=False)
    moved = (flat - ref).abs().max().item()
    checks.check(f"{name}: 1-D positions for the image tokens move transformers' logits", moved > 100 * atol,
                 f"max|diff| {moved:.3e} (> {100 * atol:.3e})")
    ours = run_tool(args.tool, ckpt, tokens, images, os.path.join(args.workdir, f"{name}_logits.safetensors"))
    checks.compare(f"{name}: logits with two images a row (M-RoPE, features at the image tokens)", ours, ref, atol)
    # The two rows as two samples packed in one row: positions restart at the second.
    one = tokens.reshape(1, -1)
    save_file({"features": features, "mask": (one == IMAGE_TOKEN).to(torch.uint8), "grids": torch.tensor(grids),
               "spatial_merge": torch.tensor([merge])}, images)
    packed = run_tool(args.tool, ckpt, one, images, os.path.join(args.workdir, f"{name}_packed.safetensors"),
                      packed=[tokens.shape[1]] * 2)
    checks.compare(f"{name}: the two rows packed in one (positions restart) = each alone", packed.reshape(ref.shape),
                   ref, atol)


def gemma_rows(merge_free_runs, image_token, seed):
    """Two rows of text with image runs of the given lengths (two a row), equal length."""
    g = torch.Generator().manual_seed(seed)
    text = lambda k: torch.randint(3, 90, (k,), generator=g).tolist()
    a, b, c, d = merge_free_runs
    rows = [text(2) + [image_token] * a + text(3) + [image_token] * b + text(4),
            text(5) + [image_token] * c + text(2) + [image_token] * d + text(3)]
    width = max(len(r) for r in rows)
    return torch.tensor([r + text(width - len(r)) for r in rows])


def check_gemma(checks, args, name, model, type_key):
    """Features at the image tokens and an image's tokens seeing each other (the layers the family says)."""
    model.config.image_token_id = IMAGE_TOKEN
    ckpt = os.path.join(args.workdir, name)
    model.save_pretrained(ckpt)
    tokens = gemma_rows((10, 3, 4, 10), IMAGE_TOKEN, seed=7)
    mask = tokens == IMAGE_TOKEN
    hidden = model.config.text_config.hidden_size
    features = torch.randn(int(mask.sum()), hidden, generator=torch.Generator().manual_seed(8))
    images = os.path.join(args.workdir, f"{name}_images.safetensors")
    save_file({"features": features, "mask": mask.to(torch.uint8)}, images)
    # Gemma 4 concatenates a tuple of per-image features, Gemma 3 takes one tensor.
    enc = BaseModelOutputWithPooling(pooler_output=(features,) if type_key == "mm_token_type_ids" else features)
    with torch.no_grad():
        ref = model(input_ids=tokens, mm_encoder_outputs={"image": enc}, **{type_key: mask.long()}).logits
        causal = model(input_ids=tokens, mm_encoder_outputs={"image": enc}).logits
    atol = ATOL_PER_UNIT * max(ATOL_FLOOR_UNITS, ref.abs().max().item())
    moved = (causal - ref).abs().max().item()
    checks.check(f"{name}: an image's tokens seeing each other move transformers' logits", moved > 100 * atol,
                 f"max|diff| {moved:.3e} (> {100 * atol:.3e})")
    ours = run_tool(args.tool, ckpt, tokens, images, os.path.join(args.workdir, f"{name}_logits.safetensors"))
    checks.compare(f"{name}: logits with two images a row (features at the image tokens, bidirectional within each)",
                   ours, ref, atol)
    one = tokens.reshape(1, -1)
    save_file({"features": features, "mask": (one == IMAGE_TOKEN).to(torch.uint8)}, images)
    packed = run_tool(args.tool, ckpt, one, images, os.path.join(args.workdir, f"{name}_packed.safetensors"),
                      packed=[tokens.shape[1]] * 2)
    checks.compare(f"{name}: the two rows packed in one = each alone", packed.reshape(ref.shape), ref, atol)


def gemma3_model(seed, **text):
    """A tiny Gemma3ForConditionalGeneration (_families' tower), a sliding and a full layer."""
    from transformers import Gemma3ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = F.gemma3_multimodal_config(**{**F.COMMON, **F.GEMMA, "layer_types": ["sliding_attention", "full_attention"],
                                        "rope_parameters": F.GEMMA3_ROPE, **text})
    cfg.text_config._attn_implementation = "eager"
    model = Gemma3ForConditionalGeneration(cfg).float().eval()
    F.randomize_norms(model, seed)
    return model


def check_gemma3(checks, args):
    check_gemma(checks, args, "gemma3", gemma3_model(53, sliding_window=4), "token_type_ids")


def check_gemma4(checks, args):
    model = F.build("gemma4_vision", seed=54, use_bidirectional_attention="vision", sliding_window=4)
    check_gemma(checks, args, "gemma4", model, "mm_token_type_ids")


def write_images(work, sizes, seed):
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    paths = []
    for k, (w, h) in enumerate(sizes):
        paths.append(os.path.join(work, f"img{seed}_{k}.png"))
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()).save(paths[-1])
    return paths


def end_to_end(checks, args, name, model, processor_cfg, sizes, token_kw):
    """Our processor + tower + language model on image files = transformers' processor + model forward."""
    from PIL import Image
    from transformers import AutoImageProcessor
    model.config.image_token_id = IMAGE_TOKEN
    ckpt = os.path.join(args.workdir, name + "_tower")
    model.save_pretrained(ckpt)
    with open(os.path.join(ckpt, "preprocessor_config.json"), "w") as f:
        json.dump(processor_cfg, f)
    proc = AutoImageProcessor.from_pretrained(ckpt)
    files = write_images(args.workdir, sizes, seed=len(name))
    px = proc([Image.open(f).convert("RGB") for f in files], return_tensors="pt")
    counts = token_kw["counts"](px)
    g = torch.Generator().manual_seed(11)
    row = torch.randint(3, 90, (3,), generator=g).tolist()
    for n in counts:
        row += [IMAGE_TOKEN] * n + torch.randint(3, 90, (2,), generator=g).tolist()
    tokens = torch.tensor([row])
    kw = {k: v for k, v in px.items() if k in ("pixel_values", "image_grid_thw", "image_position_ids")}
    kw[token_kw["types"]] = (tokens == IMAGE_TOKEN).long()
    with torch.no_grad():
        ref = model(input_ids=tokens, **kw).logits
    out = os.path.join(args.workdir, f"{name}_tower_logits.safetensors")
    r = subprocess.run([args.tool, "--checkpoint", ckpt, "--tokens", ",".join(map(str, row)), "--image-files",
                        ",".join(files), "--out", out], capture_output=True, text=True)
    if not checks.check(f"{name} end to end: ran", r.returncode == 0, r.stderr.strip()[-400:]):
        return
    atol = ATOL_PER_UNIT * max(ATOL_FLOOR_UNITS, ref.abs().max().item())
    checks.compare(f"{name} end to end: image files through our processor and tower, logits = transformers' "
                   f"({len(files)} images, {sum(counts)} image tokens)", load_file(out)["logits"], ref, atol)
    # Greedy text after the images (KV cache; Qwen3.5's positions continue after the images' largest).
    with torch.no_grad():
        want = model.generate(input_ids=tokens, **kw, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, tokens.shape[1]:].tolist()
    r = subprocess.run([args.tool, "--checkpoint", ckpt, "--tokens", ",".join(map(str, row)), "--image-files",
                        ",".join(files), "--generate", str(GREEDY), "--out", out], capture_output=True, text=True)
    got = load_file(out)["ids"][0].tolist() if r.returncode == 0 else r.stderr.strip()[-300:]
    checks.check(f"{name} end to end: greedy text after the images = transformers' generate", got == want,
                 f"{got} vs {want}")


def gemma3_processor(model):
    """preprocessor_config.json sized to the tiny Gemma 3 tower."""
    s = model.config.vision_config.image_size
    return {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": s, "width": s}, "resample": 2,
            "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pan_and_scan": None,
            "image_seq_length": F.GEMMA3_MM_TOKENS}


def gemma4_processor(model):
    """preprocessor_config.json sized to the tiny Gemma 4 tower."""
    v4 = model.config.vision_config
    return {"image_processor_type": "Gemma4ImageProcessor", "patch_size": v4.patch_size,
            "pooling_kernel_size": v4.pooling_kernel_size, "max_soft_tokens": 70, "resample": 3, "do_normalize": False,
            "image_mean": [0.0] * 3, "image_std": [1.0] * 3}


def check_towers(checks, args):
    qwen = F.build("qwen3_5_vision", seed=61)
    v = qwen.config.vision_config
    end_to_end(checks, args, "qwen3_5", qwen, {
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": v.patch_size, "merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"shortest_edge": 16 * 16, "longest_edge": 40 * 40}}, [(37, 21), (19, 45)],
        {"types": "mm_token_type_ids",
         "counts": lambda px: (px["image_grid_thw"].prod(-1) // v.spatial_merge_size ** 2).tolist()})
    gemma3 = gemma3_model(62)
    # transformers draws the projection matrix as zeros: features 0, the tower unseen by the logits.
    randomize_tower(gemma3, ("model.multi_modal_projector.",), 62)
    end_to_end(checks, args, "gemma3", gemma3, gemma3_processor(gemma3), [(50, 23), (17, 40)], {"types": "token_type_ids", "counts": lambda px: [F.GEMMA3_MM_TOKENS] * len(px["pixel_values"])})
    gemma4 = F.build("gemma4_vision", seed=63, use_bidirectional_attention="vision", sliding_window=4,
                     max_position_embeddings=256)
    v4 = gemma4.config.vision_config
    end_to_end(checks, args, "gemma4", gemma4, gemma4_processor(gemma4), [(30, 22), (13, 41)],
        {"types": "mm_token_type_ids",
         "counts": lambda px: [int((p[:, 0] >= 0).sum()) // v4.pooling_kernel_size ** 2 for p in px["image_position_ids"]]})


def main():
    args = parse_tool_args()
    torch.manual_seed(0)
    checks = Checks()
    for case in (check_qwen35, check_gemma3, check_gemma4, check_towers):
        try:
            case(checks, args)
        except Exception as e:  # noqa: BLE001 - one case's crash is that case's failure
            checks.crashed(case.__name__, e)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
