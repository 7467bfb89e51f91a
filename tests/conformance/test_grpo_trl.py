#!/usr/bin/env python3
"""Conformance of our GRPO objective (src/qlora/train/grpo_loss.h, grpo_batch.h) with TRL 1.16.

On a tiny fp32 LlamaForCausalLM, fixed prompt/completion ids (unequal lengths, some truncated: no
stop token at the end), rewards (one group of equal rewards, one unscorable completion) and old-policy
log-probs, for each case of CASES: tests/tools/grpo_tool runs one micro-batch of our path, and a real
GRPOTrainer (our adapter on a fresh PEFT adapter of the same config, reference = adapters disabled)
runs its own: a rollout_func hands it our ids, a reward function our rewards, and
_generate_and_score_completions builds its masks, reference log-probs and advantages, then
compute_loss and backward. Compared: loss mask, advantages, per-token policy and reference log-probs,
loss, the KL, clip and entropy metrics TRL logs, and every LoRA gradient. MOE_CASES run the same on a tiny
Qwen3-MoE with LoRA on its experts (peft's target_parameters; TRL's default router load-balancing loss
off: qlora adds none, docs/moe.md).
  python test_grpo_trl.py --tool build/grpo_tool --workdir /tmp/x
"""
import json
import os
import sys
from collections import namedtuple

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/datasets/trl import: nothing here needs the network
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is "experimental" in TRL 1.16
# One thread, here and in grpo_tool: on tensors this small more threads only wait on each other, and on
# a busy 2-core machine they made the test 3x slower (67 s against 20 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from safetensors.torch import load_file

from _common import run_checked
from _trl import (MOE_TARGETS, VOCAB, adapter_params, compare_grads, load_adapter_weights, tiny_base, tiny_moe_base,
                  tiny_tokenizer, trl_lora_config, trl_main)

SEED = 1234
G = 3  # num_generations
MAX_COMPLETION_LENGTH = 8
# Per group: the prompt's length, then each completion's (length, ends with EOS, reward). Group 1's
# rewards are equal (std 0: advantages 0); group 2 has an unscorable completion (reward None: left out
# of its group's statistics, advantage 0). Completions without EOS are truncated.
GROUPS = [
    (4, [(3, True, 0.2), (6, False, 1.0), (1, True, -0.5)]),
    (6, [(5, True, 1.0), (2, True, 1.0), (7, False, 1.0)]),
    (2, [(4, False, 0.3), (3, True, None), (6, True, 0.9)]),
    (3, [(2, True, 2.0), (5, True, -1.0), (4, False, 0.5)]),
]
# Old-policy log-probs = our first run's policy log-probs + this N(0, 1) scale: ratios e^±0.3,
# enough that epsilon 0.2 clips some tokens on both sides and cispo's bound some more.
OLD_NOISE = 0.3

# Per token, fp32 forward of 2 layers in another summation order: ~1e-6 nats; a shifted label or a
# prompt token scored moves a log-prob by nats.
LOGP_ATOL = 2e-5
# The same fp32 rewards, mean and Bessel std in another order: ~1e-7; leaving out TRL's 1e-4 added to
# the std moves an advantage of ~1 by 1e-4.
ADV_ATOL = 1e-5
# The loss: a mean of per-token terms |A|·w·(log-prob error) with |A| <= ~2, w <= ~1.5, plus the KL's
# (1 − e^(ref − logπ))·beta·(error): ~3 LOGP_ATOL at worst; a wrong denominator moves it by > 10%.
LOSS_ATOL = 1e-4
KL_ATOL = 1e-5  # the k3 mean of differences of log-probs each within LOGP_ATOL, |d k3| <= |1 − e^d|·error
# Gradients after two layers of fp32 backward in another order: ~1e-5 of the largest entry; 1e-3
# still fails a missing scale or a token clipped on one side and not the other.
GRAD_RTOL = 1e-3

# GRPOConfig's fields (and the grpo.* keys grpo_tool's cases take).
Case = namedtuple("Case", "loss_type importance_sampling_level scale_rewards beta num_iterations epsilon epsilon_high "
                          "mask_truncated_completions use_bias_correction_kl temperature", defaults=[True, 1.0])
