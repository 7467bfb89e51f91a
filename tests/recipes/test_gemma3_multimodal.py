"""The Hub's multimodal Gemma 3 (model_type "gemma3", Gemma3ForConditionalGeneration) through the product:
a tiny random one written by transformers (a SigLIP vision tower and a projector beside the gemma3_text
language model), in both key layouts qlora reads:
  A  language_model.model.*, vision_tower.*, multi_modal_projector.*: the Hub's files, and what
     transformers 5.23's save_pretrained writes (sharded here);
  B  model.language_model.*, model.vision_tower.*, ...: the class's module names (its state_dict as is).
Checks:
1. reference: transformers loads B with the same logits as A (so both are the same model);
2. qlora's forward (tests/tools/llama_logits, fp32) on A and on B equals transformers' text logits;
3. `qlora run lora_finetune` on A (LoRA on every decoder projection and the tied output head) trains,
   and its log names the skipped vision tower / projector once (tensor count and bytes);
4. the adapter holds exactly the keys and shapes peft 0.21 gives Gemma3ForConditionalGeneration for
   adapter_config.json's target_modules, a pattern that wraps none of the vision tower's modules (a
   list of names would: checked); peft loads it onto A with the logits of our forward on the merge;
5. the merged export (merged over the original weights) keeps A's layout and config.json (but for the
   untied head), copies every vision tower and projector tensor byte for byte, and
   Gemma3ForConditionalGeneration.from_pretrained loads it (nothing missing or unexpected) with the text
   logits of peft's adapter on the base (and of peft's merge_and_unload where the head stays tied);
   2 ranks train and export the same (within RANKS_TOL); `qlora generate` runs on the merged export;
6. the same on B (head tied, not targeted): the export is in B's layout and loads;
7. bad input: a gemma3 config.json without text_config, and a checkpoint whose language-model keys are
   absent, are refused naming the file and the key.

    python tests/recipes/test_gemma3_multimodal.py --qlora build/qlora --qlora-faults build/qlora_faults
        --tool build/llama_logits --workdir build/recipe_gemma3_multimodal
"""
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from recipe_common import (RANKS_TOL, Checks, adapter, losses, max_diff, max_tensor_diff, recipe_args, run_recipe,
                           safetensors_of)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "conformance"))
from _common import logits_tool  # noqa: E402

SP_TOKENIZER = os.path.join(HERE, "..", "data", "tokenizer", "tokenizer.model")  # 512 pieces, <s> 1, </s> 2
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256, initializer_range=0.1,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
# SigLIP with q/k/v/out projections of its own: what a target list of names would also wrap.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
LLAMA_PEFT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The language model's modules under Gemma3ForConditionalGeneration's names and a text-only class's (model.layers.N).
PATTERN_A = "|".join([rf"model\.(?:language_model\.)?layers\.\d+\.self_attn\.{p}" for p in LLAMA_PEFT[:4]] +
                     [rf"model\.(?:language_model\.)?layers\.\d+\.mlp\.{p}" for p in LLAMA_PEFT[4:]] + ["lm_head"])
PATTERN_B = PATTERN_A[:-len("|lm_head")]
STEPS = 4
RUN = ["logging.progress=plain", "training.epochs=1", f"training.max_steps_per_epoch={STEPS}",
       "checkpoint.adapter_only=false", "data.max_seq_len=128", "lora.rank=8", "lora.alpha=16",
       "optim.warmup_steps=1", "training.batch_size=4", "optim.lr=0.01",
       # The merge over the original fp32 weights (not the NF4 base trained against), so that it is
       # what peft computes when it loads the adapter onto the checkpoint.
       "checkpoint.merge_from=original"]
SEQ = 20
# fp32 on both sides (the checkpoints are fp32): what differs is the order of floating-point operations
# (our matmuls and attention vs transformers' eager; our merge W + s * B @ A vs peft's), so the
# tolerance is per unit of the largest reference logit, 1e-4 * max(1, max|ref|) (~1e3 fp32 ulps), as in
# conformance.families_transformers; a skipped norm, a wrong RoPE base or a lost adapter moves them by > 1.
ATOL_FP32_PER_UNIT = 1e-4


