"""DoRA and rsLoRA (lora.use_dora, lora.use_rslora) in the recipes, end to end through the binary:

1. lora_finetune on the embedded default with both: the first step's loss equals plain LoRA's (B = 0
   makes DoRA's scale 1), later ones differ; the epoch's adapter holds exactly the keys and shapes
   peft's own get_peft_model_state_dict gives for LoraConfig(use_dora, use_rslora), and its
   adapter_config says both; peft's DoRA merge of it into the base is the merged export byte for
   byte (checkpoint.merge_from = original: both merge into the same full-precision base);
2. 2 ranks give one process's losses and adapters (the magnitudes are sharded like A and B);
3. SIGKILL mid-run, then resume: losses equal exactly, adapters byte-identical; resuming with
   use_dora switched off is refused, naming the key;
4. lora_dpo with DoRA runs, and its first sigmoid loss is ln 2 (reference = adapters off);
5. DoRA with the output head targeted is refused before training, naming lora.use_dora.
"""
import json
import math
import os

import torch

from recipe_common import (RANKS_TOL, Checks, adapter, losses, max_diff, max_tensor_diff, recipe_args, run_recipe,
                           safetensors_of)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["training.epochs=2", "training.max_steps_per_epoch=8", "checkpoint.save_every_steps=4",
         "logging.progress=plain", "checkpoint.merge_from=original"]
# DoRA adapts the decoder projections (the output head's chunked loss takes plain LoRA only).
TARGETS = 'lora.targets=["q", "k", "v", "o", "gate", "up", "down"]'
VARIANT = ["lora.use_dora=true", "lora.use_rslora=true", TARGETS]


def check_peft(check, out):
    """The epoch's adapter against peft: keys and shapes, config, and peft's merge = our merged export."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    adir = os.path.join(out, "epoch_1", "adapter")
    with open(os.path.join(adir, "adapter_config.json")) as f:
        cfg = json.load(f)
    check(cfg["use_dora"] is True and cfg["use_rslora"] is True, "adapter_config: use_dora and use_rslora are true")
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    lc = LoraConfig(r=cfg["r"], lora_alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"], use_dora=True,
                    use_rslora=True)
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(get_peft_model(load(cfg["base_model_name_or_path"]), lc)).items()}
    got = {k: tuple(v.shape) for k, v in adapter(out, 1).items()}
    check(got == want, f"adapter keys and shapes are peft's ({len(want)} tensors, "
                       f"{sum('lora_magnitude_vector' in k for k in want)} magnitudes)")
    # peft's DoRA merge of the adapter into the base (in fp32), rounded to the export's dtype (the
    # base's, bf16), is our merged export byte for byte; a merge without the magnitudes' rescaling
    # (plain LoRA's W + delta) differs in most elements, so the check sees DoRA's part.
    base = load(cfg["base_model_name_or_path"])
    original = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = PeftModel.from_pretrained(base, adir)
    with torch.no_grad():
        deltas = {name.removeprefix("base_model.model.") + ".weight": mod.get_delta_weight("default")
                  for name, mod in peft_model.named_modules() if hasattr(mod, "lora_A") and "default" in mod.lora_A}
        want = peft_model.merge_and_unload().state_dict()
    ours = safetensors_of(os.path.join(out, "epoch_1"))
    worst = max((want[k].to(ours[k].dtype) != ours[k]).float().mean().item() for k in deltas)
    plain = min(((original[k] + d).to(ours[k].dtype) != ours[k]).float().mean().item() for k, d in deltas.items())
    check(worst == 0 and plain > 0.5, f"the merged export is peft's DoRA merge rounded to {ours[next(iter(deltas))].dtype} "
                                      f"(mismatching fraction {worst}; a plain LoRA merge mismatches >= {plain:.2f})")

def main():
    a = recipe_args()
    check = Checks()
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731

    r = run_recipe(a.qlora, w("lora"), *SHORT, TARGETS, "checkpoint.adapter_only=true")
    plain = losses(w("lora"))
    r = run_recipe(a.qlora, w("ref"), *SHORT, *VARIANT)
    ref = losses(w("ref"))
    check(r.returncode == 0 and len(ref) == 16, "lora_finetune with DoRA + rsLoRA: 16 steps, exit 0")
    check(abs(ref[0] - plain[0]) <= 1e-6 and max_diff(ref[1:], plain[1:]) > 1e-4,
          f"first loss equals plain LoRA's ({ref[0]:.6f} vs {plain[0]:.6f}), later ones differ")
    a0, a1 = adapter(w("ref"), 0), adapter(w("ref"), 1)
    mags = [k for k in a1 if k.endswith("lora_magnitude_vector")]
    check(mags and all(not (a0[k] == a1[k]).all() for k in mags), f"the {len(mags)} magnitudes train")
    check_peft(check, w("ref"))

    r = run_recipe(a.qlora, w("ranks2"), *SHORT, *VARIANT, "training.batch_size=8", nproc=2)
    check(r.returncode == 0 and max_diff(losses(w("ranks2")), ref) <= RANKS_TOL,
          f"2 ranks: losses within {RANKS_TOL} of one process's")
    check(max_tensor_diff(adapter(w("ranks2"), 1), a1) <= RANKS_TOL, "2 ranks: adapters (magnitudes too) agree")

    r = run_recipe(a.qlora_faults, w("killed"), *SHORT, *VARIANT, fault="kill_after_step=10", expect_rc=-9)
    check(r.returncode == -9, "the run dies by SIGKILL at step 10")
    r = run_recipe(a.qlora, w("killed"), *SHORT, TARGETS, "lora.use_dora=false", "lora.use_rslora=true",
                   "checkpoint.resume=true", expect_rc=1)
    check(r.returncode == 1 and "lora.use_dora" in r.stderr, "resume with use_dora switched off is refused, naming it")
    r = run_recipe(a.qlora, w("killed"), *SHORT, *VARIANT, "checkpoint.resume=true")
    check(r.returncode == 0 and losses(w("killed")) == ref, "resume after the kill: losses equal exactly")
    check(all(max_tensor_diff(adapter(w("killed"), e), adapter(w("ref"), e)) == 0 for e in (0, 1)),
          "resume after the kill: both epochs' adapters byte-identical")

    r = run_recipe(a.qlora, w("dpo"), "--config", os.path.join(ROOT, "configs", "tiny_qlora_dpo.toml"),
                   f"data.path={ROOT}/tests/data/tiny_preferences.jsonl",
                   f"data.val_path={ROOT}/tests/data/tiny_preferences_heldout.jsonl", "training.epochs=1",
                   "training.max_steps_per_epoch=3", "logging.progress=plain", *VARIANT, recipe="lora_dpo")
    got = losses(w("dpo"))[0] if r.returncode == 0 else float("nan")
    check(abs(got - math.log(2)) < 1e-6, f"lora_dpo with DoRA: first sigmoid loss is ln 2 ({got:.7f})")
    r = run_recipe(a.qlora, w("head"), "lora.use_dora=true", "training.max_steps_per_epoch=1", expect_rc=1)
    check(r.returncode == 1 and "lora.use_dora" in r.stderr, "DoRA on the output head is refused, naming lora.use_dora")
    return check.summary()


if __name__ == "__main__":
    raise SystemExit(main())
