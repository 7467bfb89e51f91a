"""The second peer for bench_train_step: the stack most QLoRA users run, transformers'
LlamaForCausalLM with a peft LoRA adapter, on a torchao NF4 base. Each frozen decoder projection
(q,k,v,o,gate,up,down) keeps its nn.Linear but its weight becomes a frozen torchao NF4 tensor of the
checkpoint's bf16 values, as torchtune and torchao quantize an HF model; nn.Linear's F.linear then
reaches torchao's linear_nf4 through the NF4 tensor's __torch_function__, so the base is never kept
dequantized. peft wraps those Linears with LoRA (r, alpha, no dropout; fp32 adapters, B = 0) and A
set to the draws the other sides make. The loss is the model's own (labels in, HF's cross-entropy
over whole fp32 logits); bf16 runs under torch.autocast as the HF Trainer's bf16=True does.

Why torchao NF4 and not bitsandbytes 4-bit: bitsandbytes is not installed here, its 4-bit matmul
needs a GPU (no CPU path to check in CI), and its quantization differs from torchao's to_nf4 (no
double quantization by default, other rounding), so its first loss would not equal the others'.

Two modes, as bench/peer_train_step.py (whose loading, draws, timing and JSON this reuses):
  --model DIR   the CPU mode: AutoModel-style from_pretrained(DIR) in bf16, NF4 projections, the
                rest in --dtype; adapters' A drawn as peer_train_step.py draws them.
  --spec FILE   the device mode: the seeded model FILE describes (bench/random_llama.h), built on
                --device; HF's gradient checkpointing (non-reentrant) with --ac.
"""
import argparse
import json

import torch
from peft import LoraConfig, get_peft_model
from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
from transformers import LlamaConfig, LlamaForCausalLM

import peer_train_step as peer


def projection(layer, name):
    """A decoder layer's nn.Linear by its PEFT name (q_proj ... down_proj)."""
    return getattr(layer.self_attn if name in peer.PROJ[:4] else layer.mlp, name)


def frozen(t):
    return torch.nn.Parameter(t, requires_grad=False)


def quantize_projections(model, dtype):
    """NF4 of each loaded bf16 projection (exactly what to_nf4 gets on the other sides); every other
    weight (embedding, norms, head) cast to the compute dtype."""
    for layer in model.model.layers:
        for n in peer.PROJ:
            lin = projection(layer, n)
            lin.weight = frozen(to_nf4(lin.weight.detach().to(torch.bfloat16)))
    for p in model.parameters():
        if not isinstance(p, NF4Tensor):
            p.data = p.data.to(dtype)


def add_lora(model, r, alpha, names, lora_a):
    """peft LoRA on `names` (B = 0 as peft initialises it), then each A set to lora_a(layer, j, r,
    in) so that every side starts from the same adapters. Adapters stay fp32 (peft's
    autocast_adapter_dtype casts the bf16 it would copy from the base's dtype back up)."""
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=names, bias="none",
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    with torch.no_grad():
        for i, layer in enumerate(model.base_model.model.model.layers):
            for j, n in enumerate(names):
                lin = projection(layer, n)
                lin.lora_A["default"].weight.copy_(lora_a(i, j, r, lin.in_features))
    for n, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise RuntimeError(f"adapter {n} is {p.dtype}, not fp32 as on the other sides")
    return model


def spec_config(spec):
    """The LlamaConfig of a seeded spec (untied head, no biases: check_seeded_family's layout)."""
    shapes = {p["name"]: p["shape"] for p in spec["projections"]}
    return LlamaConfig(hidden_size=spec["hidden"], intermediate_size=shapes["gate_proj"][0],
                       num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                       num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"], vocab_size=spec["vocab"],
                       rms_norm_eps=spec["rms_norm_eps"], tie_word_embeddings=False, attention_bias=False,
                       mlp_bias=False, attn_implementation="sdpa")


