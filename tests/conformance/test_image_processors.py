"""Images decoded and processed by src/qlora/images against PIL and transformers 5.23's image processors.

Writes image files of odd sizes with PIL (JPEG: RGB, 4:4:4 progressive, grayscale, CMYK, every EXIF
orientation, and the orientation of a PNG's eXIf or raw-profile text, a WebP's EXIF, XMP packets; PNG: RGBA,
grayscale, 1-bit, palette with transparency, 16-bit gray / RGB / gray+alpha; WebP lossy and lossless with
alpha; one JPEG larger than 896 so the downscales antialias; a 3 x 900 sliver), runs tests/tools/image_tool
on all of them in one process, and checks:
  - the decoded RGB equals transformers.image_utils.load_image's (PIL: exif_transpose, convert("RGB"));
  - for Qwen3.5 (Qwen2VLImageProcessor; also with small pixel bounds, for smart_resize's downscale),
    Gemma 3 (Gemma3ImageProcessor) and Gemma 4 (Gemma4ImageProcessor), built by AutoImageProcessor from
    tests/data/processors/<family> (the checkpoints' configs) with the torchvision backend, fed
    load_image's picture with the processor's own call defaults: pixel_values, image_grid_thw /
    image_position_ids, the token count and the text that replaces the image placeholder (the
    processors' replace_image_token).
Tolerance: none. Every pixel value is compared for equality: we call the ATen resize op torchvision calls
on the same dtype (uint8 for bicubic always, and for bilinear where the CPU has AVX2/AVX512; float32 and
rounded back otherwise) and the same float32 rescale / normalise ops, so the numbers are the same bits;
max|diff| is printed beside each check (0 under ATEN_CPU_CAPABILITY=default, avx2 and avx512 alike:
each path torchvision can take on a CPU).
Errors: a truncated JPEG, a wrong-magic file and an aspect ratio Qwen's processor refuses fail on both sides.
"""
import io
import json
import os
import struct
import sys
import zlib
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

try:
    import torchvision  # noqa: F401 - transformers' torchvision backend, the reference here
except ImportError:
    print("SKIP: torchvision is not installed (requirements-test.txt pins it)")
    raise SystemExit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Checks, parse_tool_args  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoImageProcessor  # noqa: E402
from transformers.image_utils import load_image  # noqa: E402
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor  # noqa: E402
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor  # noqa: E402
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402
from safetensors import safe_open  # noqa: E402

PROCESSORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "processors")
FAMILIES = {"qwen3_5": "Qwen2VLImageProcessor", "qwen3_5_small_budget": "Qwen2VLImageProcessor",
            "gemma3": "Gemma3ImageProcessor", "gemma4": "Gemma4ImageProcessor"}
# The processors' own defaults for their image processor's call (Gemma3Processor: do_convert_rgb true where
# the file has null, pan-and-scan off), as processor(images=..., text=...) passes them.
CALL_KWARGS = {"qwen3_5": getattr(Qwen3VLProcessor, "images_kwargs", {}), "gemma3": Gemma3Processor.images_kwargs,
               "gemma4": getattr(Gemma4Processor, "images_kwargs", {})}
CALL_KWARGS["qwen3_5_small_budget"] = CALL_KWARGS["qwen3_5"]