def atol_for(ref):
    return ATOL_FP32_PER_UNIT * max(1.0, ref.abs().max().item())


def text_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def load_mm(path):
    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                          output_loading_info=True)


def build(work):
    """The tiny model saved by transformers (layout A, sharded) and as its state_dict (layout B)."""
    torch.manual_seed(0)
    cfg = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms (1 or 0 at init) and biases (0): random, so each one shows
                p.add_(0.1 * torch.randn_like(p))
    a, b = os.path.join(work, "base_a"), os.path.join(work, "base_b")
    model.save_pretrained(a, max_shard_size="100KB")
    os.makedirs(b)
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, os.path.join(b, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(a, "config.json"), b)
    for d in (a, b):
        shutil.copy(SP_TOKENIZER, os.path.join(d, "tokenizer.model"))
    return model, a, b


def peft_state_keys(base_dir, pattern):
    model, _ = load_mm(base_dir)
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=pattern))
    wrapped = [n for n, m in pm.named_modules() if hasattr(m, "lora_A")]
    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(pm, save_embedding_layers=False).items()}, wrapped


def check_adapter_and_merge(check, a, tag, base_dir, run_dir, pattern, tokens, untied):
    export = os.path.join(run_dir, "epoch_0")
    adapter_dir = os.path.join(export, "adapter")
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        targets = json.load(f)["target_modules"]
    check(targets == pattern, f"{tag}: adapter_config target_modules is the language model's pattern {targets!r}")
    want, wrapped = peft_state_keys(base_dir, targets)
    got = {k: tuple(v.shape) for k, v in load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).items()}
    check(got == want, f"{tag}: adapter keys and shapes are peft's ({len(want)} tensors, e.g. {sorted(want)[0]}; "
                       f"ours only {sorted(set(got) - set(want))[:3]}, peft's only {sorted(set(want) - set(got))[:3]})")
    check(wrapped and not [n for n in wrapped if "vision" in n or "projector" in n],
          f"{tag}: the pattern wraps {len(wrapped)} modules, none of the vision tower's")

    # peft onto the base vs our forward on the merged export, then peft's merge vs transformers' load of ours.
    base, _ = load_mm(base_dir)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    ref = text_logits(peft_model, tokens)
    ours = logits_tool(a.tool, export, tokens, os.path.join(a.workdir, f"{tag}_merged.safetensors"))
    d = (ours - ref).abs().max().item()
    check(d <= atol_for(ref), f"{tag}: peft's adapter on the base = our forward on the merged export "
                              f"(max|diff| {d:.2e}, atol {atol_for(ref):.1e})")
    merged, info = load_mm(export)
    bad = {k: v for k, v in info.items() if v}
    check(not bad, f"{tag}: Gemma3ForConditionalGeneration loads the merged export, nothing missing or unexpected {bad}")
    theirs = text_logits(merged.eval(), tokens)
    d = (theirs - ref).abs().max().item()
    check(d <= atol_for(ref), f"{tag}: its text logits = peft's adapter on the base (max|diff| {d:.2e})")
    # peft's own merge is the reference only while the head stays tied: merging a LoRA on a tied
    # lm_head writes its update into the shared embedding as well, which the untied export does not.
    if not untied:
        merged_ref = text_logits(peft_model.merge_and_unload(), tokens)
        d = (theirs - merged_ref).abs().max().item()
        check(d <= atol_for(merged_ref), f"{tag}: and = peft's merge_and_unload (max|diff| {d:.2e}, "
                                         f"atol {atol_for(merged_ref):.1e}; fp32 merge on both sides)")

    original, exported = safetensors_of(base_dir), safetensors_of(export)
    head = "language_model.lm_head.weight" if tag == "A" else "lm_head.weight"
    extra = {head} if untied else set()
    check(set(exported) == set(original) | extra,
          f"{tag}: the export keeps the input's key layout ({len(exported)} tensors; only ours "
          f"{sorted(set(exported) - set(original) - extra)[:3]}, only the input's {sorted(set(original) - set(exported))[:3]})")
    vision = [k for k in original if "vision_tower" in k or "multi_modal_projector" in k]
    same = [k for k in vision if k in exported and torch.equal(exported[k], original[k])]
    check(vision and len(same) == len(vision), f"{tag}: {len(same)}/{len(vision)} vision tower and projector "
                                               f"tensors copied byte for byte")
    with open(os.path.join(base_dir, "config.json")) as f:
        want_cfg = json.load(f)
    with open(os.path.join(export, "config.json")) as f:
        got_cfg = json.load(f)
    if untied:  # a LoRA on the tied head unties it, in the top-level key transformers reads and text_config
        want_cfg["tie_word_embeddings"] = False
        want_cfg["text_config"]["tie_word_embeddings"] = False
    check(got_cfg == want_cfg, f"{tag}: the export's config.json is the input's"
                               f"{' with tie_word_embeddings false' if untied else ''}")


