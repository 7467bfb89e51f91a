#!/usr/bin/env python3
"""Conformance of our preference losses (src/qlora/train/preference_loss.h) with TRL 1.16.

Runs tests/tools/dpo_tool on a tiny fp32 LlamaForCausalLM and prompt/chosen/rejected token ids of
unequal lengths (used as given: no BOS/EOS) for each case of CASES, and checks what it wrote against TRL:
  sigmoid, cDPO, ipo, hinge (also rsLoRA, DoRA): a real DPOTrainer on the same base with our initial
    adapter (reference = adapters disabled), fed our ids through its collator and compute_loss: per-pair
    logps, loss, rewards, every LoRA gradient; then its loss code on OUR logps, for the formulas alone.
  sigmoid_moe: sigmoid on a tiny Qwen3-MoE with LoRA on its experts (peft's target_parameters): the
    reference is the experts' bases alone, the expert adapters' gradients TRL's.
  orpo, simpo: ORPOTrainer.odds_ratio_loss / CPOTrainer.cpo_loss ("simpo", cpo_alpha 0) on our averaged
    logps, and on get_batch_logps of PeftModel.from_pretrained(our adapter) for logps and gradients.
  python test_dpo_trl.py --tool build/dpo_tool --workdir /tmp/x
"""
import json
import math
import os
import sys
from collections import namedtuple
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/datasets/trl import: nothing here needs the network

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from _common import run_checked
from _trl import (MOE_TARGETS, adapter_params, compare_grads, load_adapter_weights, tiny_base, tiny_moe_base,
                  tiny_tokenizer, trl_lora_config, trl_main)

# Summed response logps of ~5 nats a token over <= 8 tokens: fp32 rounding of our forward vs torch's is
# ~1e-6 a token, so 1e-4 leaves ~10x margin, while one token too many or too few (a prompt token, a
# shifted label, an EOS) moves a sum by ~5 nats.
LOGP_ATOL = 1e-4
# The same formula evaluated on the same fp32 logps in another order: a few ulps of the result.
FORMULA_RTOL = 1e-5
# Gradients after two layers of fp32 backward in another summation order: ~1e-5 of the tensor's
# largest entry in practice; 1e-3 still fails a missing scale (alpha/r, beta, 1/P) or a wrong token set.
GRAD_RTOL = 1e-3
SEED = 1234
SIMPO_GAMMA = 0.8
# (prompt, chosen, rejected) lengths: unequal, so the batch is padded and per-token averages differ.
LENGTHS = [(5, 3, 6), (2, 7, 2), (8, 1, 4), (3, 4, 4)]

Case = namedtuple("Case", "loss beta eps flags moe", defaults=[False])
CASES = {
    "sigmoid": Case("sigmoid", 0.1, 0.0, []),
    "sigmoid_label_smoothing": Case("sigmoid", 0.5, 0.2, []),
    "ipo": Case("ipo", 0.5, 0.0, []),
    "hinge": Case("hinge", 1.0, 0.0, []),
    "sigmoid_rslora": Case("sigmoid", 0.1, 0.0, ["--rslora"]),
    "sigmoid_dora": Case("sigmoid", 0.1, 0.0, ["--dora"]),
    "sigmoid_moe": Case("sigmoid", 0.1, 0.0, ["--targets", MOE_TARGETS], moe=True),
    "orpo": Case("orpo", 0.25, 0.0, []),
    "simpo": Case("simpo", 2.0, 0.1, []),
}


def make_inputs(workdir):
    """The tiny base checkpoints and the pairs file; returns ({"dense"|"moe": base_dir}, pairs_path, pairs)."""
    bases = {"dense": tiny_base(workdir, SEED), "moe": tiny_moe_base(workdir, SEED)}
    pairs_path = os.path.join(workdir, "pairs.json")
    g = torch.Generator().manual_seed(SEED)
    ids = lambda n: torch.randint(2, 128, (n,), generator=g).tolist()  # 0/1 are the tokenizer's pad/eos
    pairs = [{"prompt": ids(p), "chosen": ids(c), "rejected": ids(r)} for p, c, r in LENGTHS]
    with open(pairs_path, "w") as f:
        json.dump(pairs, f)
    return bases, pairs_path, pairs


def counts(pairs, key):
    return torch.tensor([float(len(p[key])) for p in pairs])