def picture(w, h, seed):
    """Smooth gradients plus noise: edges and texture for the resampling kernels."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255.0 / max(w - 1, 1), y * 255.0 / max(h - 1, 1), (x + y) * 127.0 / max(w + h - 2, 1)], -1)
    return np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)


def raw_png(w, h, color_type, samples):
    """A 16-bit PNG written by hand (PIL writes no 16-bit RGB / gray+alpha): big-endian samples."""
    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
    rows = b"".join(b"\x00" + samples[r].astype(">u2").tobytes() for r in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def save(im, path, fmt, **kw):
    im.save(path, fmt, **kw)
    return path


XMP = ('<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
       '<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="{}"/></rdf:RDF></x:xmpmeta>')


def add_orientation_metadata(d, add):
    """The other places PIL's exif_transpose takes the orientation from."""
    from PIL.PngImagePlugin import PngInfo
    im = Image.fromarray(picture(37, 19, 16))
    exif = Image.Exif()
    exif[0x0112] = 8
    add("orientation_png_exif", save(im, f"{d}/o_exif.png", "PNG", exif=exif.tobytes()))
    add("orientation_webp_exif", save(im, f"{d}/o_exif.webp", "WEBP", lossless=True, exif=exif.tobytes()))
    add("orientation_jpeg_xmp", save(im, f"{d}/o_xmp.jpg", "JPEG", xmp=XMP.format(6).encode()))
    no_tag = Image.Exif()
    no_tag[0x010F] = "camera"  # Make: an Exif without orientation, so PIL falls back to the XMP
    add("orientation_jpeg_exif_without_tag_xmp", save(im, f"{d}/o_xmp2.jpg", "JPEG", exif=no_tag.tobytes(),
                                                      xmp=XMP.format(3).encode()))
    exif5 = Image.Exif()
    exif5[0x0112] = 5
    add("orientation_jpeg_exif_beats_xmp", save(im, f"{d}/o_both.jpg", "JPEG", exif=exif5.tobytes(),
                                                xmp=XMP.format(6).encode()))
    info = PngInfo()
    info.add_itxt("XML:com.adobe.xmp", XMP.format(7))
    add("orientation_png_xmp", save(im, f"{d}/o_xmp.png", "PNG", pnginfo=info))
    raw = exif.tobytes()
    info = PngInfo()
    info.add_text("Raw profile type exif", f"\nexif\n{len(raw):8}\n{raw.hex()}\n", zip=True)
    add("orientation_png_raw_profile", save(im, f"{d}/o_raw.png", "PNG", pnginfo=info))
    add("orientation_webp_xmp", save(im, f"{d}/o_xmp.webp", "WEBP", lossless=True, xmp=XMP.format(2).encode()))


def write_images(d):
    """(name, path) of every case; the files are small (largest: the 1200 x 900 JPEG)."""
    cases = []
    add = lambda name, path: cases.append((name, path))  # noqa: E731
    rgb = Image.fromarray(picture(173, 97, 1))
    add("jpeg_rgb", save(rgb, f"{d}/rgb.jpg", "JPEG", quality=90))
    add("jpeg_444_progressive", save(Image.fromarray(picture(67, 41, 2)), f"{d}/p.jpg", "JPEG", quality=95,
                                     subsampling=0, progressive=True))
    add("jpeg_gray", save(Image.fromarray(picture(50, 77, 3)[:, :, 0]), f"{d}/gray.jpg", "JPEG"))
    add("jpeg_cmyk", save(Image.fromarray(picture(40, 33, 4)).convert("CMYK"), f"{d}/cmyk.jpg", "JPEG"))
    for o in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = o
        add(f"jpeg_exif_orientation_{o}", save(Image.fromarray(picture(61, 143, 5)), f"{d}/o{o}.jpg", "JPEG",
                                               exif=exif.tobytes()))
    add_orientation_metadata(d, add)
    add("jpeg_large", save(Image.fromarray(picture(1200, 900, 6)), f"{d}/large.jpg", "JPEG", quality=85))
    rgba = np.concatenate([picture(123, 45, 7), picture(123, 45, 8)[:, :, :1]], -1)
    add("png_rgba", save(Image.fromarray(rgba, "RGBA"), f"{d}/rgba.png", "PNG"))
    add("png_gray", save(Image.fromarray(picture(31, 200, 9)[:, :, 1]), f"{d}/gray.png", "PNG"))
    add("png_1bit", save(Image.fromarray(picture(45, 38, 10)[:, :, 0] > 128), f"{d}/bit.png", "PNG"))
    pal = Image.fromarray(picture(90, 60, 11)).quantize(colors=37)
    add("png_palette_trns", save(pal, f"{d}/pal.png", "PNG", transparency=5))
    add("png_la", save(Image.fromarray(rgba[:, :, 1::2], "LA"), f"{d}/la.png", "PNG"))
    gray16 = np.random.default_rng(12).integers(0, 65536, (29, 47)).astype(np.uint16)
    gray16[0, :4] = [0, 200, 255, 256]
    add("png_gray16", save(Image.fromarray(gray16), f"{d}/gray16.png", "PNG"))
    rgb16 = np.random.default_rng(13).integers(0, 65536, (21, 33 * 3)).astype(np.uint16)
    add("png_rgb16", f"{d}/rgb16.png")
    open(f"{d}/rgb16.png", "wb").write(raw_png(33, 21, 2, rgb16))
    add("png_la16", f"{d}/la16.png")
    open(f"{d}/la16.png", "wb").write(raw_png(33, 21, 4, rgb16[:, :66]))
    add("png_sliver_3x900", save(Image.fromarray(picture(3, 900, 14)), f"{d}/sliver.png", "PNG"))
    add("webp_lossy", save(Image.fromarray(picture(150, 100, 15)), f"{d}/lossy.webp", "WEBP", quality=80))
    add("webp_lossless_rgba", save(Image.fromarray(rgba, "RGBA"), f"{d}/lossless.webp", "WEBP", lossless=True))
    add("webp_lossy_rgba", save(Image.fromarray(rgba, "RGBA"), f"{d}/lossy_rgba.webp", "WEBP", quality=70))
    return cases


