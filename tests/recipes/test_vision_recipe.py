"""Training on images (issue 52) through `qlora run lora_finetune`: a tiny random Qwen3.5 vision-language
model (Qwen3_5ForConditionalGeneration written by transformers: _families' Qwen3.5 language model beside
a tiny tower), Qwen's BPE with its vision tokens, Qwen3.5-9B's chat template and an image processor sized
to the tiny tower; chat records whose user turns hold an image (PNG files beside the data). LoRA on the
language model and on every encoder linear of the tower (its bases in NF4, as the language model's), the
merger trained in full (lora.vision_targets, lora.train_projector: peft's target_modules and
modules_to_save); the grey run below keeps the tower frozen.
Checks:
1. the run trains on the images (its log names the tower; finite losses);
1b. the tower trained: every adapted tower linear's lora_B and the merger moved from the base, and the
   merged export holds W + scale * B @ A for those linears and the trained merger (in the checkpoint's keys);
2. the first step's loss is transformers' mean token cross-entropy of the same first batch: the ids and
   labels as qlora reads the records (image_data_tool), the pixels from transformers' own processor
   through its own tower, with the language model's projections in NF4 on both sides (torchao's
   dequantization of our bytes is the reference's weights); fp32;
3. the images matter: the same records whose images are all one grey give another first loss;
4. 2 ranks give one process's losses and adapter; the tower is sharded: a rank holds half the bytes of its
   frozen weights that one process holds (the log's figure; up to 64-byte alignment per group and rank);
   also where in each step one rank's rows hold no image (the tower trained: that rank makes its gathers
   without running it);
5. killed by SIGKILL after step 2 and resumed: the adapter bit for bit the uninterrupted run's;
6. `qlora generate --image` on the merged export: its prompt ids are transformers' processor's
   (apply_chat_template with the image, add_generation_prompt) and its greedy text transformers'
   generate on the same export (Qwen3_5ForConditionalGeneration, pixels from its own processor);
7. the PEFT adapter (the tower's adapters and the merger among its tensors), loaded by peft onto the base
   Qwen3_5ForConditionalGeneration, gives the merged export's logits on that image prompt (merged over the
   original weights, checkpoint.merge_from);
8. `qlora run lora_dpo` on image preference pairs (TRL's vision forms: a record-level "images" with {"type": "image"}
   parts or "<image>", and parts with their sources): each pair's chosen / rejected log-probs are transformers' on
   our ids with its processor's pixels (rel 1e-6), the prompt ids TRL's DataCollatorForVisionPreference's, the
   loss TRL's sigmoid formula; lora.vision_targets trains the tower's adapters; with lora.train_projector too,
   a step after an epoch gives peft's log-probs (the epoch's adapter on the base) and TRL's loss with the
   reference under peft's disable_adapter() (the original merger), and 2 ranks one process's; a missing image
   and an image count that does not match are refused naming the file and record;
9. `qlora run lora_grpo` on prompts with images, from the trained export: its greedy completion is
   transformers' generate of 6 (another colour's image gives another); the policy trains with the tower
   (lora.vision_targets, lora.train_projector: the tower's lora_B and the merger move), a saved rollout's
   reference log-probs are transformers' on the export (the merger as loaded) and its old policy's peft's with
   the previous epoch's adapter, and a run killed inside a rollout resumes bit for bit.
10. Gemma 3 / Gemma 4, 2 steps with every tower linear adapted and the projector trained (check_gemma): the
   export holds them (as 1b) and is peft's merge_and_unload; peft loads the adapter with its logits (as 7).

    python tests/recipes/test_vision_recipe.py --qlora build/qlora --qlora-faults build/qlora_faults
        --image-data-tool build/image_data_tool --workdir build/recipe_vision
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys

import torch

from recipe_common import Checks, adapter, losses, max_diff, recipe_args, run_recipe, safetensors_of

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "conformance"))
import _families as F  # noqa: E402
from _gguf_tokenizers import qwen_tokenizer  # noqa: E402

DATA = os.path.join(HERE, "..", "data")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
STEPS, BATCH = 4, 4
COMMON = ["logging.progress=plain", "training.epochs=1", f"training.max_steps_per_epoch={STEPS}",
          "checkpoint.save_every_steps=1", "checkpoint.keep_last_n=8", "data.format=chat", "data.template=auto",
          "data.shuffle=false", "data.max_seq_len=96", "lora.rank=8", "lora.alpha=16", "optim.warmup_steps=1",
          'lora.targets=["q","k","v","o","gate","up","down"]', "checkpoint.merge_from=original"]
VISION_TARGETS = ["qkv", "proj", "linear_fc1", "linear_fc2"]
TRAIN_TOWER = ["lora.vision_targets=" + json.dumps(VISION_TARGETS), "lora.train_projector=true"]
# fp32 on both sides, the same NF4-dequantized weights: the order of operations only (~1e-6 of the loss).
LOSS_RTOL = 1e-5
# 2 ranks against one process: the same sums in another order; 1.7e-5 seen on a 2-core Xeon (AVX-512), ~1e-5 on
# AMD EPYC. A rank's gradient lost or counted twice moves them by ~lr (2e-4).
RANKS_TOL = 5e-5
# The tower's lora_A: its first updates are AdamW's m / sqrt(v) of gradients near 0 (lora_B ~ lr then; the
# tower's gradients summed over images in another order on 2 ranks), which passes their rounding into
# the update (seen 7e-5; one process with 2 micro-batches of 2 rows instead of 1 of 4 differs as much, 8e-5:
# summation order, not the engine): bounded by one update (lr 2e-4). The tower's lora_B and merger, in the same
# trainable group, are held to RANKS_TOL: a rank's gradient lost or counted twice moves them by ~lr.
TOWER_A_TOL = 2e-4


def tower_bytes(stdout):
    """The bytes of the tower's frozen weights a rank holds, as the run logs them."""
    m = re.search(r"vision tower: (\d+) bytes of its frozen weights held on each rank", stdout)
    return int(m.group(1)) if m else None


def tower_a(key):
    return ".visual." in key and ".lora_A." in key


def build(base, work):
    from transformers import AutoTokenizer
    tok_dir = os.path.join(work, "tok")
    qwen_tokenizer(tok_dir, ranks=1000)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    torch.manual_seed(0)
    # The tower's linears whole NF4 groups (multiples of 64 x 256 elements), as the language model's are,
    # so torchao's NF4 of them is the reference (qlora pads other sizes, which torchao refuses).
    text = {**F.COMMON, **F.QWEN35, "vocab_size": len(tok), "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}
    cfg = F.Qwen3_5Config(text_config=text, vision_config={**F.QWEN35_VISION, "hidden_size": 128, "intermediate_size": 256},
                          tie_word_embeddings=False)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    for k, v in ids.items():
        setattr(cfg, k, v)
    model = F.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    F.randomize_norms(model, 0)
    model.save_pretrained(base)
    tok.save_pretrained(base)
    shutil.copy(os.path.join(DATA, "chat_templates", "Qwen3.5-9B.jinja"), os.path.join(base, "chat_template.jinja"))
    v = cfg.vision_config
    with open(os.path.join(base, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": v.patch_size,
                   "merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
                   "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                   "size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}}, f)
    return model