def collate(checks, name, collator, pairs):
    """TRL's DataCollatorForPreference on our ids: [chosen rows; rejected rows], right-padded, with a
    completion mask. Checks it kept every token (no max_length cut, nothing added)."""
    batch = collator([{"prompt_ids": p["prompt"], "chosen_ids": p["chosen"], "rejected_ids": p["rejected"]}
                      for p in pairs])
    resp = torch.cat([counts(pairs, "chosen"), counts(pairs, "rejected")])
    full = resp + torch.cat([counts(pairs, "prompt")] * 2)
    ok = torch.equal(batch["completion_mask"].sum(1).float(), resp) and \
        torch.equal(batch["attention_mask"].sum(1).float(), full)
    checks.check(f"{name} TRL batch keeps every token", ok, f"response tokens {resp.int().tolist()}")
    return batch


def dpo_trainer(case, base_dir, adapter_dir, workdir):
    """DPOTrainer on a fresh PEFT adapter of our config (reference = adapters disabled, as TRL does for a
    new adapter), then our initial weights loaded into it. A PeftModel passed in instead would get a
    frozen copy "ref" of the adapter as reference (trl/trainer/dpo_trainer.py:666-694), not the base."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer
    types, weights = [case.loss], None
    # TRL's "sigmoid" ignores label_smoothing (trl/trainer/dpo_trainer.py:1387); its "robust" (:1428) is
    # ((1-e)S - eS')/(1-2e) with S' the flipped term, so cDPO (1-e)S + eS' = 2(1-e) sigmoid - (1-2e) robust.
    if case.eps:
        types, weights = ["sigmoid", "robust"], [2 * (1 - case.eps), -(1 - 2 * case.eps)]
    # TRL adds a MoE model's router load-balancing loss by default (router_aux_loss_coef: the config's,
    # 0.001 for Qwen3-MoE, even with output_router_logits false); qlora adds none (docs/moe.md), so the
    # MoE case compares the preference loss alone.
    aux = {"router_aux_loss_coef": 0.0} if case.moe else {}
    args = DPOConfig(output_dir=os.path.join(workdir, "trl"), use_cpu=True, bf16=False, fp16=False,
                     gradient_checkpointing=False, max_length=None, report_to="none", beta=case.beta,
                     loss_type=types, loss_weights=weights, label_smoothing=case.eps, seed=SEED, **aux)
    dummy = Dataset.from_list([{"prompt": "t2", "chosen": " t3", "rejected": " t4"}])  # required, unused
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    trainer = DPOTrainer(model=base, args=args, train_dataset=dummy, processing_class=tiny_tokenizer(),
                         peft_config=trl_lora_config(adapter_dir))
    load_adapter_weights(trainer.model, adapter_dir)
    trainer.model.train()  # metrics under "train"; dropout is 0 anyway
    return trainer


def trl_dpo_step(trainer, batch):
    """TRL's compute_loss and backward; per-pair logps {"policy"/"ref": (chosen, rejected)} are read off
    the model outputs it summed (the policy forward runs with grad, the reference under no_grad)."""
    seen = {}
    hook = trainer.model.register_forward_hook(lambda module, args, out: seen.__setitem__(
        "policy" if torch.is_grad_enabled() else "ref", out.log_probs.detach().sum(1).chunk(2)))
    try:
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    finally:
        hook.remove()
    return seen, loss.detach()


class _OurLogps:
    """Stands in for the model in DPOTrainer's loss, which sums log_probs over positions
    (trl/trainer/dpo_trainer.py:1304): one non-zero column gives exactly our logps."""

    def __init__(self, logps, width):
        self.log_probs = torch.zeros(len(logps), width)
        self.log_probs[:, -1] = logps

    def __call__(self, **kwargs):
        z = torch.zeros_like(self.log_probs)
        return SimpleNamespace(log_probs=self.log_probs, entropy=z, mean_logits=z, is_top1=z.bool())


def check_dpo_formula(checks, name, trainer, batch, ours):
    """DPOTrainer's loss code on OUR logps (reference ones as precomputed reference logps): the formulas
    alone, so within FORMULA_RTOL. TRL logs the rewards' batch means only."""
    policy = torch.cat([ours["policy_chosen_logps"], ours["policy_rejected_logps"]])
    inputs = {**batch, "ref_chosen_logps": ours["ref_chosen_logps"], "ref_rejected_logps": ours["ref_rejected_logps"]}
    trainer.precompute_ref_logps = True
    trainer._metrics["train"].clear()
    want = trainer.compute_loss(_OurLogps(policy, batch["input_ids"].shape[1] - 1), inputs).detach()
    checks.compare(f"{name} loss (TRL formula on our logps)", ours["loss"], want, FORMULA_RTOL * max(1.0, want.item()))
    for side in ("chosen", "rejected"):
        got, want = ours[f"{side}_rewards"].mean(), torch.tensor(trainer._metrics["train"][f"rewards/{side}"][-1])
        checks.compare(f"{name} mean {side} reward (TRL on our logps)", got, want,
                       FORMULA_RTOL * max(1.0, abs(got.item())))


