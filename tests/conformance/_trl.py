"""What the TRL conformance tests (test_dpo_trl.py, test_grpo_trl.py) share.

  trl_missing     why TRL cannot be imported (the test then exits SKIP), or None
  tiny_base       a tiny fp32 LlamaForCausalLM saved as an HF directory
  tiny_moe_base   a tiny fp32 Qwen3MoeForCausalLM the same way (LoRA on its experts: MOE_TARGETS)
  tiny_tokenizer  a word-level tokenizer over its 128 ids (pad t0, eos t1), built here, never downloaded
  trl_lora_config our adapter's LoraConfig, trainable, for a trainer's peft_config
  load_adapter_weights  our adapter's tensors into a peft model
  adapter_params  {adapter file key: parameter} of a peft model, after checking it holds our adapter
  compare_grads   every grad.<key> a tool wrote against the reference parameters' .grad
  trl_main        the test's main over its cases
"""
import math
import os
import warnings

import torch
from safetensors.torch import load_file

from _common import randomize_norms

# transformers 5.23 deprecates TrainingArguments.gradient_checkpointing, which TRL's configs still set.
warnings.filterwarnings("ignore", category=FutureWarning, message=".*gradient_checkpointing.*")

# ctest's SKIP_RETURN_CODE: TRL is absent only where no registry can install it (the GPU image,
# docs/gpu.md); setup installs it everywhere else (requirements-test.txt, setup.sh --tests), so there the test runs.
SKIP = 77
VOCAB = 128


def trl_missing():
    try:
        import datasets
        import trl  # noqa: F401
    except ImportError as e:
        return f"SKIP: TRL is not installed here ({e}); scripts/setup.sh --tests installs it from requirements-test.txt"
    datasets.disable_progress_bars()
    return None


def tiny_base(workdir, seed):
    """Two layers, GQA, untied head, random norms; returns its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM
    base_dir = os.path.join(workdir, "base")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    randomize_norms(model, seed)
    model.save_pretrained(base_dir)
    return base_dir


# LoRA on the attention and on every expert (peft's target_parameters on the fused expert tensors).
MOE_TARGETS = "q_proj,k_proj,v_proj,o_proj,experts"


def tiny_moe_base(workdir, seed):
    """Two layers of 4 experts (width 32), 2 a token, the class's default: top-k not renormalised. BOS 1
    and EOS 2 as tiny_base's (LlamaConfig's defaults), so both have the same stop tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    base_dir = os.path.join(workdir, "base_moe")
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    randomize_norms(model, seed)
    model.save_pretrained(base_dir)
    return base_dir


def tiny_tokenizer():
    """TRL's trainers insist on a tokenizer (pad/eos in its vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def trl_lora_config(adapter_dir):
    """Our adapter's config as a trainer's peft_config: TRL then makes a fresh adapter, whose
    reference is the base with adapters disabled (as ours); load_adapter_weights puts ours in it."""
    from peft import LoraConfig
    lora = LoraConfig.from_pretrained(adapter_dir)
    lora.inference_mode = False
    return lora


def load_adapter_weights(model, adapter_dir):
    from peft import set_peft_model_state_dict
    set_peft_model_state_dict(model, load_file(os.path.join(adapter_dir, "adapter_model.safetensors")))


def adapter_params(checks, name, model, adapter_dir):
    """{adapter file key: parameter}, after checking the model holds exactly the file's tensors."""
    from peft import get_peft_model_state_dict
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    state = get_peft_model_state_dict(model)
    same = state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    checks.check(f"{name} TRL-side model holds our adapter", same, f"{len(saved)} tensors")
    by_storage = {p.data_ptr(): p for p in model.parameters()}
    return {k: by_storage[v.data_ptr()] for k, v in state.items()}


def compare_grads(checks, name, ours, params, rtol):
    """Every grad.<key> against d(TRL's loss)/d(param), each within rtol of its largest entry."""
    keys = sorted(k[len("grad."):] for k in ours if k.startswith("grad."))
    if not checks.check(f"{name} one grad per adapter tensor", keys == sorted(params), f"{len(keys)} grads"):
        return
    refs = {k: params[k].grad if params[k].grad is not None else torch.zeros_like(params[k]) for k in keys}
    rel = {k: (ours["grad." + k] - g).abs().max().item() / max(g.abs().max().item(), 1e-12) for k, g in refs.items()}
    where = max(keys, key=lambda k: rel[k] if math.isfinite(rel[k]) else math.inf)
    largest = max(g.abs().max().item() for g in refs.values())
    checks.check(f"{name} LoRA gradients", math.isfinite(rel[where]) and rel[where] <= rtol and largest > 0,
                 f"worst max|diff|/max|ref| {rel[where]:.2e} at {where} (rtol {rtol:g}, max|grad| {largest:.3e})")


def trl_main(cases, setup, run_case):
    """A TRL conformance test's main: SKIP without TRL; else inputs = setup(args), then
    run_case(checks, args, name, case, *inputs) for each case, a crash failing that case alone."""
    from _common import Checks, parse_tool_args
    missing = trl_missing()
    if missing:
        print(missing)
        return SKIP
    args = parse_tool_args()
    checks = Checks()
    inputs = setup(args)
    for name, case in cases.items():
        try:
            run_case(checks, args, name, case, *inputs)
        except Exception as e:
            checks.crashed(name, e)
    return checks.summary()