def write_data(d, grey=False, text_only=()):
    """16 records: a coloured square on noise, asked for its colour (those of `text_only` without it)."""
    from PIL import Image
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(3)
    colours = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}
    names = list(colours)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for i in range(16):
            name = names[int(torch.randint(0, 4, (1,), generator=g))]
            w, h = 20 + 4 * (i % 4), 24 + 4 * (i % 3)
            px = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
            px[4:h - 4, 4:w - 4] = torch.tensor(colours[name], dtype=torch.uint8)
            if grey:
                px[:] = 128
            Image.fromarray(px.numpy()).save(os.path.join(d, f"{i}.png"))
            image = [] if i in text_only else [{"type": "image", "image": f"{i}.png"}]
            f.write(json.dumps({"messages": [
                {"role": "user", "content": [*image, {"type": "text", "text": "What colour is the square?"}]},
                {"role": "assistant", "content": f"It is {name}."}]}) + "\n")
    return os.path.join(d, "train.jsonl")


def nf4_reference(model):
    """The model with every linear qlora holds in NF4 (the language model's layers' projections, the tower's
    encoder linears) as torchao's NF4 of it, dequantized."""
    from torchao.dtypes.nf4tensor import to_nf4
    with torch.no_grad():
        for n, p in model.named_parameters():
            if (".language_model.layers." in n or ".visual.blocks." in n) and n.endswith(".weight") and p.dim() == 2:
                p.copy_(to_nf4(p.detach().clone()).get_original_weight())
    return model