def unpadded_logps(model, pairs, key):
    """Each sequence alone (no padding) through the plain forward: the padded batch must agree."""
    out = []
    with torch.no_grad():
        for p in pairs:
            ids = torch.tensor([p["prompt"] + p[key]])
            lp = F.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(lp[len(p["prompt"]) - 1:].sum())
    return torch.stack(out)


def dpo_loss_atol(case, loss, n_min):
    """What LOGP_ATOL on each of the 4 summed logps allows in the step loss."""
    d = 4 * LOGP_ATOL
    if case.loss == "ipo":  # mean of (x - c)^2 with x within d/n_min: <= 2 dx sqrt(L) + dx^2
        dx = d / n_min
        return 2 * dx * math.sqrt(loss) + dx * dx
    return case.beta * d  # sigmoid, cDPO and hinge are beta-Lipschitz in the margin


def check_dpo(checks, name, case, ours, adapter_dir, base_dir, workdir, pairs):
    trainer = dpo_trainer(case, base_dir, adapter_dir, workdir)
    params = adapter_params(checks, name, trainer.model, adapter_dir)
    batch = collate(checks, name, trainer.data_collator, pairs)
    seen, loss = trl_dpo_step(trainer, batch)
    n_min = min(min(len(p["chosen"]), len(p["rejected"])) for p in pairs)
    for i, side in enumerate(("chosen", "rejected")):
        pol, ref, n = ours[f"policy_{side}_logps"], ours[f"ref_{side}_logps"], counts(pairs, side)
        checks.compare(f"{name} policy {side} logps", pol, seen["policy"][i], LOGP_ATOL)
        checks.compare(f"{name} ref {side} logps", ref, seen["ref"][i], LOGP_ATOL)
        moved = (pol - ref).abs().max().item()
        checks.check(f"{name} adapter moves {side} logps", moved > 1e-2, f"max|policy - ref| {moved:.3e}")
        trl_ratio = seen["policy"][i] - seen["ref"][i]  # TRL's reward per pair: beta * this (it logs the mean)
        checks.compare(f"{name} {side} rewards", ours[f"{side}_rewards"], case.beta * trl_ratio,
                       2 * case.beta * LOGP_ATOL)
        if case.loss == "ipo":  # what IPO consumes: the log-ratio per response token
            checks.compare(f"{name} {side} log-ratio per token", (pol - ref) / n, trl_ratio / n, 2 * LOGP_ATOL / n_min)
        if name == "sigmoid":  # TRL always pads right (its collator); unpadded rows must give the same sums
            checks.compare(f"{name} TRL padded vs unpadded {side} logps", seen["policy"][i],
                           unpadded_logps(trainer.model, pairs, side), LOGP_ATOL / 10)
    checks.compare(f"{name} loss (TRL end to end)", ours["loss"], loss, dpo_loss_atol(case, loss.item(), n_min))
    compare_grads(checks, name, ours, params, GRAD_RTOL)
    check_dpo_formula(checks, name, trainer, batch, ours)


