#!/usr/bin/env python3
"""Conformance: chat records with images read as lora_finetune reads them (issue 52), against
transformers' processor.

A Qwen3.5-style processor directory (Qwen's BPE with its vision tokens, Qwen3.5-9B's chat template,
Qwen3.5's image rules with small pixel bounds: tests/data/processors/qwen3_5_small_budget) and a data
set in each form the ecosystem ships:
  parts    message content as parts, {"type": "image", "image": PATH} beside text (transformers' chat
           format), one and two images a message, PNG and JPEG of odd sizes;
  llava    a record-level "images": [PATH] with "<image>" in the text (LLaVA / LLaMA-Factory), and TRL's
           {"type": "image"} parts without a source taking the list's entries;
  parquet  a Parquet file whose image column holds {"bytes", "path"} structs, as `datasets` writes it.
For each record, our ids (tools/image_data_tool: data::load_dataset with the model's template and image
processor) equal processor.apply_chat_template(messages, tokenize=True)'s input_ids, and our pixel values
and grids its pixel_values / image_grid_thw, exactly (the processors are compared alone in
conformance.image_processors); the image tokens are masked and the answers trained. Then bad records:
a URL, a missing file, an "images" list that disagrees with the placeholders, a max_seq_len that cuts an
image: each refused, naming the record.

Usage: test_image_data.py --tool PATH/image_data_tool --workdir DIR   (exit 77 without torchvision)
"""
import json
import os
import shutil
import subprocess
import sys

import torch

from _common import Checks, parse_tool_args

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def model_dir(work):
    """The processor directory: tokenizer (+ vision tokens), chat template, image rules."""
    from _gguf_tokenizers import qwen_tokenizer
    from transformers import AutoTokenizer
    d = os.path.join(work, "model")
    qwen_tokenizer(d, ranks=3000)
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(d)
    shutil.copy(os.path.join(DATA, "chat_templates", "Qwen3.5-9B.jinja"), os.path.join(d, "chat_template.jinja"))
    shutil.copy(os.path.join(DATA, "processors", "qwen3_5_small_budget", "preprocessor_config.json"), d)
    return d


def reference_processor(d):
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    image_processor = AutoImageProcessor.from_pretrained(d)
    assert getattr(image_processor, "backend", "torchvision") == "torchvision", image_processor
    with open(os.path.join(d, "chat_template.jinja")) as f:
        template = f.read()
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(d),
                            video_processor=Qwen3VLVideoProcessor(), chat_template=template)


def write_images(work):
    from PIL import Image
    g = torch.Generator().manual_seed(9)
    paths = {}
    for name, (w, h) in {"a.png": (61, 45), "b.jpg": (100, 37), "c.png": (40, 90)}.items():
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        paths[name] = os.path.join(work, "data", name)
        Image.fromarray(pixels).save(paths[name], quality=90) if name.endswith(".jpg") else \
            Image.fromarray(pixels).save(paths[name])
    return paths


def records():
    """(our record, the messages transformers takes) for each form; image paths relative to the data dir."""
    img = lambda p: {"type": "image", "image": p}
    text = lambda t: {"type": "text", "text": t}
    return [
        ({"messages": [{"role": "user", "content": [img("a.png"), text("What is in the picture?")]},
                       {"role": "assistant", "content": "Noise, mostly."}]},
         [{"role": "user", "content": [img("a.png"), text("What is in the picture?")]},
          {"role": "assistant", "content": "Noise, mostly."}]),
        ({"messages": [{"role": "system", "content": "You look closely."},
                       {"role": "user", "content": [text("Compare "), img("b.jpg"), text(" and "), img("c.png")]},
                       {"role": "assistant", "content": "The first is wider."},
                       {"role": "user", "content": "And the colours?"},
                       {"role": "assistant", "content": "Random."}]},
         [{"role": "system", "content": "You look closely."},
          {"role": "user", "content": [text("Compare "), img("b.jpg"), text(" and "), img("c.png")]},
          {"role": "assistant", "content": "The first is wider."},
          {"role": "user", "content": "And the colours?"},
          {"role": "assistant", "content": "Random."}]),
        ({"images": ["c.png"], "messages": [{"role": "user", "content": "<image>\nDescribe it."},
                                            {"role": "assistant", "content": "Tall."}]},
         [{"role": "user", "content": [img("c.png"), text("\nDescribe it.")]},
          {"role": "assistant", "content": "Tall."}]),
        ({"images": ["a.png"], "messages": [{"role": "user", "content": [{"type": "image"}, text("Size?")]},
                                            {"role": "assistant", "content": "Small."}]},
         [{"role": "user", "content": [img("a.png"), text("Size?")]},
          {"role": "assistant", "content": "Small."}]),
    ]


def run(tool, d, data, out, max_len=None):
    r = subprocess.run([tool, d, data, out] + ([str(max_len)] if max_len else []), capture_output=True, text=True)
    return r


def absolute(messages, data_dir):
    out = json.loads(json.dumps(messages))
    for m in out:
        if isinstance(m["content"], list):
            for p in m["content"]:
                if p.get("type") == "image":
                    p["image"] = os.path.join(data_dir, p["image"])
    return out