def check_ranks_and_generate(check, a, base_a, run_a, targets):
    """2 ranks (the same global batch) train and export as one process does; `qlora generate` runs on
    the export (the merged multimodal checkpoint loads as a base again)."""
    run2 = os.path.join(a.workdir, "run_a_ranks2")
    r = run_recipe(a.qlora, run2, *RUN, f"model.checkpoint_dir={base_a}", targets, "training.batch_size=2", nproc=2)
    if check(r.returncode == 0, "A: 2 ranks train"):
        dl, da = max_diff(losses(run2), losses(run_a)), max_tensor_diff(adapter(run2), adapter(run_a))
        one, two = safetensors_of(os.path.join(run_a, "epoch_0")), safetensors_of(os.path.join(run2, "epoch_0"))
        vision = [k for k in one if not k.startswith("language_model.")]
        check(dl < RANKS_TOL and da < RANKS_TOL and one.keys() == two.keys() and
              all(torch.equal(one[k], two[k]) for k in vision),
              f"A: 2 ranks give one process's losses and adapter within {RANKS_TOL} ({dl:.1e}, {da:.1e}) and the "
              f"same export keys, the vision tower copied by the rank that writes it")
    r = subprocess.run([a.qlora, "generate", "--checkpoint", os.path.join(run_a, "epoch_0"), "--prompt", "Reverse",
                        "--max-new-tokens", "4", "--device", "cpu"], capture_output=True, text=True)
    check(r.returncode == 0 and re.search(r"\d+ new tokens", r.stderr),
          f"A: qlora generate runs on the merged multimodal export ({r.stderr.strip()[-200:]!r})")


