"""The peer for bench_train_step: one QLoRA training step in plain PyTorch + torchao, the way
torchtune builds it (torchtune is not installed, so this is the minimal equivalent): frozen base
projections as torchao NF4 tensors used through torchao's linear_nf4, fp32 LoRA adapters on
q,k,v,o,gate,up,down (peft/torchtune LoRALinear math), RMSNorm, rotate-half RoPE, SDPA causal
attention, SwiGLU, cross-entropy on shifted labels, torch.optim.AdamW.

--dtype bf16: the frozen tensors (embedding, norms, head) stay bf16 as the checkpoint has them and
the forward runs under torch.autocast("cpu", dtype=torch.bfloat16), as a bf16 QLoRA run on a GPU
does: bf16 GEMMs (oneDNN, fp32 accumulation), the loss in fp32, fp32 adapters, gradients and AdamW.

Two modes, both called by bench_train_step:
  --write-model DIR   write random bf16 weights + config.json as an HF checkpoint (done once; the
                      C++ side loads the same files with load_llama(base_in_nf4=true))
  --model DIR         load DIR, run a warm-up step then --steps timed steps, print one JSON
                      object with tokens/s and this process's peak RSS (VmHWM).
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torchao.dtypes.nf4tensor import linear_nf4, to_nf4

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def vm_hwm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def write_model(a):
    h, inter, v, L = a.hidden, a.inter, a.vocab, a.layers
    g = torch.Generator().manual_seed(0)
    std = 0.02

    def w(*shape):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": w(v, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for n in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            t[p + "self_attn." + n + ".weight"] = w(h, h)
        t[p + "mlp.gate_proj.weight"] = w(inter, h)
        t[p + "mlp.up_proj.weight"] = w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter)
    os.makedirs(a.write_model, exist_ok=True)
    save_file(t, os.path.join(a.write_model, "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": L,
           "num_attention_heads": a.heads, "num_key_value_heads": a.heads, "vocab_size": v,
           "max_position_embeddings": max(2048, a.seq), "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    with open(os.path.join(a.write_model, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


class LoRALinear(torch.nn.Module):
    """Frozen NF4 base + fp32 adapter; the LoRA path in fp32 like peft (x cast to the adapter dtype)."""

    def __init__(self, weight_bf16, r, alpha):
        super().__init__()
        out_f, in_f = weight_bf16.shape
        self.weight = to_nf4(weight_bf16)  # frozen, never a Parameter
        self.lora_a = torch.nn.Parameter(torch.empty(r, in_f))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_f, r))
        self.scale = alpha / r

    def forward(self, x):
        y = linear_nf4(input=x, weight=self.weight)
        return y + F.linear(F.linear(x.float(), self.lora_a), self.lora_b) * self.scale


def rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Llama(torch.nn.Module):
    def __init__(self, d, r, alpha, dtype):
        super().__init__()
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        self.c = c
        self.heads, self.hd = c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads", self.heads)
        self.eps = c["rms_norm_eps"]
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as st:
            get = st.get_tensor
            self.embed = get("model.embed_tokens.weight").to(dtype)
            self.norm = get("model.norm.weight").to(dtype)
            self.lm_head = get("lm_head.weight").to(dtype)
            self.layers = torch.nn.ModuleList()
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}."
                m = torch.nn.Module()
                m.ln1 = get(p + "input_layernorm.weight").to(dtype)
                m.ln2 = get(p + "post_attention_layernorm.weight").to(dtype)
                for n in PROJ:
                    key = p + ("self_attn." if n in PROJ[:4] else "mlp.") + n + ".weight"
                    setattr(m, n, LoRALinear(get(key), r, alpha))
                self.layers.append(m)
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        self.inv_freq = inv

    def forward(self, tokens):
        b, s = tokens.shape
        h = F.embedding(tokens, self.embed)
        ang = torch.outer(torch.arange(s, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for m in self.layers:
            x = rms_norm(h, m.ln1, self.eps)
            q = m.q_proj(x).view(b, s, self.heads, self.hd).transpose(1, 2)
            k = m.k_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
            v = m.v_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
            h = h + m.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            x = rms_norm(h, m.ln2, self.eps)
            h = h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
        h = rms_norm(h, self.norm, self.eps)
        return F.linear(h, self.lm_head).float()


def bench(a):
    torch.manual_seed(0)
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    t0 = time.perf_counter()
    model = Llama(a.model, a.r, a.alpha, dtype)
    load_s = time.perf_counter() - t0
    rss_after_load = vm_hwm_bytes()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    V = model.c["vocab_size"]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (a.batch, a.seq + 1), generator=g)
    inp, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = model(inp)
            loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step()]  # warm-up: allocator, thread pool, optimizer state
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch+torchao (peer)", "torch_version": torch.__version__,
        "compute": "torch.autocast cpu bfloat16" if a.dtype == "bf16" else "fp32",
        "torch_threads": torch.get_num_threads(), "load_s": load_s,
        "trainable_params": sum(p.numel() for p in params),
        "step_s": times, "median_step_s": med, "tokens_per_s": a.batch * a.seq / med,
        "peak_rss_bytes": vm_hwm_bytes(), "rss_after_load_bytes": rss_after_load, "losses": losses}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-model")
    ap.add_argument("--model")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = ap.parse_args()
    if a.write_model:
        write_model(a)
    elif a.model:
        bench(a)
    else:
        ap.error("give --write-model DIR or --model DIR")


if __name__ == "__main__":
    main()