# A covering subset of loss_type x importance_sampling_level x scale_rewards x beta (the product is 60
# trainers, too slow): every loss_type at both levels, each once without and once with beta, each
# scale_rewards value at both levels, num_iterations 1 (ratio 1) and 2 (our old log-probs),
# mask_truncated_completions on and off, epsilon_high unset and set, use_bias_correction_kl on (TRL's
# default) and off, temperature 1 and not (TRL's log-probs of logits / temperature, the reference's too).
CASES = {
    "grpo_token": Case("grpo", "token", "group", 0.0, 2, 0.2, None, False),
    "grpo_sequence_kl": Case("grpo", "sequence", "batch", 0.05, 2, 0.2, None, True, temperature=0.7),
    "dr_grpo_token_kl": Case("dr_grpo", "token", "none", 0.1, 2, 0.2, None, False, False),
    "dr_grpo_sequence": Case("dr_grpo", "sequence", "group", 0.0, 2, 0.2, 0.28, False),
    "dapo_token": Case("dapo", "token", "batch", 0.0, 2, 0.2, 0.28, True, temperature=1.3),
    "dapo_sequence_kl": Case("dapo", "sequence", "none", 0.04, 2, 0.2, None, False),
    "dapo_token_onpolicy_kl": Case("dapo", "token", "group", 0.04, 1, 0.2, None, False),
    "bnpo_token_kl": Case("bnpo", "token", "group", 0.1, 2, 0.1, 0.3, False),
    "bnpo_sequence": Case("bnpo", "sequence", "batch", 0.0, 2, 0.2, None, True),
    "cispo_token": Case("cispo", "token", "none", 0.0, 2, 0.2, 1.2, True),
    "cispo_sequence_kl": Case("cispo", "sequence", "group", 0.02, 2, 0.2, 1.1, False, False),
    "cispo_token_default_bound": Case("cispo", "token", "batch", 0.0, 1, 0.2, None, False),
}
# On the tiny Qwen3-MoE (the reference pass through the experts' bases alone: beta > 0).
MOE_CASES = {"grpo_token_kl_moe": Case("grpo", "token", "group", 0.04, 1, 0.2, None, False)}
# What both sides share: the group size, and dr_grpo's denominator (longer than every completion here).
COMMON = {"num_generations": G, "max_completion_length": MAX_COMPLETION_LENGTH}


def make_rollout(stop_ids):
    """{"stop_ids", "rows"} as grpo_tool reads it, old_logps still missing. Ids are drawn from
    [3, VOCAB): 0 is pad and 1, 2 are the stop tokens TRL takes from the tokenizer and the model's
    generation config."""
    g = torch.Generator().manual_seed(SEED)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()
    rows = []
    for prompt_len, completions in GROUPS:
        prompt = ids(prompt_len)
        for length, eos, reward in completions:
            completion = ids(length - 1) + [stop_ids[0]] if eos else ids(length)
            rows.append({"prompt": prompt, "completion": completion, "reward": reward})
    return {"stop_ids": stop_ids, "rows": rows}


def run_tool(tool, base_dir, rollout_path, out, cases, targets=None):
    """grpo_tool on {name: Case}: OUT/adapter, and per case OUT/<name>/result.safetensors (returned)."""
    cases_path = os.path.join(out, "cases.json")
    os.makedirs(out, exist_ok=True)
    with open(cases_path, "w") as f:
        json.dump([{"name": name, **COMMON, **case._asdict()} for name, case in cases.items()], f)
    run_checked([tool, "--checkpoint", base_dir, "--rollout", rollout_path, "--cases", cases_path, "--out", out,
                 "--seed", SEED, *(["--targets", targets] if targets else [])])
    return {name: load_file(os.path.join(out, name, "result.safetensors")) for name in cases}