def check_bad_input(check, a, work, base_a):
    def refused(tag, base, *needles):
        r = subprocess.run([a.qlora, "run", "lora_finetune", f"checkpoint.output_dir={os.path.join(work, tag)}",
                            f"model.checkpoint_dir={base}", *RUN], capture_output=True, text=True)
        out = r.stdout + r.stderr
        check(r.returncode != 0 and all(n in out for n in needles),
              f"bad input, {tag}: refused naming {needles}: {out.strip()[-300:]!r}")

    no_text = os.path.join(work, "no_text_config")
    shutil.copytree(base_a, no_text)
    cfg_path = os.path.join(no_text, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    del cfg["text_config"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    refused("no_text_config", no_text, cfg_path, "text_config")

    no_lm = os.path.join(work, "no_language_model")
    os.makedirs(no_lm)
    state = {k.replace("language_model.", "lm."): v for k, v in safetensors_of(base_a).items()}
    save_file(state, os.path.join(no_lm, "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.model"):
        shutil.copy(os.path.join(base_a, f), no_lm)
    refused("no_language_model", no_lm, no_lm, "language_model.model.embed_tokens.weight")


def main():
    a = recipe_args(("--tool", dict(required=True, help="tests/tools/llama_logits")))
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")  # transformers' and peft's deprecations
    check = Checks()
    work = a.workdir
    model, base_a, base_b = build(work)
    tokens = torch.randint(3, TEXT["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
    ref = text_logits(model, tokens)
    atol = atol_for(ref)

    # 1-2. the forward on both layouts
    with open(os.path.join(base_a, "model.safetensors.index.json")) as f:
        keys_a = list(json.load(f)["weight_map"])
    check(any(k.startswith("language_model.model.layers.") for k in keys_a) and
          any(k.startswith("vision_tower.") for k in keys_a),
          f"transformers {transformers.__version__} writes layout A (language_model.model.*, vision_tower.*)")
    model_b, info = load_mm(base_b)
    d = (text_logits(model_b.eval(), tokens) - ref).abs().max().item()
    check(not any(info.values()) and d <= atol,  # eager here, SDPA in `model`
          f"reference: transformers loads layout B as the same model (max|diff| {d:.1e})")
    for tag, base in (("A", base_a), ("B", base_b)):
        try:
            ours = logits_tool(a.tool, base, tokens, os.path.join(work, f"{tag}_base.safetensors"))
            d = (ours - ref).abs().max().item()
            check(d <= atol, f"{tag}: qlora's forward = Gemma3ForConditionalGeneration's text logits "
                             f"(max|diff| {d:.2e}, atol {atol:.1e}, max|ref| {ref.abs().max().item():.1f})")
        except Exception as e:
            check(False, f"{tag}: qlora's forward: {e}")

    # 3-5. training on A, LoRA on the tied head too
    targets = 'lora.targets=["q","k","v","o","gate","up","down","output"]'
    run_a = os.path.join(work, "run_a")
    r = run_recipe(a.qlora, run_a, *RUN, f"model.checkpoint_dir={base_a}", targets)
    if check(r.returncode == 0, "A: qlora run lora_finetune trains on the multimodal checkpoint"):
        ls = losses(run_a)
        check(len(ls) == STEPS and ls[-1] < ls[0], f"A: {len(ls)} losses that fall ({ls[0]:.4f} -> {ls[-1]:.4f})")
        original = safetensors_of(base_a)
        vision = [k for k in original if not k.startswith("language_model.")]
        nbytes = sum(t.numel() * t.element_size() for k, t in original.items() if k in vision)
        lines = [l for l in r.stdout.splitlines() if "outside the language model" in l]
        check(len(lines) == 1 and f"skipped {len(vision)} tensors" in lines[0] and f"{nbytes} bytes" in lines[0],
              f"A: the log names the skipped vision tower / projector once ({len(vision)} tensors, {nbytes} bytes): "
              f"{lines}")
        # Why a pattern: peft's list form matches by suffix and would also wrap SigLIP's q/k/v.
        _, wrapped = peft_state_keys(base_a, LLAMA_PEFT)
        check(any("vision_tower" in n for n in wrapped),
              f"peft's list target_modules would wrap the vision tower too ({[n for n in wrapped if 'vision' in n][:2]})")
        check_adapter_and_merge(check, a, "A", base_a, run_a, PATTERN_A, tokens, untied=True)
        check_ranks_and_generate(check, a, base_a, run_a, targets)

    # 6. layout B, the head tied and untouched
    run_b = os.path.join(work, "run_b")
    r = run_recipe(a.qlora, run_b, *RUN, f"model.checkpoint_dir={base_b}", "training.max_steps_per_epoch=2",
                   'lora.targets=["q","k","v","o","gate","up","down"]')
    if check(r.returncode == 0, "B: qlora run lora_finetune trains on the state_dict layout"):
        check_adapter_and_merge(check, a, "B", base_b, run_b, PATTERN_B, tokens, untied=False)

    # 7. bad input
    check_bad_input(check, a, work, base_a)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