def first_batch_loss(model, tool, base, data, work):
    """transformers' mean token cross-entropy over the first BATCH records, as qlora's first step sees them."""
    from transformers import AutoImageProcessor
    from PIL import Image
    out = os.path.join(work, "tool")
    r = subprocess.run([tool, base, data, out, "96"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    samples = json.load(open(os.path.join(out, "samples.json")))[:BATCH]
    proc = AutoImageProcessor.from_pretrained(base)
    records = [json.loads(line) for line in open(data)][:BATCH]
    total, count = 0.0, 0
    with torch.no_grad():
        for s, rec in zip(samples, records):
            image = Image.open(os.path.join(os.path.dirname(data), rec["messages"][0]["content"][0]["image"])).convert("RGB")
            px = proc([image], return_tensors="pt")
            tokens = torch.tensor([s["tokens"]])
            logits = model(input_ids=tokens, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                           mm_token_type_ids=(tokens == model.config.image_token_id).long()).logits[0]
            labels = torch.tensor(s["labels"][1:])
            keep = labels != -100
            total += torch.nn.functional.cross_entropy(logits[:-1][keep].double(), labels[keep], reduction="sum").item()
            count += int(keep.sum())
    return total / count


def main():
    a = recipe_args(("--image-data-tool", dict(required=True)))
    check = Checks()
    base = os.path.join(a.workdir, "base")
    model = build(base, a.workdir)
    data = write_data(os.path.join(a.workdir, "data"))
    common = [*COMMON, *TRAIN_TOWER, f"model.checkpoint_dir={base}", f"data.path={data}"]

    one = os.path.join(a.workdir, "one")
    r = run_recipe(a.qlora, one, *common, f"training.batch_size={BATCH}")
    if not check(r.returncode == 0 and "vision tower" in r.stdout, "one process trains on the images (the tower named)"):
        return check.summary()
    ref = losses(one)
    held_one = tower_bytes(r.stdout)
    check(len(ref) == STEPS and all(math.isfinite(x) for x in ref), f"{len(ref)} finite losses {[round(x, 4) for x in ref]}")
    check_tower_trained(check, base, one)

    want = first_batch_loss(nf4_reference(model), a.image_data_tool, base, data, a.workdir)
    check(abs(ref[0] - want) <= LOSS_RTOL * abs(want),
          f"the first step's loss is transformers' on the same batch with its own processor and tower: "
          f"{ref[0]:.8f} vs {want:.8f} (rel {abs(ref[0] - want) / abs(want):.1e} <= {LOSS_RTOL})")

    check_dpo(check, a, model, base, data)
    check_refusals(check, a, base, data)
    grey = os.path.join(a.workdir, "grey")
    r = run_recipe(a.qlora, grey, *COMMON, f"model.checkpoint_dir={base}", f"data.path={write_data(grey + '_data', True)}",
                   f"training.batch_size={BATCH}", "training.max_steps_per_epoch=1")
    check(r.returncode == 0 and abs(losses(grey)[0] - ref[0]) > 1e-3,
          f"the images matter: grey images give another first loss ({losses(grey)[0] if r.returncode == 0 else None} vs {ref[0]:.4f})")

    two = os.path.join(a.workdir, "two")
    r = run_recipe(a.qlora, two, *common, f"training.batch_size={BATCH // 2}", nproc=2)
    if check(r.returncode == 0, "2 ranks train"):
        dl = max(abs(x - y) for x, y in zip(losses(two), ref))
        diff = {k: float(abs(adapter(two)[k] - adapter(one)[k]).max()) for k in adapter(one)}
        da = max(d for k, d in diff.items() if not tower_a(k))
        dta = max(d for k, d in diff.items() if tower_a(k))
        check(dl < RANKS_TOL and da < RANKS_TOL and dta < TOWER_A_TOL,
              f"2 ranks give one process's losses and adapter ({dl:.1e}, {da:.1e}; the tower's lora_A {dta:.1e})")
        held_two = tower_bytes(r.stdout)
        check(held_one and held_two and held_one / 2 <= held_two <= held_one / 2 + 64 * 2,
              f"the tower is sharded: a rank holds {held_two} bytes of its frozen weights, one process {held_one}")
    check_rank_without_images(check, a, base)

    killed = os.path.join(a.workdir, "killed")
    r = run_recipe(a.qlora_faults, killed, *common, f"training.batch_size={BATCH}", fault="kill_after_step=2", expect_rc=-9)
    if check(r.returncode == -9, "the run dies by SIGKILL after step 2"):
        r = run_recipe(a.qlora, killed, *common, f"training.batch_size={BATCH}")
        same = r.returncode == 0 and all((adapter(killed)[k] == adapter(one)[k]).all() for k in adapter(one))
        check(same and losses(killed)[-1] == ref[-1], "resumed after SIGKILL: the adapter bit for bit the uninterrupted run's")
    for family in GEMMA:
        check_gemma(check, a, family)
    greedy = check_generate(check, a, one, data)
    if greedy is not None:
        check_grpo(check, a, os.path.join(one, "epoch_0"), data, greedy)
    return check.summary()


# Gemma 3 / Gemma 4 (issue 52): the tower trained end to end against peft. Their tiny models, processors
# (test_vision_language's) and special tokens; the projector as peft's modules_to_save names it.
GEMMA = {
    "gemma3": dict(tokens=["<start_of_image>", "<image_soft_token>", "<end_of_image>"], image="<image_soft_token>",
                   tower=".encoder.layers.", projector=".multi_modal_projector.", types="token_type_ids",
                   targets=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    "gemma4": dict(tokens=["<|image>", "<|image|>", "<image|>"], image="<|image|>", tower=".encoder.layers.",
                   projector=".embed_vision.", types="mm_token_type_ids",
                   targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def gemma_model(family, vocab):
    """The tiny Gemma 3 / Gemma 4 vision-language model of test_vision_language, its tower and projector drawn
    as conformance.vision_towers' (O(1) activations; transformers' zero projection matrix would cut the tower
    off), Gemma 4's linears clamped with bounds that bind; and its image processor's config."""
    import test_vision_language as VL
    from test_vision_towers import randomize_tower, set_clamps
    if family == "gemma3":
        model, processor = VL.gemma3_model(62, vocab_size=vocab), VL.gemma3_processor
    else:
        torch.manual_seed(63)
        cfg = F.config("gemma4_vision", use_bidirectional_attention="vision", sliding_window=4,
                       max_position_embeddings=256, vocab_size=vocab, vocab_size_per_layer_input=vocab)
        cfg._attn_implementation = "eager"
        cfg.vision_config.use_clipped_linears = True
        model, processor = F.Gemma4ForConditionalGeneration(cfg).float().eval(), VL.gemma4_processor
        F.randomize_norms(model, 63)
    randomize_tower(model, ("model.vision_tower.", "model" + GEMMA[family]["projector"]), 64)
    set_clamps(model, 1.5, 1.0)
    return model, processor


def build_gemma(family, base, work):
    """Qwen's BPE with the family's image tokens, the Gemma 3 chat template (Gemma 4's: its image part as
    <|image|>, no Gemma 4 template in tests/data), the model and its processor config."""
    from transformers import AutoTokenizer
    g = GEMMA[family]
    tok_dir = os.path.join(work, "tok")
    qwen_tokenizer(tok_dir, ranks=1000)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": [*g["tokens"], "<start_of_turn>",
                                                                                "<end_of_turn>"]})
    model, processor = gemma_model(family, len(tok))
    model.config.image_token_id = tok.convert_tokens_to_ids(g["image"])
    model.save_pretrained(base)
    tok.save_pretrained(base)
    with open(os.path.join(DATA, "chat_templates", "gemma-3-1b-it.jinja")) as f:
        template = f.read()
    with open(os.path.join(base, "chat_template.jinja"), "w") as f:
        f.write(template if family == "gemma3" else template.replace("<start_of_image>", g["image"]))
    with open(os.path.join(base, "preprocessor_config.json"), "w") as f:
        json.dump(processor(model), f)
    return type(model), tok


def check_gemma(check, a, family):
    """`qlora run lora_finetune` on Gemma 3 / Gemma 4 with every tower linear adapted and the projector trained:
    the merged export holds them (check_tower_trained; Gemma 4's clamp bounds kept), transformers loads it whole,
    and peft's adapter on the base (the tower's linears wrapped, the projector as modules_to_save; exactly the
    adapter's tensors) gives its logits on an image prompt."""
    from peft import PeftModel, get_peft_model_state_dict
    from PIL import Image
    from transformers import AutoImageProcessor
    g, work = GEMMA[family], os.path.join(a.workdir, family)
    base = os.path.join(work, "base")
    cls, tok = build_gemma(family, base, work)
    data = write_data(os.path.join(work, "data"))
    out = os.path.join(work, "run")
    r = run_recipe(a.qlora, out, *COMMON, f"model.checkpoint_dir={base}", f"data.path={data}", "training.batch_size=2",
                   "training.max_steps_per_epoch=2", "data.max_seq_len=160", "lora.train_projector=true",
                   "lora.vision_targets=" + json.dumps(g["targets"]))
    if not check(r.returncode == 0 and "vision tower" in r.stdout, f"{family}: lora_finetune trains the tower"):
        return
    ad, orig, merged = check_tower_trained(check, base, out, g["tower"], g["projector"], g["targets"])
    clamps = [k for k in orig if k.endswith(("input_min", "input_max", "output_min", "output_max"))]
    if family == "gemma4":
        check(clamps and all(torch.equal(merged.get(k, torch.empty(0)), orig[k]) for k in clamps),
              f"{family}: the merged export keeps the tower's {len(clamps)} clamp bounds")
    export = os.path.join(out, "epoch_0")
    model, info = cls.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    missing = info["missing_keys"] | info["unexpected_keys"] if isinstance(info["missing_keys"], set) else \
        [*info["missing_keys"], *info["unexpected_keys"]]
    check(not missing, f"{family}: transformers loads the merged export, nothing missing or unexpected {sorted(missing)[:4]}")
    load = lambda dtype: PeftModel.from_pretrained(cls.from_pretrained(base, dtype=dtype).eval(),
                                                   os.path.join(export, "adapter")).eval()
    peft = load(torch.float32)
    theirs = get_peft_model_state_dict(peft)
    wrapped = [n for n, _ in peft.named_modules() if g["tower"] in n and n.endswith(".lora_A")]
    same = set(theirs) == set(ad) and all(torch.equal(theirs[k], ad[k]) for k in ad)
    check(same and len(wrapped) == sum(k.endswith(".lora_A.weight") and g["tower"] in k for k in ad) > 0,
          f"{family}: peft loads the adapter onto {cls.__name__}: {len(wrapped)} tower linears wrapped, the projector "
          f"as modules_to_save, its state exactly the adapter's {len(ad)} tensors")
    mine, peft_merged = model.state_dict(), peft.merge_and_unload().state_dict()
    check(mine.keys() == peft_merged.keys() and all(torch.equal(mine[k], peft_merged[k]) for k in mine),
          f"{family}: the merged export is peft's merge_and_unload of the adapter on the base, bit for bit")
    proc = AutoImageProcessor.from_pretrained(base)
    px = proc([Image.open(os.path.join(work, "data", "0.png")).convert("RGB")], return_tensors="pt")
    kernel = getattr(model.config.vision_config, "pooling_kernel_size", None)
    n = F.GEMMA3_MM_TOKENS if family == "gemma3" else int((px["image_position_ids"][0, :, 0] >= 0).sum()) // kernel ** 2
    ids = torch.tensor([tok.encode("Look:") + [model.config.image_token_id] * n + tok.encode(" What colour?")])
    kw = {"pixel_values": px["pixel_values"].double(), **{k: v for k, v in px.items() if k == "image_position_ids"}}
    kw[g["types"]] = (ids == model.config.image_token_id).long()
    with torch.no_grad():
        ref, ours = model.double().eval()(input_ids=ids, **kw).logits, load(torch.float64)(input_ids=ids, **kw).logits
    diff, tol = (ours - ref).abs().max().item(), 1e-4 * max(1.0, ref.abs().max().item())
    # The Qwen case's tolerance, in fp64: what is left is the merged weights' own fp32 rounding, which the tiny
    # random language models amplify layer by layer (~3x a layer on Gemma 4's 5: seen 9e-5 and 2.1e-4 on two
    # builds' training bits, 1e-5 on Gemma 3; in fp32 the two paths' rounding gave 1.2e-3 on Gemma 4, over the
    # tolerance). The merge itself is checked bit for bit above.
    check(diff < tol, f"{family}: peft's adapter on the base gives the merged export's logits on an image prompt "
                      f"({n} image tokens; fp64; max|diff| {diff:.1e}, tolerance {tol:.1e})")

def check_rank_without_images(check, a, base):
    """3 steps whose rows 2-3, then 0-1, then 2-3 are text only: rank 1, then rank 0, then rank 1 has no image
    to run (the first step's learning rate is 0 under the warmup: the second moves lora_B, the third lora_A).
    Merged from the NF4 bases: the tower's merged linears read its gathered shards."""
    mixed = write_data(os.path.join(a.workdir, "mixed_data"), text_only=(2, 3, 4, 5, 10, 11))
    args = [*COMMON, *TRAIN_TOWER, f"model.checkpoint_dir={base}", f"data.path={mixed}",
            "training.max_steps_per_epoch=3", "checkpoint.merge_from=nf4"]
    one, two = os.path.join(a.workdir, "mixed_one"), os.path.join(a.workdir, "mixed_two")
    r1 = run_recipe(a.qlora, one, *args, f"training.batch_size={BATCH}")
    r2 = run_recipe(a.qlora, two, *args, f"training.batch_size={BATCH // 2}", nproc=2)
    if not check(r1.returncode == 0 and r2.returncode == 0, "3 steps where one rank's rows hold no image train"):
        return
    dl = max(abs(x - y) for x, y in zip(losses(two), losses(one)))
    diff = {k: float(abs(adapter(two)[k] - adapter(one)[k]).max()) for k in adapter(one)}
    da = max(d for k, d in diff.items() if not tower_a(k))
    dta = max(d for k, d in diff.items() if tower_a(k))
    merged = [safetensors_of(os.path.join(o, "epoch_0")) for o in (one, two)]
    dm = max(float((merged[1][k] - t).abs().max()) for k, t in merged[0].items() if ".visual.blocks." in k)
    check(len(losses(two)) == 3 and dl < RANKS_TOL and da < RANKS_TOL and dta < TOWER_A_TOL and dm < RANKS_TOL,
          f"a rank without images: 2 ranks give one process's losses, adapter and merged tower ({dl:.1e}, {da:.1e}, "
          f"{dm:.1e}; the tower's lora_A {dta:.1e})")


# Image preference pairs in the forms TRL's vision DPO data sets ship (a record-level "images" with {"type":
# "image"} parts; an "<image>" string prompt) and with the source in the part: (image, chosen, rejected).
DPO_PAIRS = [("0.png", "It is red.", "It is blue."), ("1.png", "It is green.", "It is yellow."),
             ("2.png", "It is blue.", "It is red.")]
QUESTION = "What colour is the square?"


def write_dpo_data(d, path, image_of=lambda i, img: img, images_of=lambda i, img: [img]):
    """The pairs of DPO_PAIRS, one form each; image_of / images_of alter a pair's sources (bad input)."""
    with open(path, "w") as f:
        for i, (img, chosen, rejected) in enumerate(DPO_PAIRS):
            if i == 0:
                rec = {"images": images_of(i, img), "prompt": [{"role": "user", "content": [
                    {"type": "image"}, {"type": "text", "text": QUESTION}]}],
                       "chosen": [{"role": "assistant", "content": [{"type": "text", "text": chosen}]}],
                       "rejected": [{"role": "assistant", "content": [{"type": "text", "text": rejected}]}]}
            elif i == 1:
                rec = {"prompt": [{"role": "user", "content": [{"type": "image", "image": image_of(i, img)},
                                                               {"type": "text", "text": QUESTION}]}],
                       "chosen": [{"role": "assistant", "content": chosen}],
                       "rejected": [{"role": "assistant", "content": rejected}]}
            else:
                rec = {"images": images_of(i, img), "prompt": "<image>" + QUESTION, "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(rec) + "\n")
    return path


def dpo_reference(model, tool, base, pairs, work, first=len(DPO_PAIRS)):
    """transformers' summed log-probs of each of the `first` pairs' chosen and rejected response, [(chosen, rejected), ...]
    (`model` a list of models: a list of those, one per model, the first giving the image token's id): the ids
    and labels as lora_dpo reads the pairs (image_data_tool), the pixels from transformers' processor through
    Qwen3_5ForConditionalGeneration; and per pair whether our prompt's ids are TRL 1.16's DataCollatorForVisionPreference's
    (the processor's chat template and image expansion) up to where the template's assistant span starts."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference
    out = os.path.join(work, "tool_dpo")
    r = subprocess.run([tool, base, pairs, out, "96", "preference"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    samples = json.load(open(os.path.join(out, "samples.json")))
    proc = Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(base),
                            tokenizer=AutoTokenizer.from_pretrained(base), video_processor=Qwen3VLVideoProcessor(),
                            chat_template=open(os.path.join(DATA, "chat_templates", "Qwen3.5-9B.jinja")).read())
    collate = DataCollatorForVisionPreference(processor=proc)
    models = model if isinstance(model, list) else [model]
    image_token = models[0].config.image_token_id
    logps, prompts_agree = [[] for _ in models], []
    for i, (img, chosen, rejected) in enumerate(DPO_PAIRS[:first]):
        image = Image.open(os.path.join(os.path.dirname(pairs), img)).convert("RGB")
        trl = collate([{"images": [image], "prompt": [{"role": "user", "content": [{"type": "image"},
                                                                                   {"type": "text", "text": QUESTION}]}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]}])
        trl_prompt = trl["input_ids"][0][:int(trl["completion_mask"][0].argmax())].tolist()
        px = proc.image_processor([image], return_tensors="pt")
        pairs_of = [[] for _ in models]
        for s in samples[2 * i:2 * i + 2]:
            ours = s["tokens"][:next(k for k, x in enumerate(s["labels"]) if x != -100)]
            prompts_agree.append(trl_prompt[:len(ours)] == ours and len(ours) >= len(trl_prompt) - 2)
            tokens = torch.tensor([s["tokens"]])
            labels = torch.tensor(s["labels"][1:])
            keep = labels != -100
            for m, pair in zip(models, pairs_of):
                with torch.no_grad():
                    logits = m(input_ids=tokens, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                               mm_token_type_ids=(tokens == image_token).long()).logits[0, :-1].double()
                pair.append(torch.log_softmax(logits[keep], -1).gather(1, labels[keep][:, None]).sum().item())
        for got, pair in zip(logps, pairs_of):
            got.append(pair)
    return (logps if isinstance(model, list) else logps[0]), prompts_agree


def adapters_off(peft):
    """peft's model called with its adapters disabled (the reference TRL takes for a peft model)."""
    def call(**inputs):
        with peft.disable_adapter():
            return peft(**inputs)
    return call


def check_dpo(check, a, model, base, data):
    """`qlora run lora_dpo` on image preference pairs: each step's (one pair's) chosen and rejected log-probs are
    transformers' (model: the NF4-dequantized reference) and its sigmoid loss TRL's formula on them; with
    lora.vision_targets the tower's adapters train; bad image input is refused naming the file and record."""
    d = os.path.dirname(data)
    pairs = write_dpo_data(d, os.path.join(d, "dpo.jsonl"))
    args = lambda path: [*COMMON, "data.format=preference", f"model.checkpoint_dir={base}", f"data.path={path}",  # noqa: E731
                         "training.batch_size=1", f"training.max_steps_per_epoch={len(DPO_PAIRS)}", "dpo.beta=0.1"]
    dpo = args(pairs)
    out = os.path.join(a.workdir, "dpo")
    # lr 1e-12: the policy stays the initial one (B = 0: the base) through the three steps, far below fp32's rounding.
    r = run_recipe(a.qlora, out, *dpo, "optim.lr=1e-12", recipe="lora_dpo")
    if not check(r.returncode == 0 and "vision tower" in r.stdout, "lora_dpo trains on image preference pairs (the tower named)"):
        return
    from recipe_common import step_rows
    rows = step_rows(out)
    want, agree = dpo_reference(model, a.image_data_tool, base, pairs, a.workdir)
    # TRL splits prompt and response at the generation prompt (Qwen3.5's ends "<think>\n") and tokenizes them apart;
    # lora_dpo scores the template's assistant span of the whole conversation's tokens (as lora_finetune does), so
    # the prompts agree up to the last token or two, image expansion included.
    check(all(agree), f"each sequence's prompt ids (image tokens included) are TRL's DataCollatorForVisionPreference's {agree}")
    # fp32 on both sides, the same NF4-dequantized weights: summation order only (~1e-6 relative of a sum of
    # ~10 log-probs); a wrong token, image or position moves a log-prob by far more than 1e-4.
    worst = max(max(abs(r_["logps/chosen"] - w[0]), abs(r_["logps/rejected"] - w[1])) / max(1.0, abs(w[0]), abs(w[1]))
                for r_, w in zip(rows, want))
    check(len(rows) == len(DPO_PAIRS) and worst <= LOSS_RTOL,
          f"each pair's chosen / rejected log-probs are transformers' on our ids (its processor's pixels, its tower): {[(round(r_['logps/chosen'], 5), round(r_['logps/rejected'], 5)) for r_ in rows]} vs "
          f"{[(round(w[0], 5), round(w[1], 5)) for w in want]} (rel {worst:.1e} <= {LOSS_RTOL})")
    # TRL's sigmoid loss, -logsigmoid(beta * ((pc - rc) - (pr - rr))), the reference being the base: ln 2.
    loss = [-torch.nn.functional.logsigmoid(torch.tensor(0.1 * ((w[0] - w[0]) - (w[1] - w[1])))).item() for w in want]
    check(max(abs(r_["loss"] - l_) for r_, l_ in zip(rows, loss)) < 1e-6,
          f"each step's loss is TRL's sigmoid loss ({[round(r_['loss'], 7) for r_ in rows]})")

    trained = os.path.join(a.workdir, "dpo_tower")
    r = run_recipe(a.qlora, trained, *dpo, "training.epochs=2", "optim.lr=1e-2",
                   "lora.vision_targets=" + json.dumps(VISION_TARGETS), recipe="lora_dpo")
    if check(r.returncode == 0, "lora_dpo with lora.vision_targets runs"):
        ad = adapter(trained, 1)
        tower_b = [k for k in ad if ".visual.blocks." in k and k.endswith(".lora_B.weight")]
        later = losses(trained)[len(DPO_PAIRS):]
        check(tower_b and all(abs(ad[k]).max() > 0 for k in tower_b) and all(abs(x - math.log(2)) > 1e-6 for x in later),
              f"the tower's adapters train with DPO ({len(tower_b)} lora_B moved; second epoch's losses {[round(x, 4) for x in later]})")
    check_dpo_projector(check, a, model, base, pairs, dpo)

    bad = os.path.join(d, "dpo_missing.jsonl")
    write_dpo_data(d, bad, image_of=lambda i, img: "missing.png")
    r = run_recipe(a.qlora, out + "_bad", *args(bad), recipe="lora_dpo", expect_rc=1)
    check(r.returncode == 1 and f"{bad}: line 2" in r.stderr and "missing.png" in r.stderr,
          f"a missing image is refused naming the record and the file: {r.stderr.strip().splitlines()[-1][:200]!r}")
    write_dpo_data(d, bad, images_of=lambda i, img: [img, img])
    r = run_recipe(a.qlora, out + "_bad", *args(bad), recipe="lora_dpo", expect_rc=1)
    check(r.returncode == 1 and f"{bad}: line 1" in r.stderr and "lists 2 images, the messages show 1" in r.stderr,
          f"an image count that does not match the placeholders is refused naming the record: "
          f"{r.stderr.strip().splitlines()[-1][:200]!r}")


def check_dpo_projector(check, a, model, base, pairs, dpo):
    """lora_dpo with the tower trained (lora.vision_targets, lora.train_projector): the policy has the trained
    merger, the reference the original one, as peft's ModulesToSaveWrapper with the adapters disabled (TRL's
    reference for a peft model). The first epoch's adapter, loaded by peft onto the NF4-dequantized base, is the
    policy of the second epoch's first step (pair 0): its chosen / rejected log-probs are peft's, its loss TRL's
    sigmoid loss with the reference under disable_adapter(); 2 ranks give one process's losses and adapter."""
    import copy
    from peft import PeftModel
    from recipe_common import step_rows
    out = os.path.join(a.workdir, "dpo_projector")
    run = [*dpo, *TRAIN_TOWER, "training.epochs=2", "optim.lr=1e-2", "lora.dropout=0"]
    r = run_recipe(a.qlora, out, *run, recipe="lora_dpo")
    if not check(r.returncode == 0 and "the projector trained" in r.stdout, "lora_dpo with lora.train_projector runs"):
        return
    peft = PeftModel.from_pretrained(copy.deepcopy(model), os.path.join(out, "epoch_0", "adapter")).eval()
    # What a reference keeping the trained merger would give: the base with the adapter's merger.
    kept = copy.deepcopy(model)
    with torch.no_grad():
        for k, v in adapter(out).items():
            if ".visual.merger." in k:
                kept.get_parameter(k[len("base_model.model."):]).copy_(torch.from_numpy(v))
    policy, ref, wrong = dpo_reference([peft, adapters_off(peft), kept], a.image_data_tool, base, pairs, a.workdir, 1)[0]
    (pc, pr), (rc, rr), (kc, kr) = policy[0], ref[0], wrong[0]
    sig = lambda c, r_: -torch.nn.functional.logsigmoid(torch.tensor(0.1 * ((pc - c) - (pr - r_)))).item()  # noqa: E731
    row = step_rows(out)[len(DPO_PAIRS)]
    worst = max(abs(row["logps/chosen"] - pc), abs(row["logps/rejected"] - pr)) / max(1.0, abs(pc), abs(pr))
    # The loss moves by at most beta / 2 times the four log-probs' error (each within LOSS_RTOL, relative).
    loss_tol = 0.1 / 2 * 4 * LOSS_RTOL * max(1.0, abs(pc), abs(pr), abs(rc), abs(rr))
    check(worst <= LOSS_RTOL and abs(row["loss"] - sig(rc, rr)) <= loss_tol and abs(sig(kc, kr) - sig(rc, rr)) > 10 * loss_tol,
          f"after an epoch with the merger trained, pair 0's log-probs are peft's ({row['logps/chosen']:.6f}, "
          f"{row['logps/rejected']:.6f} vs {pc:.6f}, {pr:.6f}: rel {worst:.1e} <= {LOSS_RTOL}) and the loss TRL's with the "
          f"reference under disable_adapter() (the original merger): {row['loss']:.8f} vs {sig(rc, rr):.8f} (|diff| "
          f"{abs(row['loss'] - sig(rc, rr)):.1e} <= {loss_tol:.1e}; the trained merger as reference: {sig(kc, kr):.8f})")
    one, two = out + "_one", out + "_two"
    r1 = run_recipe(a.qlora, one, *run, "training.grad_accum=2", recipe="lora_dpo")
    r2 = run_recipe(a.qlora, two, *run, nproc=2, recipe="lora_dpo")
    if check(r1.returncode == 0 and r2.returncode == 0, "lora_dpo with the projector trained on 1 and 2 ranks"):
        dl = max_diff(losses(two), losses(one))
        diff = {k: float(abs(adapter(two, 1)[k] - adapter(one, 1)[k]).max()) for k in adapter(one, 1)}
        da = max(d for k, d in diff.items() if not tower_a(k))
        dta = max(d for k, d in diff.items() if tower_a(k))
        check(len(losses(one)) == 2 and dl < RANKS_TOL and da < RANKS_TOL and dta < TOWER_A_TOL,
              f"2 ranks give one process's DPO losses and adapter, merger included ({dl:.1e}, {da:.1e}; the tower's "
              f"lora_A {dta:.1e})")


GRPO_TOKENS = 8  # as check_generate's
# Per-token log-probs, fp32 on both sides with the same weights: our kernels against transformers' (DeltaNet's
# chunked form against its reference recurrence) move this model's logits by up to ~2e-4 (check_generate's peft
# check: 1.8e-4), a log-prob by up to about twice that (9e-5 seen); the trained merger in the reference moves them by ~0.4.
GRPO_LOGP_TOL = 5e-4


def write_prompts(path, images, split):
    """GRPO prompts asking check_generate's question about each of `images`: TRL's form (a record-level "images"
    with an image part) for the first, the part with its source for the others; `split` is a field the reward
    command sees."""
    with open(path, "w") as f:
        for i, img in enumerate(images):
            part = {"type": "image"} if i == 0 else {"type": "image", "image": img}
            rec = {"prompt": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
                   "answer": "red", "split": split}
            if i == 0:
                rec["images"] = [img]
            f.write(json.dumps(rec) + "\n")
    return path


def check_grpo(check, a, export, data, want):
    """`qlora run lora_grpo` on prompts with images, from the trained export (fp32 base, as check_generate reads it):
    its validation's greedy completion (the rollouts' own sampling path, the images in the prefill) after
    0.png is `want`, transformers' generate on the export (check_generate's), another image's differs; and
    the policy trains (its loss's log-probs see the images)."""
    d = os.path.dirname(data)
    other = next(f"{i}.png" for i, line in enumerate(open(data)) if i > 0 and json.loads(line)["messages"][1]["content"]
                 != json.loads(open(data).readline())["messages"][1]["content"])  # an image of another colour
    log = os.path.join(a.workdir, "grpo_rewards.jsonl")
    score = os.path.join(a.workdir, "grpo_score.py")
    with open(score, "w") as f:  # records what it scores; rewards vary with the text (advantages that are not 0)
        f.write(f"import json, sys\nfor line in sys.stdin:\n    open({log!r}, 'a').write(line)\n"
                f"    print(sum(map(ord, json.loads(line)['completion'])) % 5)\n")
    images = ["0.png", other]
    # The merged export keeps the chat template in its qlora.json, not beside its tokenizer: the base's tokenizer
    # directory (the same tokenizer) gives data.template = "auto" the template and the image processor.
    grpo = [*COMMON, "data.format=prompt", f"model.checkpoint_dir={export}", "model.base=fp32",
            f"model.tokenizer={os.path.join(a.workdir, 'base', 'tokenizer.json')}",
            f"data.path={write_prompts(d + '/prompts.jsonl', images, 'train')}",
            f"data.val_path={write_prompts(d + '/prompts_val.jsonl', images, 'val')}", "training.batch_size=1",
            "training.max_steps_per_epoch=2", "grpo.num_generations=2", f"grpo.max_completion_length={GRPO_TOKENS}",
            "grpo.beta=0.04", f"grpo.reward_command={sys.executable} {score}"]
    out = os.path.join(a.workdir, "grpo")
    # lr 1e-12: the policy stays the export to far below fp32's rounding, so its greedy text is the export's.
    r = run_recipe(a.qlora, out, *grpo, "optim.lr=1e-12", recipe="lora_grpo")
    if not check(r.returncode == 0 and "vision tower" in r.stdout, "lora_grpo trains on prompts with images (the tower named)"):
        return
    greedy = [json.loads(line)["completion"] for line in open(log) if json.loads(line)["split"] == "val"][-2:]
    check(len(greedy) == 2 and greedy[0] == want and greedy[1] != want,
          f"lora_grpo's greedy completion after 0.png is transformers' generate on the export ({greedy[0]!r} vs "
          f"{want!r}); after {other} (another colour) it differs ({greedy[1]!r})")
    # Two epochs of 2 steps, each rollout feeding 2 (its old log-probs and images saved with the checkpoint of step 3);
    # the tower trained too (its adapters and the merger: the rollouts' and the loss's tower is the current one).
    trained = [*grpo, *TRAIN_TOWER, "optim.lr=1e-2", "training.epochs=2", "grpo.num_iterations=2", "lora.dropout=0"]
    r = run_recipe(a.qlora, out + "_lr", *trained, recipe="lora_grpo")
    if not check(r.returncode == 0 and "the projector trained" in r.stdout, "lora_grpo with a learning rate and the tower trained runs"):
        return
    ad = adapter(out + "_lr", 1)
    moved = max(float(abs(v).max()) for k, v in ad.items() if k.endswith(".lora_B.weight"))
    tower_b = [k for k in ad if ".visual.blocks." in k and k.endswith(".lora_B.weight")]
    start = safetensors_of(export)
    merger = max(float(abs(torch.from_numpy(v) - next(start[o] for o in start if o.endswith("visual." + k.split(".visual.", 1)[1]))).max())
                 for k, v in ad.items() if ".visual.merger." in k)
    check(all(math.isfinite(x) for x in losses(out + "_lr")) and moved > 1e-4 and tower_b and
          all(abs(ad[k]).max() > 0 for k in tower_b) and merger > 0,
          f"the policy trains on the image prompts (finite losses {[round(x, 5) for x in losses(out + '_lr')]}, "
          f"lora_B moved {moved:.1e}; the loss reaches the tower: {len(tower_b)} tower lora_B moved, the merger by {merger:.1e})")
    check_grpo_logps(check, a, export, out + "_lr", os.path.join(d, images[0]))
    killed = out + "_killed"
    run_recipe(a.qlora_faults, killed, *trained, recipe="lora_grpo", fault="kill_after_step=4", expect_rc=-9)
    r = run_recipe(a.qlora, killed, *trained, "checkpoint.resume=true", recipe="lora_grpo")
    same = r.returncode == 0 and "step_00000003" in r.stdout and losses(killed) == losses(out + "_lr") and \
        all((adapter(killed, 1)[k] == ad[k]).all() for k in ad)
    check(same, "killed after step 4 and resumed from step 3, inside a rollout (its prompts' images found again): the "
                "losses and the adapter bit for bit the uninterrupted run's")


def rollout_logps(model, state, image, base):
    """transformers' per-token log-probs [completions, tokens] of the completions a GRPO checkpoint saved for reuse
    (state: its rank file's tensors; every prompt of the step `image`'s), the pixels from transformers' processor."""
    from PIL import Image
    from transformers import AutoImageProcessor
    px = AutoImageProcessor.from_pretrained(base)([Image.open(image).convert("RGB")], return_tensors="pt")
    ids, lengths, rows, at = state["grpo.0.ids"], state["grpo.0.lengths"].view(-1, 3).tolist(), [], 0
    for n_prompt, n_completion, _ in lengths:
        rows.append(ids[at:at + n_prompt + n_completion])
        at += n_prompt + n_completion
    # One batch, right-padded (causal: the padding changes no earlier position's logits).
    tokens = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    n = len(rows)
    with torch.no_grad():
        logits = model(input_ids=tokens, pixel_values=px["pixel_values"].repeat(n, 1), image_grid_thw=px["image_grid_thw"].repeat(n, 1),
                       mm_token_type_ids=(tokens == model.config.image_token_id).long()).logits.double()
    out = []
    for row, (n_prompt, n_completion, _) in zip(range(n), lengths):
        logp = torch.log_softmax(logits[row, n_prompt - 1:n_prompt - 1 + n_completion], -1)
        logp = logp.gather(1, tokens[row, n_prompt:n_prompt + n_completion, None])[:, 0]
        out.append(torch.nn.functional.pad(logp, (0, state["grpo.0.ref_logps"].shape[1] - n_completion)))
    return torch.stack(out)


def check_grpo_logps(check, a, export, run, image):
    """The rollout of step 3 (the second epoch's first; saved with its checkpoint for step 4): its reference
    log-probs are transformers' on the export (the base: adapters off, the merger as loaded, as peft's
    disable_adapter() gives), its old policy's are peft's with the first epoch's adapter (the tower's adapters
    and the trained merger) on the export."""
    import copy
    from peft import PeftModel
    from safetensors.torch import load_file as load_torch
    state = load_torch(os.path.join(run, "checkpoints", "step_00000003", "rank_00000.safetensors"))
    model = F.Qwen3_5ForConditionalGeneration.from_pretrained(export, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(copy.deepcopy(model), os.path.join(run, "epoch_0", "adapter")).eval()
    ref, old = state["grpo.0.ref_logps"].double(), state["grpo.0.old_logps"].double()
    want_ref, want_old = rollout_logps(model, state, image, export), rollout_logps(peft, state, image, export)
    with torch.no_grad():  # what a reference keeping the trained merger would give
        for k, v in adapter(run).items():
            if ".visual.merger." in k:
                model.get_parameter(k[len("base_model.model."):]).copy_(torch.from_numpy(v))
    kept = rollout_logps(model, state, image, export)
    dr, do, dk = (ref - want_ref).abs().max().item(), (old - want_old).abs().max().item(), (kept - want_ref).abs().max().item()
    check(dr <= GRPO_LOGP_TOL and do <= GRPO_LOGP_TOL and dk > 10 * GRPO_LOGP_TOL,
          f"step 3's rollout: the reference's per-token log-probs are transformers' on the export (the merger as loaded: "
          f"max|diff| {dr:.1e}; the trained merger would give {dk:.1e}), the old policy's peft's with epoch 0's adapter "
          f"({do:.1e}) <= {GRPO_LOGP_TOL}")


def check_refusals(check, a, base, data):
    """A name the tower lacks is refused listing its linears; data without images and a text-only checkpoint,
    naming the key."""
    out = os.path.join(a.workdir, "refused")
    r = run_recipe(a.qlora, out, *COMMON, f"model.checkpoint_dir={base}", f"data.path={data}",
                   'lora.vision_targets=["qkv","q_proj"]', expect_rc=1)
    want = "lora.vision_targets: 'q_proj' is not a linear of this vision tower (qkv, proj, linear_fc1, linear_fc2)"
    check(r.returncode == 1 and want in r.stdout + r.stderr, f"an unknown vision target is refused: {want!r}")
    text_only = os.path.join(a.workdir, "text_only.jsonl")
    with open(text_only, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}) + "\n")
    r = run_recipe(a.qlora, out, *COMMON, *TRAIN_TOWER, f"model.checkpoint_dir={base}", f"data.path={text_only}", expect_rc=1)
    check(r.returncode == 1 and "lora.vision_targets: the training data holds no images" in r.stderr,
          "the tower's keys with training data without images are refused naming the key")
    r = run_recipe(a.qlora, out + "_text", "logging.progress=plain", "lora.train_projector=true", expect_rc=1)
    check(r.returncode == 1 and "lora.train_projector: " in r.stdout + r.stderr and "text-only checkpoint" in r.stdout + r.stderr,
          "the tower's keys with a text-only checkpoint (the embedded tiny base) are refused naming the key")


def check_tower_trained(check, base, run, tower=".visual.blocks.", projector=".visual.merger.", targets=VISION_TARGETS):
    """The tower's adapters and the projector moved, and the merged export holds them merged / as trained.
    Returns the adapter and the two checkpoints' tensors."""
    ad = {k: torch.from_numpy(v) for k, v in adapter(run).items()}
    orig, merged = safetensors_of(base), safetensors_of(os.path.join(run, "epoch_0"))
    tower_b = [k for k in ad if tower in k and k.endswith(".lora_B.weight")]
    merger = [k for k in ad if projector in k]
    blocks = len({k.split(tower)[1].split(".")[0] for k in tower_b})
    in_base = [k for k in orig if projector.lstrip(".") in k]
    check(len(tower_b) == blocks * len(targets) and blocks > 0 and len(merger) == len(in_base) > 0
          and all(ad[k].abs().max() > 0 for k in tower_b),
          f"the tower trained: {len(tower_b)} adapted tower linears' lora_B moved from 0, {len(merger)} projector "
          f"tensors saved (of {len(in_base)})")
    scale, worst, moved = 16 / 8, 0.0, 0.0
    for kb in tower_b:
        module = kb[len("base_model.model."):-len(".lora_B.weight")]
        key = next(k for k in orig if k.endswith(module.split("model.", 1)[1] + ".weight"))
        want = orig[key] + scale * ad[kb] @ ad[kb.replace("lora_B", "lora_A")]
        worst = max(worst, (merged[key] - want).abs().max().item())
        moved = max(moved, (merged[key] - orig[key]).abs().max().item())
    same, changed = True, 0.0
    for k in merger:
        key = next(o for o in orig if o.endswith(projector.lstrip(".") + k.split(projector, 1)[1]))
        same = same and torch.equal(merged[key], ad[k])
        changed = max(changed, (ad[k] - orig[key]).abs().max().item())
    # fp32: the merge's matmul and add against torch's, rounding only.
    check(worst < 1e-6 and moved > 0 and same and changed > 0,
          f"the merged export: the tower's linears W + scale B A (max|diff| {worst:.1e}, moved {moved:.1e}), "
          f"the trained projector ({'equal' if same else 'differs'}; moved {changed:.1e} from the base)")
    return ad, orig, merged


def peft_name(key, projector=".visual.merger."):
    """peft's parameter for an adapter key: the projector's trained copy, or the adapter's "default" weights."""
    if projector in key:
        return key.replace(projector, projector + "modules_to_save.default.")
    return key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")


def check_generate(check, a, run, data):
    """Returns transformers' greedy text on the export (None where qlora generate did not run)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    export = os.path.join(run, "epoch_0")
    image = os.path.join(os.path.dirname(data), "0.png")
    cmd = [a.qlora, "generate", "--checkpoint", export, "--message", "What colour is the square?", "--image", image,
           "--max-new-tokens", "8"]
    shown = subprocess.run(cmd + ["--print-prompt"], capture_output=True, text=True)
    got = subprocess.run(cmd, capture_output=True, text=True)
    if not check(shown.returncode == 0 and got.returncode == 0, f"qlora generate --image runs: {got.stderr.strip()[-300:]}"):
        return None
    tokenizer = AutoTokenizer.from_pretrained(export)  # the export's own chat_template.jinja, copied from the base
    with open(os.path.join(DATA, "chat_templates", "Qwen3.5-9B.jinja")) as f:
        check(tokenizer.chat_template == f.read(), "the merged export carries the base's chat_template.jinja")
    proc = Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(export), tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(), chat_template=tokenizer.chat_template)
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.open(image).convert("RGB")},
                                             {"type": "text", "text": "What colour is the square?"}]}]
    inputs = proc.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                      return_tensors="pt")
    ids = json.loads(shown.stdout)["ids"]
    check(ids == inputs["input_ids"][0].tolist(), f"its prompt ids are the processor's ({len(ids)} ids)")
    model = F.Qwen3_5ForConditionalGeneration.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        new = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    want = proc.tokenizer.decode(new, skip_special_tokens=False).split("<|im_end|>")[0]
    check(got.stdout.rstrip("\n") == want, f"its greedy text is transformers' on the export: {got.stdout.strip()!r} vs {want!r}")
    from peft import PeftModel
    base = F.Qwen3_5ForConditionalGeneration.from_pretrained(os.path.join(a.workdir, "base"), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, os.path.join(export, "adapter")).eval()
    # The tower's adapters and the merger (modules_to_save) are what peft loaded, so the logits below cover them.
    params, ad = dict(peft.named_parameters()), adapter(run)
    tower = [k for k in ad if ".visual." in k]
    loaded = [k for k in tower if torch.equal(params[peft_name(k)].detach(), torch.from_numpy(ad[k]))]
    check(len(tower) > 0 and loaded == tower, f"peft loads the tower's adapters and the merger ({len(loaded)} of {len(tower)})")
    with torch.no_grad():
        ref, ours = model(**inputs).logits, peft(**inputs).logits
    diff = (ours - ref).abs().max().item()
    # fp32, the same weights two ways (peft's LoRA path against the merged weights): summation order only.
    check(diff < 1e-4 * max(1.0, ref.abs().max().item()),
          f"peft's adapter on the base gives the merged export's logits on the image prompt (max|diff| {diff:.1e})")
    return want


if __name__ == "__main__":
    sys.exit(main())