def grpo_trainer(case, base_dir, adapter_dir, workdir, rollout, moe):
    """A GRPOTrainer whose rollout_func returns our ids for each prompt "p<row>" and whose reward
    function our rewards: everything after generation is TRL's own code. moe: TRL's router
    load-balancing loss (on by default for a MoE model) off."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    rows = rollout["rows"]

    def rollout_func(prompts, trainer):
        picked = [rows[int(p[1:])] for p in prompts]
        return {"prompt_ids": [r["prompt"] for r in picked], "completion_ids": [r["completion"] for r in picked],
                "logprobs": None}

    def reward(prompts, completions, row, **kwargs):
        return [rows[i]["reward"] for i in row]

    args = GRPOConfig(output_dir=os.path.join(workdir, "trl"), use_cpu=True, bf16=False, fp16=False,
                      gradient_checkpointing=False, report_to="none", seed=SEED, per_device_train_batch_size=len(rows),
                      **COMMON, **case._asdict(), **({"router_aux_loss_coef": 0.0} if moe else {}))
    dummy = Dataset.from_list([{"prompt": f"p{i}", "row": i} for i in range(len(rows))])
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=base, reward_funcs=reward, args=args, train_dataset=dummy,
                          processing_class=tiny_tokenizer(), peft_config=trl_lora_config(adapter_dir),
                          rollout_func=rollout_func)
    load_adapter_weights(trainer.model, adapter_dir)
    trainer.model.train()  # metrics under "train"; dropout is 0 anyway
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not running
    return trainer


def trl_step(trainer, rollout, old_logps):
    """TRL's batch (its masks, advantages, reference log-probs) from our rollout, our old log-probs in
    place of its own (num_iterations > 1: the policy's log-probs before an update), then its
    compute_loss and backward. Returns (batch, policy per-token log-probs, loss)."""
    rows = [{"prompt": f"p{i}", "row": i} for i in range(len(rollout["rows"]))]
    batch = trainer._generate_and_score_completions(rows)
    if trainer.num_iterations > 1:
        batch["old_per_token_logps"] = old_logps
    seen = {}
    inner = trainer._get_per_token_logps_and_entropies

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen["logps"] = out[0].detach()
        return out

    trainer._get_per_token_logps_and_entropies = spy
    try:
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    return batch, seen["logps"], loss.detach()


def other_loss_type(trainer, batch, case):
    """TRL's loss on the same batch under another loss_type: our loss must be told apart from it."""
    other = "dr_grpo" if case.loss_type == "grpo" else "grpo"
    saved, trainer.loss_type = trainer.loss_type, other
    try:
        with torch.no_grad():
            return other, trainer.compute_loss(trainer.model, batch)
    finally:
        trainer.loss_type = saved


def check_case(checks, name, case, ours, trainer, batch, trl_logps, loss):
    mask = batch["completion_mask"].float()
    checks.compare(f"{name} loss mask", ours["mask"], mask, 0)
    checks.compare(f"{name} advantages", ours["advantages"], batch["advantages"], ADV_ATOL)
    checks.compare(f"{name} per-token log-probs", ours["logps"] * mask, trl_logps * mask, LOGP_ATOL)
    if case.beta:
        checks.compare(f"{name} reference per-token log-probs", ours["ref_logps"] * mask,
                       batch["ref_per_token_logps"] * mask, LOGP_ATOL)
        moved = ((ours["logps"] - ours["ref_logps"]) * mask).abs().max().item()
        checks.check(f"{name} adapter moves log-probs", moved > 1e-3, f"max|policy - ref| {moved:.3e}")
        checks.compare(f"{name} mean KL (TRL's metric)", ours["mean_kl"], torch.tensor(trainer._metrics["train"]["kl"][-1]),
                       KL_ATOL)
    else:
        checks.check(f"{name} no reference pass", "ref_logps" not in ours and "ref_per_token_logps" not in batch,
                     "beta 0")
    clip_key = "cispo_clip_ratio" if case.loss_type == "cispo" else "clip_ratio/region_mean"
    trl_clip = torch.tensor(trainer._metrics["train"][clip_key][-1])
    checks.compare(f"{name} clipped fraction (TRL's {clip_key})", ours["clip_ratio"], trl_clip, 1e-6)
    # The policy's entropy at the sampling temperature over the loss mask's tokens (TRL's "entropy"):
    # fp32 sums over the vocabulary in another order, ~1e-6 of log(vocab).
    checks.compare(f"{name} mean entropy (TRL's metric)", ours["entropy"],
                   torch.tensor(trainer._metrics["train"]["entropy"][-1]), 1e-5)
    checks.compare(f"{name} loss", ours["loss"], loss, LOSS_ATOL * max(1.0, abs(loss.item())))
    other, other_loss = other_loss_type(trainer, batch, case)
    apart = abs(ours["loss"].item() - other_loss.item())
    checks.check(f"{name} loss differs from TRL's {other}", apart > 10 * LOSS_ATOL,
                 f"|ours - {other}| {apart:.3e} (> {10 * LOSS_ATOL:g})")


def run_case(checks, workdir, name, case, bases, rollout, old_logps, ours_dirs, results):
    kind = "moe" if name in MOE_CASES else "dense"
    ours, adapter_dir = results[name], os.path.join(ours_dirs[kind], "adapter")
    trainer = grpo_trainer(case, bases[kind], adapter_dir, os.path.join(workdir, name), rollout, kind == "moe")
    params = adapter_params(checks, name, trainer.model, adapter_dir)
    batch, trl_logps, loss = trl_step(trainer, rollout, old_logps)
    check_case(checks, name, case, ours, trainer, batch, trl_logps, loss)
    compare_grads(checks, name, ours, params, GRAD_RTOL)
    if case.num_iterations > 1:
        ratio_moved = ((trl_logps - old_logps) * batch["completion_mask"]).abs().max().item()
        checks.check(f"{name} old log-probs differ from the policy's", ratio_moved > 0.1, f"max|log w| {ratio_moved:.3f}")


def stop_ids(base_dir):
    """TRL's stop tokens: the tokenizer's EOS, the model's generation-config EOS, and pad."""
    from transformers import GenerationConfig
    tok = tiny_tokenizer()
    eos = GenerationConfig.from_pretrained(base_dir).eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return [tok.eos_token_id, *[e for e in eos if e != tok.eos_token_id], tok.pad_token_id]


def make_inputs(tool, workdir):
    """The bases, the rollout with old log-probs (our dense policy's on a first run, the adapter being the
    same for every run: one seed, plus OLD_NOISE·N(0, 1)), and our results for every case. Returns
    ({"dense"|"moe": base_dir}, rollout, old [B, C], {"dense"|"moe": our output directory}, {name: our tensors})."""
    base_dir = tiny_base(workdir, SEED)
    rollout = make_rollout(stop_ids(base_dir))
    path = os.path.join(workdir, "rollout.json")
    with open(path, "w") as f:
        json.dump(rollout, f)
    first = run_tool(tool, base_dir, path, os.path.join(workdir, "first"), {"first": CASES["grpo_token"]._replace(
        num_iterations=1)})["first"]
    noise = torch.randn(first["logps"].shape, generator=torch.Generator().manual_seed(SEED + 1))
    old = (first["logps"] + OLD_NOISE * noise) * first["mask"]
    for i, row in enumerate(rollout["rows"]):
        row["old_logps"] = old[i, :len(row["completion"])].tolist()
    with open(path, "w") as f:
        json.dump(rollout, f)
    bases = {"dense": base_dir, "moe": tiny_moe_base(workdir, SEED)}
    ours_dirs = {kind: os.path.join(workdir, "ours_" + kind) for kind in bases}
    results = {**run_tool(tool, base_dir, path, ours_dirs["dense"], CASES),
               **run_tool(tool, bases["moe"], path, ours_dirs["moe"], MOE_CASES, MOE_TARGETS)}
    return bases, rollout, old, ours_dirs, results


def main():
    return trl_main({**CASES, **MOE_CASES}, lambda args: make_inputs(args.tool, args.workdir),
                    lambda checks, args, name, case, *inputs: run_case(checks, args.workdir, name, case, *inputs))


if __name__ == "__main__":
    sys.exit(main())
