"""A vision-language model learns a visual task through `qlora run lora_finetune` (issue 52's learning test).

The tiny random Qwen3.5 VLM of test_vision_recipe.py (its language model and tower in NF4, LoRA on both, the
merger trained) is asked "What colour is the square?" about images of a square in one of four colours at a
random place on noise, and answers "It is <colour>." Every record's text is the same, so the text alone
cannot beat the most frequent colour; only the image tells the answer. After training, the merged export
answers held-out images it never saw, greedily, in transformers (Qwen3_5ForConditionalGeneration and its own
processor, not qlora): the accuracy must be at least 80% and 40 points above the most frequent colour's share.

    python tests/recipes/test_vision_learns.py --qlora build/qlora --qlora-faults build/qlora_faults --workdir DIR
"""
import json
import os
import sys

import torch

from recipe_common import Checks, losses, recipe_args, run_recipe
from test_vision_recipe import DATA, F, build

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}
QUESTION = "What colour is the square?"
TRAIN, HELD_OUT = 160, 40
RUN = ["logging.progress=plain", "data.format=chat", "data.template=auto", "data.max_seq_len=96", "training.epochs=4",
       "training.batch_size=4", "lora.rank=8", "lora.alpha=16", "optim.lr=5e-3", "optim.warmup_steps=4",
       'lora.targets=["q","k","v","o","gate","up","down"]', 'lora.vision_targets=["qkv","proj","linear_fc1","linear_fc2"]',
       "lora.train_projector=true", "checkpoint.keep_last_n=1"]


def write_records(d, name, n, seed):
    """n records: a coloured square (14 to 20 pixels) at a random place on grey noise, 24 x 24 to 32 x 32 images."""
    from PIL import Image
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    names, rows = list(COLOURS), []
    for i in range(n):
        colour = names[int(torch.randint(0, 4, (1,), generator=g))]
        h, w = (int(x) for x in torch.randint(24, 33, (2,), generator=g))
        side = int(torch.randint(14, 21, (1,), generator=g))
        y, x = int(torch.randint(0, h - side + 1, (1,), generator=g)), int(torch.randint(0, w - side + 1, (1,), generator=g))
        px = torch.randint(90, 166, (h, w, 3), generator=g, dtype=torch.uint8)
        px[y:y + side, x:x + side] = torch.tensor(COLOURS[colour], dtype=torch.uint8)
        file = f"{name}_{i}.png"
        Image.fromarray(px.numpy()).save(os.path.join(d, file))
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": file},
                                                               {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": f"It is {colour}."}]})
    path = os.path.join(d, name + ".jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path, rows


def answers(export, data_dir, rows):
    """transformers' greedy answer on the export for each record's image and question."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    proc = Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(export),
                            tokenizer=AutoTokenizer.from_pretrained(export), video_processor=Qwen3VLVideoProcessor(),
                            chat_template=open(os.path.join(DATA, "chat_templates", "Qwen3.5-9B.jinja")).read())
    model = F.Qwen3_5ForConditionalGeneration.from_pretrained(export, dtype=torch.float32).eval()
    out = []
    for r in rows:
        image = Image.open(os.path.join(data_dir, r["messages"][0]["content"][0]["image"])).convert("RGB")
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
        # The answer as trained: the template's empty thinking block before it (enable_thinking false).
        inputs = proc.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                          return_tensors="pt", enable_thinking=False)
        with torch.no_grad():
            new = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        out.append(proc.tokenizer.decode(new, skip_special_tokens=True))
    return out


def main():
    a = recipe_args()
    check = Checks()
    base, data_dir = os.path.join(a.workdir, "base"), os.path.join(a.workdir, "data")
    build(base, a.workdir)
    train, _ = write_records(data_dir, "train", TRAIN, seed=5)
    _, held = write_records(data_dir, "held_out", HELD_OUT, seed=6)
    out = os.path.join(a.workdir, "run")
    r = run_recipe(a.qlora, out, *RUN, f"model.checkpoint_dir={base}", f"data.path={train}")
    if not check(r.returncode == 0, f"the run trains ({r.stderr.strip()[-300:]})"):
        return check.summary()
    got = losses(out)
    check(got[-1] < 0.3 * got[0], f"the loss falls: {got[0]:.3f} -> {got[-1]:.3f}")
    said = answers(os.path.join(out, "epoch_3"), data_dir, held)
    want = [r["messages"][1]["content"] for r in held]
    right = sum(s.strip() == w for s, w in zip(said, want))
    counts = {c: sum(w == f"It is {c}." for w in want) for c in COLOURS}
    majority = max(counts.values()) / len(want)
    accuracy = right / len(want)
    print("held-out answers:", list(zip(said, want))[:8], "...", flush=True)
    check(accuracy >= 0.8 and accuracy >= majority + 0.4,
          f"held-out images answered right: {right}/{len(want)} = {accuracy:.0%} (the text alone: at most the most "
          f"frequent colour, {majority:.0%}; chance 25%)")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
