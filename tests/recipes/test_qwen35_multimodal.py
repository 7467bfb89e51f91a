"""The Hub's Qwen3.5 (model_type "qwen3_5", Qwen3_5ForConditionalGeneration) through `qlora run`: a tiny
random one written by transformers (_families' Qwen3.5 language model, three Gated DeltaNet layers and a
gated attention layer, beside a tiny vision tower; keys model.language_model.*, model.visual.*, lm_head).
LoRA on every decoder projection of both mixers, a full-precision base merged over the original weights.
Checks:
1. the run trains (finite losses) and its log names the skipped vision tower;
2. the adapter's target_modules is a pattern that wraps none of the vision tower's modules when peft
   loads it onto Qwen3_5ForConditionalGeneration, and every language-model projection it names; and
   every one of them too onto Qwen3_5ForCausalLM, which AutoModelForCausalLM builds from the same
   checkpoint (modules model.layers.N..., not model.language_model.layers.N...), by transformers'
   load_adapter and by peft with the key mapping;
3. the merged export loads in Qwen3_5ForConditionalGeneration with nothing missing or unexpected, keeps
   every tensor of the original, the vision tower's byte for byte;
4. its logits equal peft's adapter on the base (the same model two ways), under either class.

    python tests/recipes/test_qwen35_multimodal.py --qlora build/qlora --qlora-faults build/qlora_faults
        --workdir build/recipe_qwen35_multimodal
"""
import glob
import json
import os
import shutil
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from safetensors.torch import load_file

from recipe_common import Checks, losses, recipe_args, run_recipe

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "conformance"))
import _families as F  # noqa: E402

TOKENIZER = os.path.join(HERE, "..", "data", "tokenizer", "tokenizer.model")  # 512 pieces
TARGETS = ["q", "k", "v", "o", "linear_qkv", "linear_z", "linear_b", "linear_a", "linear_out", "gate", "up", "down"]
# fp32 on both sides, the same weights: peft's separate LoRA path against our merged weights, summation
# order only (~1e3 ulps of the largest logit); a missing or misplaced adapter moves logits by > 1e-2.
ATOL_PER_UNIT = 1e-4


def tensors(directory):
    out = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(f))
    return out


def build(base):
    torch.manual_seed(0)
    cfg = F.qwen35_multimodal_config(**{**F.COMMON, **F.QWEN35, "vocab_size": 512})
    F.Qwen3_5ForConditionalGeneration(cfg).float().save_pretrained(base, max_shard_size="2MB")
    shutil.copy(TOKENIZER, base)


def main():
    a = recipe_args()
    check = Checks()
    base, out = os.path.join(a.workdir, "base"), os.path.join(a.workdir, "run")
    build(base)
    r = run_recipe(a.qlora, out, f"model.checkpoint_dir={base}", "lora.targets=[" + ",".join(f'"{t}"' for t in TARGETS) + "]",
                   "training.epochs=1", "training.max_steps_per_epoch=3", "checkpoint.adapter_only=false",
                   "checkpoint.merge_from=original", "model.base=fp32", "model.dtype=fp32", "data.max_seq_len=64",
                   "logging.progress=plain")
    got = losses(out)
    check(r.returncode == 0 and len(got) == 3 and all(map(lambda x: x == x and abs(x) < 1e3, got)),
          f"qwen3_5 trains: losses {got}")
    check("outside the language model" in r.stdout + r.stderr and "model.visual" in r.stdout + r.stderr,
          "the log names the skipped vision tower")

    export = os.path.join(out, "epoch_0")
    model_cls = F.Qwen3_5ForConditionalGeneration
    base_model = model_cls.from_pretrained(base, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base_model, os.path.join(export, "adapter")).eval()
    wrapped = [n for n, m in peft_model.named_modules() if hasattr(m, "lora_A")]
    want = [n for n, _ in base_model.named_modules()
            if n.startswith("model.language_model.layers.") and n.rsplit(".", 1)[-1] in F.QWEN35_TARGETS]
    check(not any("visual" in n for n in wrapped), "peft wraps none of the vision tower's modules")
    check(len(wrapped) == len(want), f"peft wraps every targeted language-model projection ({len(wrapped)} of {len(want)})")
    with open(os.path.join(export, "adapter", "adapter_config.json")) as f:
        check(isinstance(json.load(f)["target_modules"], str), "adapter_config's target_modules is a pattern")

    merged, info = model_cls.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    check(not bad, f"Qwen3_5ForConditionalGeneration loads the merged export, nothing missing or unexpected {bad}")
    original, exported = tensors(base), tensors(export)
    vision = [k for k in original if k.startswith("model.visual.")]
    check(not set(original) - set(exported), f"the export holds every original tensor (missing {sorted(set(original) - set(exported))[:3]})")
    check(vision and all(torch.equal(exported[k], original[k]) for k in vision),
          f"the {len(vision)} vision tower tensors are copied byte for byte")
    tokens = torch.randint(0, 512, (1, F.SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = peft_model(tokens).logits, merged.eval()(tokens).logits
    d, atol = (ref - ours).abs().max().item(), ATOL_PER_UNIT * max(1.0, ref.abs().max().item())
    check(d <= atol, f"merged export's logits = peft's adapter on the base: max|diff| {d:.2e} (atol {atol:.1e})")
    causal_checks(check, base, export, want, tokens, ours)
    return check.summary()


def causal_checks(check, base, export, want, tokens, merged_logits):
    """The adapter under the text-only class AutoModelForCausalLM builds from the multimodal checkpoint,
    loaded the two ways that apply transformers' key mapping (model.language_model.X -> model.X) to the
    adapter's weights too: transformers' load_adapter, and peft's from_pretrained given that mapping
    (peft 0.21 applies it only when given: without it the layers' weights are reported missing)."""
    adapter = os.path.join(export, "adapter")
    causal = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    causal.load_adapter(adapter)
    via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter,
                                         key_mapping={r"^model\.language_model\.": "model."}).eval()
    for how, model in (("load_adapter", causal), ("PeftModel.from_pretrained(key_mapping)", via_peft)):
        name = f"{type(model.get_base_model() if hasattr(model, 'get_base_model') else model).__name__} + {how}"
        wrapped = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
        check(len(wrapped) == len(want) and not any("visual" in n for n in wrapped),
              f"{name}: every targeted language-model projection wrapped ({len(wrapped)} of {len(want)})")
        with torch.no_grad():
            ref = model(tokens).logits
        d, atol = (ref - merged_logits).abs().max().item(), ATOL_PER_UNIT * max(1.0, ref.abs().max().item())
        check(d <= atol, f"{name} gives the merged export's logits: max|diff| {d:.2e} (atol {atol:.1e})")

if __name__ == "__main__":
    sys.exit(main())