def compare(checks, label, ours, pixels, i, ref):
    from safetensors.torch import load_file
    ids = ref["input_ids"][0].tolist()
    checks.check(f"{label}: ids = apply_chat_template's", ours["tokens"] == ids,
                 f"{len(ours['tokens'])} vs {len(ids)} ids")
    n = ours["images"]
    got = torch.cat([pixels[f"s{i}.{k}.pixel_values"] for k in range(n)]) if n else torch.empty(0)
    grids = torch.stack([pixels[f"s{i}.{k}.grid"] for k in range(n)]) if n else torch.empty(0)
    same = got.shape == ref["pixel_values"].shape and torch.equal(got, ref["pixel_values"].float())
    checks.check(f"{label}: pixel values and grids = the processor's", same and torch.equal(grids, ref["image_grid_thw"]),
                 f"{tuple(got.shape)} vs {tuple(ref['pixel_values'].shape)}, grids {grids.tolist()} vs "
                 f"{ref['image_grid_thw'].tolist()}")


def main():
    args = parse_tool_args()
    try:
        import torchvision  # noqa: F401
    except ImportError:
        print("SKIP: torchvision is not installed (transformers' default image backend)")
        return 77
    checks = Checks()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "data"))
    d = model_dir(work)
    proc = reference_processor(d)
    paths = write_images(work)
    data_dir = os.path.join(work, "data")
    recs = records()
    jsonl = os.path.join(data_dir, "train.jsonl")
    with open(jsonl, "w") as f:
        for ours, _ in recs:
            f.write(json.dumps(ours) + "\n")
    r = run(args.tool, d, jsonl, os.path.join(work, "out"))
    if checks.check("jsonl: read", r.returncode == 0, r.stderr.strip()[-400:]):
        from safetensors.torch import load_file
        samples = json.load(open(os.path.join(work, "out", "samples.json")))
        pixels = load_file(os.path.join(work, "out", "images.safetensors"))
        image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        for i, (_, messages) in enumerate(recs):
            ref = proc.apply_chat_template(absolute(messages, data_dir), tokenize=True, return_dict=True,
                                           return_tensors="pt")
            compare(checks, f"record {i}", samples[i], pixels, i, ref)
            s = samples[i]
            masked = all(l == -100 for t, l in zip(s["tokens"], s["labels"]) if t == image_id)
            checks.check(f"record {i}: image tokens masked, the answers trained",
                         masked and any(l != -100 for l in s["labels"]), "")
    check_parquet(checks, args.tool, d, proc, work, paths)
    check_refusals(checks, args.tool, d, work)
    return checks.summary()


def check_parquet(checks, tool, d, proc, work, paths):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from safetensors.torch import load_file
    with open(paths["b.jpg"], "rb") as f:
        jpg = f.read()
    messages = [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Many."}]
    table = pa.table({"messages": [messages],
                      "images": pa.array([[{"bytes": jpg, "path": "b.jpg"}]],
                                         pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))})
    pdir = os.path.join(work, "parquet")
    os.makedirs(pdir)
    pq.write_table(table, os.path.join(pdir, "train.parquet"))
    r = run(tool, d, os.path.join(pdir, "train.parquet"), os.path.join(work, "out_parquet"))
    if not checks.check("parquet {bytes, path}: read", r.returncode == 0, r.stderr.strip()[-400:]):
        return
    samples = json.load(open(os.path.join(work, "out_parquet", "samples.json")))
    pixels = load_file(os.path.join(work, "out_parquet", "images.safetensors"))
    ref = proc.apply_chat_template([{"role": "user", "content": [{"type": "image", "image": Image.open(paths["b.jpg"])},
                                                                 {"type": "text", "text": "What colour?"}]},
                                    messages[1]], tokenize=True, return_dict=True, return_tensors="pt")
    compare(checks, "parquet record", samples[0], pixels, 0, ref)


def check_refusals(checks, tool, d, work):
    cases = [
        ("a URL", {"messages": [{"role": "user", "content": [{"type": "image", "image": "https://example.com/x.png"}]},
                                {"role": "assistant", "content": "x"}]}, ["URL", "messages[0].content[0]"]),
        ("a missing file", {"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]},
                                         {"role": "assistant", "content": "x"}]}, ["nope.png"]),
        ("more images than placeholders", {"images": ["a.png", "c.png"], "messages": [
            {"role": "user", "content": "<image> one"}, {"role": "assistant", "content": "x"}]}, ["images", "2"]),
        ("max_seq_len inside an image", {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]},
                                                      {"role": "assistant", "content": "x"}]}, ["max_seq_len", "image"]),
    ]
    for label, record, words in cases:
        path = os.path.join(work, "data", "bad.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
            f.write(json.dumps(record) + "\n")
        r = run(tool, d, path, os.path.join(work, "out_bad"), 8 if "max_seq_len" in label else None)
        ok = r.returncode == 1 and "line 2" in r.stderr and all(w in r.stderr for w in words)
        checks.check(f"refused: {label}, naming the record", ok, r.stderr.strip()[-300:])


if __name__ == "__main__":
    sys.exit(main())