def seeded_hf_model(spec, device, dtype):
    """LlamaForCausalLM built on the meta device, then given the seeded weights in the seed order
    (embedding, each layer's projections, lm_head), NF4 projections quantized from them on
    `device`: the bf16 model is never whole in memory, as it is not on the other sides."""
    shape, weight, lora_a = peer.seeded_draws(spec, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(spec_config(spec))
    h = spec["hidden"]
    model.model.embed_tokens.weight = frozen(weight("embed", -1, "embed_tokens", [spec["vocab"], h]).to(dtype))
    for i, layer in enumerate(model.model.layers):
        for n, s in shape["projections"]:
            projection(layer, n).weight = frozen(to_nf4(weight("proj", i, n, s)))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight = frozen(torch.ones(h, dtype=dtype, device=device))
    model.model.norm.weight = frozen(torch.ones(h, dtype=dtype, device=device))
    model.lm_head.weight = frozen(weight("lm_head", -1, "lm_head", [spec["vocab"], h]).to(dtype))
    # The spec's inverse frequencies have any RoPE scaling (llama3's) applied already: the buffer
    # HF would compute from the same config's rope_parameters.
    rope = model.model.rotary_emb
    rope.inv_freq = shape["inv_freq"].to(device)
    rope.original_inv_freq = rope.inv_freq.clone()
    return model, lora_a


def model_loss(model, autocast, device):
    """The loss as an HF user gets it: labels through the model. The labels are already shifted
    (the same tokens as the other sides), so they go in as shift_labels, as the HF Trainer passes
    them when its collator shifted them (contiguous: HF views them flat)."""
    def loss(inp, labels):
        labels = labels.contiguous()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=inp, labels=labels, shift_labels=labels, use_cache=False).loss
    return loss


def build(a, device):
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    if a.spec:
        with open(a.spec) as f:
            spec = json.load(f)
        model, lora_a = seeded_hf_model(spec, device, dtype)
        r, alpha, names = spec["lora_r"], spec["lora_alpha"], [p["name"] for p in spec["projections"]]
        if a.ac:  # as TrainingArguments(gradient_checkpointing=True, use_reentrant=False)
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
            if enable:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="sdpa")
        quantize_projections(model, dtype)
        # peer_train_step.py's CPU mode draws its adapters' A from this seed, layer by layer; drawn
        # here, before peft's own draws move the generator on.
        torch.manual_seed(0)
        draws = [[peer.kaiming_lora_a(a.r, projection(layer, n).in_features, device) for n in peer.PROJ]
                 for layer in model.model.layers]
        lora_a = lambda i, j, r, n_in: draws[i][j]  # noqa: E731
        r, alpha, names = a.r, a.alpha, peer.PROJ
    model = add_lora(model, r, alpha, names, lora_a)
    model.train()
    return model_loss(model, a.dtype == "bf16", device), model, model.config.vocab_size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="the CPU mode: this HF checkpoint (peer_train_step.py --write-model)")
    ap.add_argument("--spec", help="the device mode: the seeded model this JSON describes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="eager", choices=["eager"])
    ap.add_argument("--ac", action="store_true", help="HF gradient checkpointing per decoder layer")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--trace", help="one more step traced into this Chrome trace")
    # The CPU mode's shape flags, which bench_train_step passes to both peers: the checkpoint's
    # config.json has the shape.
    for flag in ["--hidden", "--inter", "--layers", "--heads", "--vocab"]:
        ap.add_argument(flag, type=int)
    a = ap.parse_args()
    if bool(a.model) == bool(a.spec):
        ap.error("give --model DIR or --spec FILE")
    device = torch.device("cpu" if a.model else a.device)
    figures = peer.measure(a, device, lambda: build(a, device))
    import peft
    import transformers
    print(json.dumps(dict({
        "impl": "transformers LlamaForCausalLM + peft LoRA + torchao NF4 (peer)", "mode": a.mode,
        "transformers_version": transformers.__version__, "peft_version": peft.__version__,
        "compute_dtype": a.dtype, "compute": "torch.autocast bfloat16" if a.dtype == "bf16" else "fp32",
        "activation_checkpointing": bool(a.spec and a.ac), "attention": "sdpa",
        "loss": "the model's (labels in), whole fp32 logits"}, **figures)))


if __name__ == "__main__":
    main()