def write_bad_images(d, good_jpeg):
    data = open(good_jpeg, "rb").read()
    open(f"{d}/truncated.jpg", "wb").write(data[: len(data) // 2])
    open(f"{d}/wrong_magic.png", "wb").write(b"GIF89a" + data[6:200])
    return [("truncated_jpeg", f"{d}/truncated.jpg"), ("wrong_magic", f"{d}/wrong_magic.png")]


def load_ours(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def tokens(family):
    path = os.path.join(PROCESSORS, family, "tokenizer_config.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def reference_expansion(family, proc, out):
    """The processors' own replace_image_token, on a stand-in holding the tokenizer's token strings."""
    t = tokens(family)
    if family.startswith("qwen3_5"):
        ns = SimpleNamespace(image_token="<|image_pad|>", image_processor=proc)
        return ns.image_token, Qwen3VLProcessor.replace_image_token(ns, out, 0)
    if family == "gemma4":
        ns = SimpleNamespace(boi_token=t["boi_token"], eoi_token=t["eoi_token"], image_token=t["image_token"])
        return ns.image_token, Gemma4Processor.replace_image_token(ns, out, 0)
    tok = SimpleNamespace(boi_token=t["boi_token"], eoi_token=t["eoi_token"], image_token=t["image_token"],
                          boi_token_id=1)
    p = Gemma3Processor.__new__(Gemma3Processor)
    try:  # __init__ sets full_image_sequence before ProcessorMixin's checks, which a stand-in fails
        Gemma3Processor.__init__(p, image_processor=proc, tokenizer=tok, image_seq_length=256)
    except Exception:  # noqa: BLE001
        pass
    return p.image_token, Gemma3Processor.replace_image_token(p, out, 0)


def check_processed(checks, name, family, proc, out, ours, meta):
    label = f"{name}.{family}"
    if family.startswith("qwen3_5"):
        ref_pv, ref_grid = out["pixel_values"], out["image_grid_thw"][0]
        ref_tokens = int(ref_grid.prod()) // proc.merge_size ** 2
    elif family == "gemma3":
        ref_pv, ref_grid, ref_tokens = out["pixel_values"][0], None, 256
    else:
        ref_pv, ref_grid = out["pixel_values"][0], out["image_position_ids"][0]
        ref_tokens = int(out["num_soft_tokens_per_image"][0])
    pv = ours["pixel_values"]
    checks.check(f"{label} pixel_values equal", pv.dtype == ref_pv.dtype and pv.shape == ref_pv.shape
                 and torch.equal(pv, ref_pv),
                 f"shape {tuple(pv.shape)} (ref {tuple(ref_pv.shape)}) max|diff| "
                 f"{(pv - ref_pv).abs().max().item() if pv.shape == ref_pv.shape else float('inf'):.3e}")
    if ref_grid is not None:
        checks.check(f"{label} grid", torch.equal(ours["grid"], ref_grid), f"{ours['grid'].flatten()[:6].tolist()}...")
    checks.check(f"{label} tokens", int(ours["num_image_tokens"]) == ref_tokens,
                 f"{int(ours['num_image_tokens'])} (ref {ref_tokens})")
    placeholder, expansion = reference_expansion(family, proc, out)
    checks.check(f"{label} text", meta.get("placeholder") == placeholder and meta.get("expansion") == expansion,
                 f"placeholder {meta.get('placeholder')!r} (ref {placeholder!r}), expansion of "
                 f"{len(meta.get('expansion', ''))} chars (ref {len(expansion)})")


def check_image(checks, args, i, name, path, procs):
    stem = os.path.join(args.workdir, str(i))
    try:
        pil = load_image(path)
    except Exception as e:  # noqa: BLE001
        err = open(stem + ".error.txt").read() if os.path.exists(stem + ".error.txt") else ""
        checks.check(f"{name} refused", err and path in err and f"test record {i}" in err,
                     f"PIL: {type(e).__name__}; ours: {err!r}")
        return
    ours, _ = load_ours(stem + ".decode.safetensors")
    ref = torch.from_numpy(np.array(pil))
    checks.check(f"{name} decode equal", ours["rgb"].shape == ref.shape and torch.equal(ours["rgb"], ref),
                 f"{tuple(ours['rgb'].shape)} (ref {tuple(ref.shape)})")
    # The orientations differ only in the decode; one of them transposed is enough for the processors.
    for family, proc in (procs.items() if "orientation" not in name or name[-2:] in ("_1", "_6") else []):
        try:
            out = proc(images=[pil], return_tensors="pt", **CALL_KWARGS[family])
        except ValueError as e:
            err_path = f"{stem}.{family}.error.txt"
            err = open(err_path).read() if os.path.exists(err_path) else ""
            checks.check(f"{name}.{family} refused", bool(err), f"transformers: {e}; ours: {err!r}")
            continue
        try:
            check_processed(checks, name, family, proc, out, *load_ours(f"{stem}.{family}.safetensors"))
        except Exception as e:  # noqa: BLE001 - one case's crash is that case's failure
            checks.crashed(f"{name}.{family}", e)


def main():
    args = parse_tool_args()
    import subprocess
    d = os.path.join(args.workdir, "images")
    os.makedirs(d, exist_ok=True)
    cases = write_images(d)
    cases += write_bad_images(d, cases[0][1])
    procs = {}
    checks = Checks()
    for family, cls in FAMILIES.items():
        proc = AutoImageProcessor.from_pretrained(os.path.join(PROCESSORS, family))
        checks.check(f"{family} processor class", type(proc).__name__ == cls and proc.backend == "torchvision",
                     f"{type(proc).__name__}, {proc.backend} backend (transformers {transformers.__version__})")
        procs[family] = proc
    cmd = [args.tool, args.workdir]
    for family in FAMILIES:
        cmd += ["--processor", f"{family}={os.path.join(PROCESSORS, family)}"]
    subprocess.run(cmd + [p for _, p in cases], check=True)
    for i, (name, path) in enumerate(cases):
        check_image(checks, args, i, name, path, procs)
    return checks.summary()


if __name__ == "__main__":
    raise SystemExit(main())
