#!/usr/bin/env python3
"""The model writer and the peer of bench/bench_vision_step.cpp: one vision training step of
Qwen3_5ForConditionalGeneration as users train it without qlora.

--write DIR: the bench's model, written once by transformers (bf16 safetensors, random weights,
torch.manual_seed(0)) with its preprocessor_config.json (Qwen2VLImageProcessor), one random RGB PNG
of --width x --height and inputs.json (the step's token ids and unshifted labels: <|vision_start|>,
the image's tokens, <|vision_end|>, then --text-tokens random text tokens, the only ones scored),
so that both sides read the same inputs. --shape:
  qwen3.5-9b  Qwen/Qwen3.5-9B's vision_config (transformers 5.23's Qwen3_5VisionConfig defaults: depth 27,
              hidden 1152, intermediate 4304, 16 heads, patch 16, temporal 2, merge 2, 2304 position
              embeddings) with the 9B's out_hidden_size 4096, and ONE language layer of its text shape
              (Qwen3_5TextConfig's defaults, whose docstring model is the 9B: hidden 4096, intermediate
              12288, 16 heads / 4 KV heads of head_dim 256; a gated full-attention layer, layer_types
              ["full_attention"]; the 9B config.json's rope_parameters: theta 1e7, partial rotary 0.25,
              interleaved M-RoPE sections [11, 11, 10]); the vocabulary cut to 32000 (the Hub's is 248320),
              the four vision tokens its last ids.
  tiny        the same classes at toy sizes (the smoke test).
The processor keeps the image's size: patch 16, merge 2, temporal 2, mean / std 0.5, size shortest_edge
65536, longest_edge 16777216 (1024 x 768: 64 x 48 patches, 768 image tokens).

--run DIR (the peer): transformers' model from_pretrained in bf16 (tower and language layer, the
default attention implementation), peft LoRA r / alpha on the language layer's q/k/v/o/gate/up/down_proj
(the tower frozen, as peft leaves it), the PNG through transformers' image processor
(AutoImageProcessor of DIR), the model's own mean cross-entropy over the scored labels, backward into
the adapters; torch threads --threads. Memory: the first step's peak RSS over the RSS before it (VmHWM
reset just before, as the C++ worker does); then one untimed step and the median of --reps timed
steps. The tower's forward (the processor included) timed on its own too. One JSON object, last line.

    vision_peer.py --write DIR [--shape qwen3.5-9b|tiny] [--width 1024 --height 768 --text-tokens 256]
    vision_peer.py --run DIR [--r 8 --alpha 16 --reps 1 --threads 2]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_peer import reset_peak, rss_bytes  # noqa: E402
from peak_rss import peak_rss_bytes  # noqa: E402

VISION_9B = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                 temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304, out_hidden_size=4096)
TEXT_9B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
               head_dim=256, num_hidden_layers=1, layer_types=["full_attention"], vocab_size=32000,
               max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True})
SHAPES = {
    "qwen3.5-9b": (VISION_9B, TEXT_9B),
    "tiny": ({**VISION_9B, "depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
              "num_position_embeddings": 16, "out_hidden_size": 128},
             {**TEXT_9B, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 256, "max_position_embeddings": 4096}),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write(a):
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen3_5Config, Qwen3_5ForConditionalGeneration
    vision, text = SHAPES[a.shape]
    V = text["vocab_size"]
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, image_token_id=V - 4,
                        video_token_id=V - 3, vision_start_token_id=V - 2, vision_end_token_id=V - 1)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16)
    os.makedirs(a.write, exist_ok=True)
    model.save_pretrained(a.write)
    merge, patch = vision["spatial_merge_size"], vision["patch_size"]
    with open(os.path.join(a.write, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "merge_size": merge,
                   "temporal_patch_size": vision["temporal_patch_size"], "image_mean": [0.5] * 3,
                   "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}, f)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (a.height, a.width, 3), generator=g, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(os.path.join(a.write, "image.png"))
    # The image's tokens as transformers' processor makes them (a size outside its bounds is resized).
    grid = AutoImageProcessor.from_pretrained(a.write)(images=[Image.open(os.path.join(a.write, "image.png"))],
                                                       return_tensors="pt")["image_grid_thw"][0]
    image_tokens = int(grid.prod()) // merge ** 2
    text_ids = torch.randint(3, V - 4, (a.text_tokens,), generator=g).tolist()
    ids = [V - 2] + [V - 4] * image_tokens + [V - 1] + text_ids
    labels = [-100] * (image_tokens + 2) + text_ids
    with open(os.path.join(a.write, "inputs.json"), "w") as f:
        json.dump({"shape": a.shape, "width": a.width, "height": a.height, "image_tokens": image_tokens,
                   "text_tokens": a.text_tokens, "vision_config": vision, "text_config": text,
                   "input_ids": ids, "labels": labels}, f)
    print(json.dumps({"written": a.write, "image_tokens": image_tokens}))


def run(a):
    import peft
    import transformers
    from PIL import Image
    from peft import LoraConfig, get_peft_model
    from transformers import AutoImageProcessor, Qwen3_5ForConditionalGeneration
    if a.threads:
        torch.set_num_threads(a.threads)
    with open(os.path.join(a.run, "inputs.json")) as f:
        inputs = json.load(f)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(a.run, dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tower_bytes = sum(p.numel() * p.element_size() for p in model.model.visual.parameters())
    lcfg = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0,
                      target_modules=r".*language_model\.layers\.\d+\..*\.(" + "|".join(TARGETS) + ")")
    model = get_peft_model(model, lcfg)
    model.train()
    lora = [p for p in model.parameters() if p.requires_grad]
    processor = AutoImageProcessor.from_pretrained(a.run)
    path = os.path.join(a.run, "image.png")
    ids = torch.tensor([inputs["input_ids"]])
    labels = torch.tensor([inputs["labels"]])
    # As transformers' processor returns it beside input_ids: 1 at the image's tokens (M-RoPE's positions).
    mm_types = (ids == model.config.image_token_id).int()

    def pixels():
        px = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        return px["pixel_values"].to(torch.bfloat16), px["image_grid_thw"]

    def step():
        t0 = time.perf_counter()
        pv, grid = pixels()
        loss = model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm_types,
                     labels=labels).loss
        loss.backward()
        for p in lora:
            p.grad = None
        return time.perf_counter() - t0, loss.item()

    def tower():
        t0 = time.perf_counter()
        with torch.no_grad():
            pv, grid = pixels()
            model.base_model.model.model.get_image_features(pv, grid)
        return time.perf_counter() - t0

    rss0 = rss_bytes()
    hwm_reset = reset_peak()
    first, loss = step()
    peak, peak_total = peak_rss_bytes() - rss0, peak_rss_bytes()
    step()
    times = [step()[0] for _ in range(a.reps)]
    tower()
    tower_times = [tower() for _ in range(a.reps)]
    print(json.dumps({
        "impl": "transformers Qwen3_5ForConditionalGeneration bf16 (tower and language layer, attn "
                + str(model.config._attn_implementation) + ") + peft LoRA on the language layer's "
                + "/".join(TARGETS),
        "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "loss": loss, "first_step_s": first, "fwd_bwd_s": statistics.median(times), "times_s": times,
        "tower_fwd_s": statistics.median(tower_times), "peak_rss_delta_bytes": peak, "peak_rss_bytes": peak_total,
        "rss_before_step_bytes": rss0, "hwm_reset": hwm_reset, "weights_bytes": weights,
        "tower_weights_bytes": tower_bytes, "lora_bytes": sum(p.numel() * p.element_size() for p in lora),
        "trainable_params": sum(p.numel() for p in lora),
    }))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write")
    ap.add_argument("--run")
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(SHAPES))
    for name, default in (("width", 1024), ("height", 768), ("text-tokens", 256), ("r", 8), ("reps", 1),
                          ("threads", 0)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--alpha", type=float, default=16.0)
    a = ap.parse_args()
    if bool(a.write) == bool(a.run):
        ap.error("give one of --write DIR and --run DIR")
    write(a) if a.write else run(a)


if __name__ == "__main__":
    main()
