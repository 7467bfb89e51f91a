#!/usr/bin/env python3
"""The peer of bench/bench_moe_layer.cpp: one Qwen3-MoE decoder layer as users train it without
qlora, in a fresh process. transformers' Qwen3MoeDecoderLayer (Qwen3MoeAttention with its q/k norms,
then Qwen3MoeSparseMoeBlock: the top-k router and Qwen3MoeExperts) in bf16, with the
implementations a model built by from_pretrained picks by default: attention "sdpa", experts
"grouped_mm" (torch.nn.functional.grouped_mm on the CPU from torch 2.10), set on the config since a
bare layer gets no dispatch; peft LoRA on q/k/v/o_proj (target_modules) and on the fused expert
parameters mlp.experts.gate_up_proj and mlp.experts.down_proj (target_parameters), r and alpha as
given, peft's defaults otherwise (its Linear adapters autocast to fp32, the expert adapters folded
into the bf16 stack by one baddbmm per parameter each forward). Forward + backward of a random
output gradient into the input and the adapters, batch 1.

The router weight, the input and the output gradient are drawn as the C++ worker draws them
(random_llama.h's seeded_randn: torch.Generator().manual_seed(seed), randn fp32, then scaled and
rounded to bf16), so both sides route the same tokens with the same router; the other weights are
random (the step's cost does not depend on them). Memory: the first step's peak RSS over the RSS
before it (VmHWM reset just before, /proc/self/clear_refs, as the C++ worker does; peak_rss.py's
reader); then the median of --reps timed steps after one untimed one. Prints one JSON object on its
last line.

    moe_peer.py --seq 512 [--hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 --experts 128
                --top-k 8 --inter 768 --r 8 --alpha 16 --reps 3 --threads N ...]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_rss import peak_rss_bytes  # noqa: E402


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def reset_peak():
    """Starts VmHWM again from the current RSS (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def seeded_randn(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def counts_stats(counts):
    c = counts.double()
    mean = c.mean().item()
    return {"per_expert": [int(v) for v in counts.tolist()], "min": int(c.min().item()), "max": int(c.max().item()),
            "mean": mean, "std": c.std(unbiased=False).item(), "max_over_mean": c.max().item() / mean,
            "experts_used": int((c > 0).sum().item()), "experts_unused": int((c == 0).sum().item())}


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("seq", 512), ("hidden", 2048), ("heads", 32), ("kv-heads", 4), ("head-dim", 128),
                          ("experts", 128), ("top-k", 8), ("inter", 768), ("r", 8), ("reps", 3), ("threads", 0),
                          ("router-seed", 0), ("input-seed", 0), ("grad-seed", 0)):
        ap.add_argument("--" + name, type=int, default=default)
    for name, default in (("alpha", 16.0), ("router-std", 0.02), ("rope-theta", 1e6), ("eps", 1e-6)):
        ap.add_argument("--" + name, type=float, default=default)
    ap.add_argument("--norm-topk-prob", type=int, default=1)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers.integrations import moe as hf_moe
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    dt = torch.bfloat16
    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=a.hidden, intermediate_size=6144, num_hidden_layers=1,
                            num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                            rms_norm_eps=a.eps, num_experts=a.experts, num_experts_per_tok=a.top_k,
                            moe_intermediate_size=a.inter, norm_topk_prob=bool(a.norm_topk_prob),
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                            rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta})
    # What PreTrainedModel picks when nothing is requested (get_correct_attn/experts_implementation).
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"

    rss_start = rss_bytes()
    # Built in bf16 directly (no fp32 copy of the 1.2 GB expert stack), drawn in place.
    torch.manual_seed(0)
    torch.set_default_dtype(dt)
    layer = Qwen3MoeDecoderLayer(config, 0)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("_norm.weight"):
                p.fill_(1.0)
            elif name == "mlp.gate.weight":
                p.copy_(seeded_randn(p.shape, a.router_seed).mul_(a.router_std).to(dt))
            else:
                p.normal_(0.0, 0.02)
    base_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    base_bytes_by = {
        "experts": sum(p.numel() * p.element_size() for p in layer.mlp.experts.parameters()),
        "router": layer.mlp.gate.weight.numel() * layer.mlp.gate.weight.element_size(),
        "attention": sum(p.numel() * p.element_size() for p in layer.self_attn.parameters()),
    }
    lcfg = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(layer, lcfg)
    lora = [p for p in model.parameters() if p.requires_grad]
    lora_bytes = sum(p.numel() * p.element_size() for p in lora)
    lora_dtypes = sorted({str(p.dtype).replace("torch.", "") for p in lora})

    counts = []
    router = layer.mlp.gate  # Qwen3MoeTopKRouter: (logits, weights, indices)
    router.register_forward_hook(lambda m, i, o: counts.append(torch.bincount(o[2].reshape(-1), minlength=a.experts)))
    grouped_mm_used = []
    orig_can = hf_moe._can_use_grouped_mm

    def can_use(*args, **kwargs):
        ok = orig_can(*args, **kwargs)
        grouped_mm_used.append(ok)
        return ok

    hf_moe._can_use_grouped_mm = can_use

    T = a.seq
    x = seeded_randn((1, T, a.hidden), a.input_seed).to(dt)
    dy = seeded_randn((1, T, a.hidden), a.grad_seed).to(dt)
    position_ids = torch.arange(T).unsqueeze(0)
    cos, sin = Qwen3MoeRotaryEmbedding(config)(x, position_ids)
    model.train()

    def step():
        t0 = time.perf_counter()
        h = x.detach().requires_grad_()
        y = model(h, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
        y.backward(dy)
        for p in lora:
            p.grad = None
        return time.perf_counter() - t0

    rss0 = rss_bytes()
    hwm_reset = reset_peak()
    first = step()
    peak = peak_rss_bytes() - rss0
    peak_total = peak_rss_bytes()
    hf_moe._can_use_grouped_mm = orig_can
    step()
    times = [step() for _ in range(a.reps)]
    print(json.dumps({
        "impl": "transformers Qwen3MoeDecoderLayer (sdpa, grouped_mm experts) bf16 + peft LoRA "
                "(target_modules q/k/v/o_proj, target_parameters mlp.experts.gate_up_proj/down_proj)",
        "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "experts_implementation": config._experts_implementation,
        "grouped_mm_kernel": bool(grouped_mm_used) and all(grouped_mm_used),
        "attn_implementation": config._attn_implementation, "lora_dtypes": lora_dtypes,
        "first_step_s": first, "fwd_bwd_s": statistics.median(times) if times else first, "times_s": times,
        "peak_rss_delta_bytes": peak, "peak_rss_bytes": peak_total, "rss_before_step_bytes": rss0,
        "rss_process_start_bytes": rss_start, "hwm_reset": hwm_reset,
        "weights_bytes": base_bytes, "weights_bytes_by_part": base_bytes_by, "lora_bytes": lora_bytes,
        "tokens_per_expert": counts_stats(counts[0]),
    }))


if __name__ == "__main__":
    main()
