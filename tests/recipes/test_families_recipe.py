"""Every model family through the whole product with the real `qlora` binary: a tiny random
checkpoint written by transformers (save_pretrained, sharded; norms and biases randomised so each
one matters), NF4 base + LoRA trained by `qlora run lora_finetune`, exported, resumed and generated
from. Per family:

1. one process trains: the losses are finite and fall; 2 and 3 ranks (the same global batch of 6)
   give one process's losses and final adapter within RANKS_TOL (recipe_common.py says why);
2. the epoch export: adapter_model.safetensors holds exactly the keys (and shapes) that peft's own
   get_peft_model_state_dict gives for that family's target modules, adapter_config.json names them;
   the merged model loads in transformers with no missing, unexpected or resized tensor, holds every
   tensor of the original checkpoint, and its norms, biases and embeddings are the original's bit for
   bit (they are never quantized or trained);
3. a run SIGKILLed after step 3 (the qlora_faults seam) resumes from its step-2 checkpoint and
   finishes with the uninterrupted run's losses exactly and a byte-identical adapter (one process,
   fp32 on the CPU: the same ops in the same order);
4. `qlora generate` (greedy) on the export prints the text of transformers' greedy generate on the
   merged model (fp32, eager attention) for the same prompt ids; the smallest top-2 logit margin of
   transformers' steps is printed beside it, so a failure on a near tie can be told from a bug.

The families: qwen2 (q/k/v biases, tied embeddings, LoRA on lm_head too so the export unties it, a
byte-level BPE tokenizer.json with no BOS as Qwen ships), qwen3 (q/k norms), gemma2 (four norms,
soft-capping, query_pre_attn_scalar, alternating sliding layers), gemma3_text (q/k norms, local and
global RoPE bases), mistral (sliding_window 8 < data.max_seq_len 128), phi3 (LoRA on the fused
qkv_proj / gate_up_proj, asked for as q, k, v, gate, up), qwen3_5_text (a Gated DeltaNet layer and a gated,
partially rotary attention layer, LoRA on both mixers' projections), gemma4_text (per-layer inputs, KV
sharing, values that are the keys, a double-wide MLP). The sliding-window families and Qwen3.5 train on
packed rows, so windows meet rows holding several samples, and generate past the window (KV cache).
The Mixture-of-Experts families: qwen3_moe (8 experts, top-2 renormalised, a dense first layer by
mlp_only_layers), mixtral (4 experts, top-2, routing weights kept in fp32, sliding window, packed) and
gpt_oss (4 experts, top-2 of the biased router's logits, biases, sinks, a window, packed; fused experts only),
LoRA on q, k, v, o and the experts (lora.targets "experts": peft's target_parameters on the fused
mlp.experts.gate_up_proj and down_proj; the checkpoints hold one tensor per expert, as transformers
writes them); qwen3_5_moe_text (Qwen3.5's two mixers, every layer MoE beside a shared expert scaled by
its gate, LoRA on the mixers, the experts and the shared expert: lora.targets "shared_expert"); and gemma4_moe
(Gemma 4's enable_moe_block: a scaled router and 4 gelu-tanh experts, top-2,
beside each layer's MLP, LoRA on the MLP and the experts too, peft's experts.gate_up_proj /
experts.down_proj on the layer itself; transformers writes them fused, so the fused-layout run below
is not made for it). Beyond the checks above, for them:
5. the merged export keeps the checkpoint's per-expert (gemma4_moe: fused) tensors and its routers
   bit for bit (Gemma 4's router scales too);
6. peft itself reads the adapter: PeftModel.from_pretrained(the transformers base, the adapter) loads
   every tensor (nothing missing or unexpected), its logits equal the merged export's in transformers,
   and its merge_and_unload() equals the merged export's weights. peft merges onto the full-precision
   base, so these use the 2-rank run, exported with checkpoint.merge_from=original (the others' export
   merges onto the NF4 base that trained, the default); it also shows the ranks' shared merged export.

    python tests/recipes/test_families_recipe.py --qlora build/qlora --qlora-faults build/qlora_faults
        --workdir build/recipe_families [--families qwen2,phi3]
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

import sentencepiece
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from recipe_common import (Checks, RANKS_TOL, adapter, losses, max_diff, max_tensor_diff, recipe_args, step_rows, run_recipe,
                           safetensors_of)
from safetensors.torch import load_file as load_torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "conformance"))
from test_tokenizer_hf import QWEN2_PATTERN, train_bytelevel  # noqa: E402  (Qwen2's pre-tokenizer)

DATA = os.path.join(HERE, "..", "data")
SP_TOKENIZER = os.path.join(DATA, "tokenizer", "tokenizer.model")  # 512 pieces, <unk> 0, <s> 1, </s> 2
LAYER_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
LLAMA_PEFT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q", "k", "v", "o", "experts"]
ATTENTION_PEFT = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS_PEFT = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft's target_parameters for "experts"
# A MoE layer's router: frozen and never quantized (Mixtral's checkpoints name it block_sparse_moe.gate);
# so are Qwen3.5-MoE's shared expert's gate and gpt-oss's mlp.router. Gemma 4's is router.proj beside the layer's MLP.
ROUTER = re.compile(r"\.((mlp|block_sparse_moe)\.(gate|shared_expert_gate|router)|router\.proj)\.weight$")
# initializer_range 0.1 rather than 0.02: logits of a few units, so greedy decoding rarely meets a
# near tie that the two implementations' rounding could break apart.
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
WINDOW = 8
# Global batch 6: one process x 6 rows, 2 ranks x 3, 3 ranks x 2. Six steps, a resume checkpoint
# every two; the killed run dies after step 3 and resumes from step 2.
STEPS, GLOBAL_BATCH, SAVE_EVERY, KILL_AFTER = 6, 6, 2, 3
RUN = ["logging.progress=plain", "training.epochs=1", f"training.max_steps_per_epoch={STEPS}",
       f"checkpoint.save_every_steps={SAVE_EVERY}", "checkpoint.keep_last_n=5", "checkpoint.adapter_only=false",
       "data.max_seq_len=128", "lora.rank=8", "lora.alpha=16", "optim.warmup_steps=1"]
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
          "### Input:\n{input}\n\n### Response:\n{output}")
PROMPT, NEW_TOKENS = "Reverse the word. kite", 12  # prompt + new tokens run past WINDOW


@dataclass
class Family:
    model_type: str
    config: dict
    targets: list           # lora.targets as a config writes them
    peft_targets: list      # the module names peft targets for them
    packing: bool = False
    byte_level: bool = False  # a tokenizer.json (Qwen's kind) instead of the sentencepiece model
    peft_parameters: list = field(default_factory=list)  # peft's target_parameters (fused MoE experts)
    label: str = ""  # the family's name in messages and --families where two share a model_type
    fused: bool = False  # transformers writes its experts fused (Gemma 4): no per-expert save to compare with

    @property
    def name(self):
        return self.label or self.model_type


GEMMA = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
             layer_types=["sliding_attention", "full_attention"])
FAMILIES = [
    Family("qwen2", dict(tie_word_embeddings=True), LAYER_TARGETS + ["output"], LLAMA_PEFT + ["lm_head"],
           byte_level=True),
    Family("qwen3", dict(head_dim=16, tie_word_embeddings=False), LAYER_TARGETS, LLAMA_PEFT),
    Family("gemma2", dict(GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True),
           LAYER_TARGETS, LLAMA_PEFT, packing=True),
    Family("gemma3_text", dict(GEMMA, tie_word_embeddings=True, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), LAYER_TARGETS, LLAMA_PEFT, packing=True),
    Family("mistral", dict(sliding_window=WINDOW, tie_word_embeddings=False), LAYER_TARGETS, LLAMA_PEFT, packing=True),
    Family("phi3", dict(tie_word_embeddings=False), LAYER_TARGETS, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    # A Gated DeltaNet layer then a gated attention layer; packed rows, so the DeltaNet's state must
    # restart at every sample of a row.
    Family("qwen3_5_text", dict(head_dim=16, linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4,
                                linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
                                tie_word_embeddings=False),
           LAYER_TARGETS + ["linear_qkv", "linear_z", "linear_b", "linear_a", "linear_out"],
           LLAMA_PEFT + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"], packing=True),
    # Per-layer inputs (a table of 512 ids x 3 layers x 16), a sliding then two full layers of
    # another head_dim whose values are their keys; the last reuses the K/V of the one before it and
    # has a double-wide MLP. LoRA on the per-layer gate and projection too.
    Family("gemma4_text", dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                               num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                               sliding_window=WINDOW, num_kv_shared_layers=1, use_double_wide_mlp=True,
                               hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                               final_logit_softcapping=30.0, tie_word_embeddings=False),
           LAYER_TARGETS + ["ple_gate", "ple_proj"], LLAMA_PEFT + ["per_layer_input_gate", "per_layer_projection"],
           packing=True),
    # Mixtures of Experts: experts of width 32 (gate_up [64, 64], down [64, 32] each), top-2. Qwen3-MoE's
    # layer 0 keeps a dense MLP (intermediate_size 96), untargeted: no "gate", "up", "down" here.
    Family("qwen3_moe", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False),
           MOE_TARGETS, ATTENTION_PEFT, peft_parameters=EXPERTS_PEFT),
    Family("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW,
                           tie_word_embeddings=False),
           MOE_TARGETS, ATTENTION_PEFT, packing=True, peft_parameters=EXPERTS_PEFT),
    # Qwen3.5-MoE: qwen3_5_text's two layers, each MoE (8 experts of 32, top-2) beside a shared expert of
    # 32 scaled by its gate; LoRA on both mixers, the experts and the shared expert; packed.
    Family("qwen3_5_moe_text", dict(head_dim=16, linear_num_key_heads=2, linear_key_head_dim=16,
                                    linear_num_value_heads=4, linear_value_head_dim=16,
                                    layer_types=["linear_attention", "full_attention"], num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                    tie_word_embeddings=False),
           ["q", "k", "v", "o", "linear_qkv", "linear_z", "linear_b", "linear_a", "linear_out", "experts",
            "shared_expert"],
           ATTENTION_PEFT + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "shared_expert.gate_proj",
                             "shared_expert.up_proj", "shared_expert.down_proj"],
           packing=True, peft_parameters=EXPERTS_PEFT),
    # Gemma 4's MoE form (enable_moe_block): a router (its scale and per_expert_scale random like the
    # norms) over 4 experts of width 32, top-2, beside each layer's MLP, a sliding then a full layer;
    # transformers writes the experts fused, experts.gate_up_proj / down_proj on the layer itself.
    Family("gemma4_text", dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                               hidden_size_per_layer_input=0, final_logit_softcapping=30.0, tie_word_embeddings=False,
                               enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
           LAYER_TARGETS + ["experts"], LLAMA_PEFT, packing=True,
           peft_parameters=["experts.gate_up_proj", "experts.down_proj"], label="gemma4_moe", fused=True),
    # gpt-oss: biases, a sink per head, a window on layer 0, fused experts only (transposed, gate/up
    # interleaved). The class's clamp at 7, which these activations do not reach: one that binds makes
    # the gradient jump wherever a value crosses it, and the ranks' other order of sums tips a few
    # (1.1e-4 between the adapters at a limit of 1); conformance.families_transformers has it bind.
    Family("gpt_oss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                           sliding_window=WINDOW, tie_word_embeddings=False),
           MOE_TARGETS, ATTENTION_PEFT, packing=True, peft_parameters=EXPERTS_PEFT, fused=True),
]


class TokenizerRef:
    """The reference tokenizer of a checkpoint: ids of the prompt (with BOS where the tokenizer has
    one, as `qlora generate` encodes it), the text of generated ids, the special ids."""

    def __init__(self, family, workdir):
        if family.byte_level:
            # Trained on the samples as the alpaca template renders them: a tokenizer that never
            # saw the preamble spends data.max_seq_len on it and truncates every answer away.
            with open(os.path.join(DATA, "tiny_tasks.jsonl")) as f:
                texts = [ALPACA.format(**json.loads(line)) for line in f]
            self.path = train_bytelevel(texts, QWEN2_PATTERN, False, workdir, "qwen2_tokenizer", added=[],
                                        vocab_size=400)
            self.tok = Tokenizer.from_file(self.path)
            self.eos = self.pad = self.tok.token_to_id("<|endoftext|>")
            self.bos = None  # Qwen has no BOS
            self.vocab = self.tok.get_vocab_size()
        else:
            self.path = SP_TOKENIZER
            self.tok = sentencepiece.SentencePieceProcessor(model_file=SP_TOKENIZER)
            self.bos, self.eos, self.pad = self.tok.bos_id(), self.tok.eos_id(), 0
            self.vocab = self.tok.vocab_size()
        self.byte_level = family.byte_level

    def install(self, model_dir):
        if not self.byte_level:
            shutil.copy(self.path, os.path.join(model_dir, "tokenizer.model"))
            return
        shutil.copy(self.path, os.path.join(model_dir, "tokenizer.json"))
        with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, f)

    def prompt_ids(self, text):
        ids = self.tok.encode(text, add_special_tokens=False).ids if self.byte_level else self.tok.encode(text)
        return ([self.bos] if self.bos is not None else []) + ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False) if self.byte_level else self.tok.decode(ids)


def build_checkpoint(family, tok, out):
    """A tiny random model of the family, saved by transformers in several shards."""
    torch.manual_seed(0)
    bos = tok.bos if tok.bos is not None else tok.eos
    cfg = AutoConfig.for_model(family.model_type, vocab_size=tok.vocab, bos_token_id=bos, eos_token_id=tok.eos,
                               pad_token_id=tok.pad, **{**SIZES, **family.config})
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms (1 or 0 at init) and biases (0): random, so each one shows
                p.add_(0.1 * torch.randn_like(p))
        # from_config zeroes the pad token's embedding row (padding_idx); qwen2's pad is its EOS, which
        # the data trains on: a row a real checkpoint trained, random here too (else the run refuses
        # it, model.untrained_tokens).
        if tok.pad is not None:
            model.get_input_embeddings().weight[tok.pad].normal_(0, SIZES["initializer_range"])
    model.save_pretrained(out, max_shard_size="100KB")
    tok.install(out)
    return model


def adapter_bytes(run_dir):
    with open(os.path.join(run_dir, "epoch_0", "adapter", "adapter_model.safetensors"), "rb") as f:
        return f.read()


def check_export(check, name, family, base_dir, run_dir):
    export = os.path.join(run_dir, "epoch_0")
    # The adapter's keys as peft names them for this family's target modules. Only the LoRA
    # tensors: with lm_head targeted peft would also save the (frozen, unchanged) base head unless
    # told not to, which a QLoRA adapter has no reason to carry.
    # MoE: the experts are peft's target_parameters (its ParamWrapper on the fused 3-D tensors).
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=family.peft_targets,
                                                 target_parameters=family.peft_parameters or None))
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()}
    got = {k: tuple(v.shape) for k, v in adapter(run_dir).items()}
    check(got == want, f"{name}: adapter keys and shapes are peft's ({len(want)} tensors; "
                       f"ours only {sorted(set(got) - set(want))[:3]}, peft's only {sorted(set(want) - set(got))[:3]})")
    with open(os.path.join(export, "adapter", "adapter_config.json")) as f:
        config = json.load(f)
    targets, parameters = config["target_modules"], config.get("target_parameters") or []
    check(sorted(targets) == sorted(family.peft_targets) and parameters == sorted(family.peft_parameters),
          f"{name}: adapter_config target_modules {sorted(targets)}, target_parameters {parameters}")

    merged, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager",
                                                        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    check(not bad, f"{name}: transformers loads the merged model with nothing missing, unexpected or resized {bad}")
    original, exported = safetensors_of(base_dir), safetensors_of(export)
    missing = sorted(set(original) - set(exported))
    check(not missing and all(exported[k].shape == original[k].shape for k in original),
          f"{name}: the merged export holds every tensor of the original ({len(original)}; missing {missing[:4]})")
    frozen = [k for k in original if original[k].dim() == 1 or k == "model.embed_tokens.weight" or ROUTER.search(k)]
    changed = [k for k in frozen if k in exported and not torch.equal(exported[k].float(), original[k])]
    kinds = sorted({re.sub(r"model\.layers\.\d+\.", "", k) for k in frozen})
    check(not changed, f"{name}: {len(frozen)} norms, biases{', routers' if family.peft_parameters else ''} and "
                       f"embeddings equal the original's ({', '.join(kinds)}); changed: {changed[:4]}")
    if family.peft_parameters:
        # The checkpoint holds one tensor per expert and projection (what transformers writes); the
        # export keeps that layout (same keys, shapes and dtypes), not transformers' fused in-memory one.
        experts = sorted(k for k in original if ".experts." in k)
        ours = sorted(k for k in exported if ".experts." in k)
        check(experts and ours == experts and all(exported[k].dtype == original[k].dtype for k in experts),
              f"{name}: the merged export holds the checkpoint's {len(experts)} per-expert tensors "
              f"({experts[0] if experts else None}, ...) and no others; ours only {sorted(set(ours) - set(experts))[:3]}")
    return merged


# peft's forward folds each expert's adapter into its weight in the parameter's dtype (fp32 here:
# baddbmm, W + s * B_e @ A_e) and runs the experts on that, while the attention projections add
# s * (x @ A^T) @ B^T to x @ W^T; the merged export holds W + s * B @ A as qlora computes it, and
# transformers runs it unfolded. The same values in another order of fp32 operations: the logits
# differ by a few roundings (~1e-7 of the largest logit per operation, through 2 layers), the merged
# weights by at most a rounding of each sum. The adapters' own effect on the logits and on each
# adapted tensor is checked to be far larger than these tolerances, so equality within them means
# the adapters are read as qlora trained them.
PEFT_LOGITS_TOL = 1e-5  # of the largest logit
PEFT_MERGE_TOL = 1e-6   # of each tensor's largest entry


def check_peft(check, name, family, base_dir, run_dir, ids):
    """peft reads our adapter: PeftModel.from_pretrained on the transformers base loads every tensor,
    gives the merged export's logits, and its merge_and_unload() gives the merged export's weights
    (run_dir exported with checkpoint.merge_from=original: peft merges onto the full-precision base)."""
    adapter_dir = os.path.join(run_dir, "epoch_0", "adapter")
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load(base_dir), adapter_dir)
    warned = [str(w.message)[:200] for w in caught if "missing adapter keys" in str(w.message)]
    # from_pretrained warns about missing adapter keys only; loading the file once more returns what
    # load_state_dict saw, unexpected keys too (the same values: nothing changes).
    file = load_torch(os.path.join(adapter_dir, "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, file)
    missing = [k for k in result.missing_keys if "lora_" in k]
    loaded = [n for n, _ in model.named_parameters() if "lora_" in n]
    config = model.peft_config["default"]
    check(not warned and not missing and not result.unexpected_keys and len(loaded) == len(file)
          and sorted(config.target_parameters or []) == sorted(family.peft_parameters),
          f"{name}: PeftModel.from_pretrained loads the adapter's {len(file)} tensors into {len(loaded)} LoRA "
          f"parameters (target_parameters {sorted(config.target_parameters or [])}); missing {missing[:3]} {warned[:1]}, "
          f"unexpected {result.unexpected_keys[:3]}")

    merged, original = load(os.path.join(run_dir, "epoch_0")), load(base_dir)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        theirs, ours, before = model(tokens).logits, merged(tokens).logits, original(tokens).logits
    scale = float(ours.abs().max())
    d, effect = float((theirs - ours).abs().max()) / scale, float((before - ours).abs().max()) / scale
    check(d < PEFT_LOGITS_TOL and effect > 100 * PEFT_LOGITS_TOL,
          f"{name}: peft's logits equal the merged export's in transformers ({len(ids)} tokens, fp32): "
          f"{d:.1e} < {PEFT_LOGITS_TOL} of the largest logit; the adapters move them {effect:.1e}")

    unloaded = model.merge_and_unload().state_dict()
    mine, base = merged.state_dict(), original.state_dict()
    worst, moved, adapted = 0.0, float("inf"), []
    for k in sorted(mine):
        if k not in unloaded or unloaded[k].shape != mine[k].shape:
            worst = float("inf")
            continue
        size = float(mine[k].abs().max()) or 1.0
        worst = max(worst, float((unloaded[k] - mine[k]).abs().max()) / size)
        if not torch.equal(unloaded[k], base[k]):
            adapted.append(re.sub(r"model\.layers\.\d+\.", "", k))
            moved = min(moved, float((unloaded[k] - base[k]).abs().max()) / size)
    kinds = sorted(set(adapted))
    check(unloaded.keys() == mine.keys() and worst < PEFT_MERGE_TOL and moved > 100 * PEFT_MERGE_TOL
          and any("experts." in k for k in kinds),  # mlp.experts.* (Gemma 4: experts.* on the layer)
          f"{name}: peft's merge_and_unload() equals the merged export's weights ({len(mine)} tensors): "
          f"{worst:.1e} < {PEFT_MERGE_TOL} of each one's largest; the {len(adapted)} adapted ({', '.join(kinds)}) "
          f"moved at least {moved:.1e}")


def check_generate(check, name, qlora, tok, merged, export):
    r = subprocess.run([qlora, "generate", "--checkpoint", export, "--prompt", PROMPT, "--max-new-tokens",
                        str(NEW_TOKENS), "--device", "cpu"], capture_output=True, text=True, encoding="utf-8",
                       errors="surrogateescape")  # bytes that are not UTF-8 compare unequal, not crash
    n = re.search(r"(\d+) new tokens", r.stderr)
    if not check(r.returncode == 0 and n and int(n.group(1)) > 0,
                 f"{name}: qlora generate runs and produces tokens ({r.stderr.strip()[-300:]})"):
        return
    ids = tok.prompt_ids(PROMPT)
    with torch.no_grad():  # the checkpoint's config.json names tok.eos as its EOS too: one stop id
        g = merged.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos, pad_token_id=tok.pad,
                            output_scores=True, return_dict_in_generate=True)
    new = g.sequences[0, len(ids):].tolist()
    margin = min(float(top[0] - top[1]) for top in (step[0].topk(2).values for step in g.scores))
    text_ids = new[:-1] if new and new[-1] == tok.eos else new
    ours = r.stdout[:-1] if r.stdout.endswith("\n") else r.stdout
    ref = tok.decode(text_ids)
    prompt_len = re.search(r"(\d+) prompt tokens", r.stderr)
    check(ours == ref and int(n.group(1)) == len(new) and prompt_len and int(prompt_len.group(1)) == len(ids),
          f"{name}: qlora generate equals transformers' greedy generate ({len(ids)} prompt and {len(new)} new "
          f"tokens, smallest top-2 margin {margin:.2e}): {ours!r} vs {ref!r}")


def check_fused_layout(check, name, a, tok, base_model, work, common, one):
    """The same base saved with fused 3-D experts (save_original_format=False) trains to the same
    losses and adapter bytes, and its merged export keeps the fused layout, each expert's gate_up the
    per-expert export's gate over up and its down the same, bit for bit (both merge each expert into
    the NF4 of its [2 * inter, hidden] matrix)."""
    fused_base = os.path.join(work, "base_fused")
    base_model.save_pretrained(fused_base, max_shard_size="100KB", save_original_format=False)
    tok.install(fused_base)
    out = os.path.join(work, "fused")
    r = run_recipe(a.qlora, out, *common, f"model.checkpoint_dir={fused_base}", f"training.batch_size={GLOBAL_BATCH}")
    if not check(r.returncode == 0, f"{name}: trains from fused experts"):
        return
    check(losses(out) == losses(one) and adapter_bytes(out) == adapter_bytes(one),
          f"{name}: fused experts give the per-expert checkpoint's losses and adapter bit for bit")
    fused, split = safetensors_of(os.path.join(out, "epoch_0")), safetensors_of(os.path.join(one, "epoch_0"))
    stacks = sorted(k for k in fused if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"))
    same = bool(stacks)
    for k in stacks:
        prefix = k.rsplit(".experts.", 1)[0].replace(".mlp", ".block_sparse_moe" if name == "mixtral" else ".mlp")
        names = (("w1", "w3") if name == "mixtral" else ("gate_proj", "up_proj")) if k.endswith("gate_up_proj") \
            else (("w2",) if name == "mixtral" else ("down_proj",))
        for e in range(fused[k].shape[0]):
            want = torch.cat([split[f"{prefix}.experts.{e}.{n}.weight"] for n in names])
            same = same and torch.equal(fused[k][e], want)
    check(same and not any(".experts.0." in k for k in fused),
          f"{name}: the fused run's merged export is fused ({len(stacks)} stacks), each expert equal to the "
          f"per-expert export's")


def check_router_metrics(check, name, family, run_dir):
    """Each step's line holds, for each MoE layer (and no dense one), the busiest expert's tokens over
    the mean, in [1, experts] (above 1 unless perfectly even), and the experts that got no token."""
    cfg = AutoConfig.from_pretrained(os.path.join(run_dir, "epoch_0"))
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    rows = step_rows(run_dir)
    keys = sorted({k for row in rows for k in row if k.startswith("router/")})
    want = sorted(f"router/layer{i}/{m}" for i in range(cfg.num_hidden_layers) if i not in dense
                  for m in ("max_over_mean", "unused_experts"))
    ratios = [row[k] for row in rows for k in row if k.endswith("/max_over_mean")]
    unused = [row[k] for row in rows for k in row if k.endswith("/unused_experts")]
    check(keys == want and all(1.0 <= r <= experts for r in ratios) and max(ratios) > 1.0
          and all(0 <= u < experts for u in unused),
          f"{name}: metrics.jsonl's router statistics {keys}: max/mean in [{min(ratios):.2f}, {max(ratios):.2f}], "
          f"unused experts {min(unused)}..{max(unused)} of {experts}")


def family_checks(check, a, family):
    name = family.name
    work = os.path.join(a.workdir, name)
    os.makedirs(work)
    tok = TokenizerRef(family, work)
    base_dir = os.path.join(work, "base")
    base_model = build_checkpoint(family, tok, base_dir)
    common = [*RUN, f"model.checkpoint_dir={base_dir}", f"data.packing={str(family.packing).lower()}",
              "lora.targets=[" + ",".join(f'"{t}"' for t in family.targets) + "]"]

    # 1. one process, then 2 and 3 ranks on the same global batch
    one = os.path.join(work, "one")
    r = run_recipe(a.qlora, one, *common, f"training.batch_size={GLOBAL_BATCH}")
    if not check(r.returncode == 0, f"{name}: one process trains"):
        return
    ref = losses(one)
    tokens = [row["tokens"] for row in step_rows(one)]
    check(len(ref) == STEPS and all(math.isfinite(x) for x in ref) and ref[-1] < ref[0] and min(tokens) > 0,
          f"{name}: {len(ref)} finite losses that fall ({ref[0]:.4f} -> {ref[-1]:.4f}), label tokens {tokens}")
    ref_adapter = adapter(one)
    if family.peft_parameters:
        check_router_metrics(check, name, family, one)
        if not family.fused:
            check_fused_layout(check, name, a, tok, base_model, work, common, one)
    peft_run = None  # MoE: the 2-rank run, merged from the original weights for peft's checks (docstring, 6)
    for nproc in (2, 3):
        out = os.path.join(work, f"ranks{nproc}")
        merge = ["checkpoint.merge_from=original"] if family.peft_parameters and nproc == 2 else []
        r = run_recipe(a.qlora, out, *common, *merge, f"training.batch_size={GLOBAL_BATCH // nproc}", nproc=nproc)
        if not check(r.returncode == 0, f"{name}: {nproc} ranks train"):
            continue
        if merge:
            peft_run = out
        dl, da = max_diff(losses(out), ref), max_tensor_diff(adapter(out), ref_adapter)
        check(dl < RANKS_TOL and da < RANKS_TOL,
              f"{name}: {nproc} ranks give one process's losses and adapter within {RANKS_TOL} ({dl:.1e}, {da:.1e})")

    # 2. the export (and, for MoE, peft's reading of it)
    merged = check_export(check, name, family, base_dir, one)
    if peft_run:
        with open(os.path.join(DATA, "tiny_tasks.jsonl")) as f:
            sample = json.loads(f.readline())
        check_peft(check, name, family, base_dir, peft_run, tok.prompt_ids(ALPACA.format(**sample)))

    # 3. killed after step 3, resumed
    killed = os.path.join(work, "killed")
    r = run_recipe(a.qlora_faults, killed, *common, f"training.batch_size={GLOBAL_BATCH}",
                   fault=f"kill_after_step={KILL_AFTER}", expect_rc=-9)
    check(r.returncode == -9, f"{name}: the run dies by SIGKILL after step {KILL_AFTER}")
    r = run_recipe(a.qlora, killed, *common, f"training.batch_size={GLOBAL_BATCH}", "checkpoint.resume=true")
    resumed_at = f"step_{KILL_AFTER - KILL_AFTER % SAVE_EVERY:08d}"  # the newest checkpoint before the kill
    if check(r.returncode == 0 and "resumed from" in r.stdout and resumed_at in r.stdout,
             f"{name}: the killed run resumes from {resumed_at}"):
        same = adapter_bytes(killed) == adapter_bytes(one)
        check(losses(killed) == ref and same,
              f"{name}: resumed losses equal the uninterrupted run's exactly, adapter byte-identical ({same})")

    # 4. generation
    check_generate(check, name, a.qlora, tok, merged, os.path.join(one, "epoch_0"))


def main():
    a = recipe_args(("--families", dict(default="", help="comma-separated model_types (default: all)")))
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' and peft's deprecations
    chosen = [f for f in FAMILIES if not a.families or f.name in a.families.split(",")]
    check = Checks()
    for family in chosen:
        family_checks(check, a, family)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