def ref_free_loss(case, ac, ar, nll):
    """TRL's own ORPO / SimPO loss methods on length-averaged logps: (step loss, rewards c, rewards r).
    The methods read only these attributes, so a namespace stands in for the trainer (a missing one raises)."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
    acc = SimpleNamespace(device=torch.device("cpu"))
    if case.loss == "orpo":
        losses, cr, rr, _, _ = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=case.beta, accelerator=acc), ac, ar)
        return nll - losses.mean(), cr, rr  # ORPO: NLL - mean(beta logsigmoid(log-odds))
    cpo = SimpleNamespace(beta=case.beta, alpha=0.0, loss_type="simpo", simpo_gamma=SIMPO_GAMMA,
                          label_smoothing=case.eps, accelerator=acc)
    losses, cr, rr = CPOTrainer.cpo_loss(cpo, ac, ar)
    return losses.mean(), cr, rr  # cpo_alpha = 0: no NLL term


def check_ref_free(checks, name, case, ours, adapter_dir, base_dir, pairs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from trl.experimental.orpo import ORPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    absent = not any(k in ours for k in ("ref_chosen_logps", "ref_rejected_logps"))
    checks.check(f"{name} writes no reference logps", absent, str(sorted(k for k in ours if "ref_" in k)))
    nc, nr, P = counts(pairs, "chosen"), counts(pairs, "rejected"), len(pairs)
    # Formulas on our logps. ORPO's NLL: TRL's covers prompt + response tokens
    # (trl/experimental/orpo/orpo_trainer.py:793-800); ours the chosen responses only, a mean over the
    # batch's chosen response tokens, i.e. -sum(pc)/sum(nc). So only the odds-ratio part is TRL's here.
    ac, ar = ours["policy_chosen_logps"] / nc, ours["policy_rejected_logps"] / nr
    want, cr, rr = ref_free_loss(case, ac, ar, -ours["policy_chosen_logps"].sum() / nc.sum())
    checks.compare(f"{name} loss (TRL formula on our logps)", ours["loss"], want,
                   FORMULA_RTOL * max(1.0, abs(want.item())))
    for side, want_r in (("chosen", cr), ("rejected", rr)):
        checks.compare(f"{name} {side} rewards (TRL on our logps)", ours[f"{side}_rewards"], want_r,
                       FORMULA_RTOL * max(1.0, want_r.abs().max().item()))
    # TRL side end to end: the adapter as peft loads it, ORPO/CPO's logits path (get_batch_logps with the
    # prompt and padding labelled -100, as their tokenize_row does, but on our ids: no BOS/EOS added).
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).train()
    params = adapter_params(checks, name, model, adapter_dir)
    batch = collate(checks, name, DataCollatorForPreference(pad_token_id=0), pairs)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    tc, tr = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True).chunk(2)
    checks.compare(f"{name} policy chosen logps", ours["policy_chosen_logps"], tc.detach() * nc, LOGP_ATOL)
    checks.compare(f"{name} policy rejected logps", ours["policy_rejected_logps"], tr.detach() * nr, LOGP_ATOL)
    nll = F.cross_entropy(logits[:P, :-1].flatten(0, 1), labels[:P, 1:].flatten(), ignore_index=-100)
    loss, _, _ = ref_free_loss(case, tc, tr, nll)
    loss.backward()
    # Averages within avg = LOGP_ATOL / n_min: SimPO is beta-Lipschitz in ac - ar; ORPO's log-odds move
    # by <= 2 avg / (1 - e^a) < 4 avg for a < -ln 2 (a ~ -ln 128 here), and its NLL by <= LOGP_ATOL.
    avg = LOGP_ATOL / min(nc.min().item(), nr.min().item())
    atol = LOGP_ATOL + 4 * case.beta * avg if case.loss == "orpo" else 2 * case.beta * avg
    checks.compare(f"{name} loss (TRL end to end)", ours["loss"], loss.detach(), atol)
    compare_grads(checks, name, ours, params, GRAD_RTOL)


def run_case(checks, tool, workdir, name, case, bases, pairs_path, pairs):
    out, base_dir = os.path.join(workdir, name), bases["moe" if case.moe else "dense"]
    cmd = [tool, "--checkpoint", base_dir, "--pairs", pairs_path, "--out", out, "--loss", case.loss,
           "--beta", case.beta, "--seed", SEED, *case.flags]
    if case.eps:
        cmd += ["--label-smoothing", case.eps]
    if case.loss == "simpo":
        cmd += ["--gamma", SIMPO_GAMMA]
    run_checked(cmd)
    ours = load_file(os.path.join(out, "result.safetensors"))
    adapter_dir = os.path.join(out, "adapter")
    if case.loss in ("orpo", "simpo"):
        check_ref_free(checks, name, case, ours, adapter_dir, base_dir, pairs)
    else:
        check_dpo(checks, name, case, ours, adapter_dir, base_dir, out, pairs)


def main():
    return trl_main(CASES, lambda args: make_inputs(args.workdir),
                    lambda checks, args, name, case, *inputs: run_case(checks, args.tool, args.workdir, name, case,
                                                                       *inputs))


if __name__ == "__main__":
    sys.exit(main())
