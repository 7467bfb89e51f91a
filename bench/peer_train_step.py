"""The peer for bench_train_step: one QLoRA training step in plain PyTorch + torchao, the way
torchtune builds it (torchtune is not installed, so this is the minimal equivalent): frozen base
projections as torchao NF4 tensors used through torchao's linear_nf4, fp32 LoRA adapters on
q,k,v,o,gate,up,down (peft/torchtune LoRALinear math), RMSNorm, rotate-half RoPE, SDPA causal
attention, SwiGLU, cross-entropy on shifted labels, torch.optim.AdamW.

--dtype bf16: the frozen tensors (embedding, norms, head) stay bf16 as the checkpoint has them and
the forward runs under torch.autocast("cpu", dtype=torch.bfloat16), as a bf16 QLoRA run on a GPU
does: bf16 GEMMs (oneDNN, fp32 accumulation), the loss in fp32, fp32 adapters, gradients and AdamW.

Three modes, all called by bench_train_step:
  --write-model DIR   write random bf16 weights + config.json as an HF checkpoint (done once; the
                      C++ side loads the same files with load_decoder(base_in_nf4=true))
  --model DIR         load DIR, run a warm-up step then --steps timed steps, print one JSON
                      object with tokens/s and this process's peak RSS (VmHWM).
  --spec FILE         the device mode (bench_train_step --device): build the model FILE describes
                      (bench/random_llama.h seeded_spec) from the same seeds as the C++ side, on
                      --device, in bf16 as torchtune's QLoRA recipe runs it: NF4 base registered as
                      frozen Parameters, fp32 LoRA, per-layer activation checkpointing (--ac),
                      torchtune's chunked output cross-entropy (8 chunks), fused AdamW on CUDA;
                      --mode compile compiles each decoder layer and the loss as torchtune's
                      compile=True does. Prints tokens/s, peak device memory (allocated and
                      reserved) and the losses.
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
from torch.utils.checkpoint import checkpoint
from torchao.dtypes.nf4tensor import linear_nf4, to_nf4

from peak_rss import peak_rss_bytes  # bench/, beside this script

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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


def kaiming_lora_a(r, in_f, device):
    """An adapter's A as peft initialises it (kaiming-uniform, a = sqrt(5)), drawn from the global
    generator: the CPU mode's draws, in the order the model is built (hf_peer_train_step.py draws
    the same ones in the same order)."""
    lora_a = torch.empty(r, in_f, device=device)
    torch.nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))
    return lora_a


class LoRALinear(torch.nn.Module):
    """Frozen NF4 base + fp32 adapter; the LoRA path in fp32 like peft (x cast to the adapter
    dtype, the sum cast back to the base output's). The NF4 weight is a frozen Parameter, as
    torchtune registers it (torch.compile then takes it as an input, not a constant per layer)."""

    def __init__(self, weight_bf16, r, alpha, lora_a=None):
        super().__init__()
        out_f, in_f = weight_bf16.shape
        self.weight = torch.nn.Parameter(to_nf4(weight_bf16), requires_grad=False)
        if lora_a is None:
            lora_a = kaiming_lora_a(r, in_f, weight_bf16.device)
        self.lora_a = torch.nn.Parameter(lora_a)
        self.lora_b = torch.nn.Parameter(torch.zeros(out_f, r, device=weight_bf16.device))
        self.scale = alpha / r

    def forward(self, x):
        y = linear_nf4(input=x, weight=self.weight)
        return y + (F.linear(F.linear(x.float(), self.lora_a), self.lora_b) * self.scale).to(y.dtype)


def rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(torch.nn.Module):
    """One Llama decoder layer; a module of its own so that --mode compile compiles it (once for
    all layers: their parameters are the compiled graph's inputs) and --ac checkpoints it."""

    def __init__(self, ln1, ln2, projections, heads, kv_heads, hd, eps):
        super().__init__()
        self.ln1, self.ln2 = ln1, ln2
        for n, lin in projections.items():
            setattr(self, n, lin)
        self.heads, self.kv_heads, self.hd, self.eps = heads, kv_heads, hd, eps

    def forward(self, h, cos, sin):
        b, s = h.shape[0], h.shape[1]
        x = rms_norm(h, self.ln1, self.eps)
        q = self.q_proj(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        h = h + self.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        x = rms_norm(h, self.ln2, self.eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Llama(torch.nn.Module):
    """shape: hidden, layers, heads, kv_heads, head_dim, vocab, rms_norm_eps, inv_freq (a tensor)
    and projections ([name, [out, in]] in table order); weight(kind, layer, name, shape) gives
    each bf16 weight, called in the seed order of bench/random_llama.h (embedding, each layer's
    projections, lm_head); lora_a(layer, j, r, in) gives an adapter's A, or None for peft's init."""

    def __init__(self, shape, weight, r, alpha, dtype, device="cpu", lora_a=None, ac=False):
        super().__init__()
        h, self.vocab, self.ac = shape["hidden"], shape["vocab"], ac
        # Frozen Parameters, as torchtune registers norms: inputs of a compiled layer, not constants.
        ones = lambda: torch.nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)  # noqa: E731
        self.embed = weight("embed", -1, "embed_tokens", [self.vocab, h]).to(dtype)
        self.layers = torch.nn.ModuleList()
        for i in range(shape["layers"]):
            projections = {}
            for j, (n, (out_f, in_f)) in enumerate(shape["projections"]):
                a = lora_a(i, j, r, in_f) if lora_a else None
                projections[n] = LoRALinear(weight("proj", i, n, [out_f, in_f]), r, alpha, a)
            self.layers.append(DecoderLayer(ones(), ones(), projections, shape["heads"], shape["kv_heads"],
                                            shape["head_dim"], shape["rms_norm_eps"]))
        self.norm = ones()
        self.lm_head = weight("lm_head", -1, "lm_head", [self.vocab, h]).to(dtype)
        self.eps = shape["rms_norm_eps"]
        self.inv_freq = shape["inv_freq"].to(device)

    def hidden(self, tokens):
        s = tokens.shape[1]
        h = F.embedding(tokens, self.embed)
        ang = torch.outer(torch.arange(s, dtype=torch.float32, device=h.device), self.inv_freq)
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for layer in self.layers:
            h = checkpoint(layer, h, cos, sin, use_reentrant=False) if self.ac else layer(h, cos, sin)
        return rms_norm(h, self.norm, self.eps)

    def forward(self, tokens):
        """Whole [batch, seq, vocab] logits in fp32 (the CPU mode's loss)."""
        return F.linear(self.hidden(tokens), self.lm_head).float()


def chunked_cross_entropy(h, lm_head, labels, chunks):
    """torchtune's CEWithChunkedOutputLoss: the output projection and the fp32 cross-entropy a
    sequence chunk at a time, summed, over the labelled tokens."""
    total = h.new_zeros((), dtype=torch.float32)
    for hc, lc in zip(h.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
        logits = F.linear(hc, lm_head).float()
        total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lc.reshape(-1), reduction="sum",
                                        ignore_index=-100)
    return total / (labels != -100).sum()


def checkpoint_shape(d):
    """The Llama shape of the checkpoint the CPU mode wrote (config.json)."""
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, hd, inter = c.get("num_key_value_heads", heads), h // heads, c["intermediate_size"]
    shapes = {"q_proj": [heads * hd, h], "k_proj": [kv * hd, h], "v_proj": [kv * hd, h], "o_proj": [h, heads * hd],
              "gate_proj": [inter, h], "up_proj": [inter, h], "down_proj": [h, inter]}
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    return {"hidden": h, "layers": c["num_hidden_layers"], "heads": heads, "kv_heads": kv, "head_dim": hd,
            "vocab": c["vocab_size"], "rms_norm_eps": c["rms_norm_eps"], "inv_freq": inv,
            "projections": [[n, shapes[n]] for n in PROJ]}


def checkpoint_model(d, r, alpha, dtype):
    st = safe_open(os.path.join(d, "model.safetensors"), "pt")
    keys = {"embed": lambda i, n: "model.embed_tokens.weight", "lm_head": lambda i, n: "lm_head.weight",
            "proj": lambda i, n: f"model.layers.{i}." + ("self_attn." if n in PROJ[:4] else "mlp.") + n + ".weight"}
    return Llama(checkpoint_shape(d), lambda kind, i, n, shape: st.get_tensor(keys[kind](i, n)), r, alpha, dtype)


def timed_steps(step, n):
    """A warm-up step (allocator, thread pool, optimizer state; on a GPU also autotuning and
    compilation), then n timed ones: every loss, the timed steps' seconds, the warm-up's."""
    t = time.perf_counter()
    losses = [step()]
    first_s = time.perf_counter() - t
    times = []
    for _ in range(n):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    return losses, times, first_s


def measure(a, device, build):
    """The measurement both peers (this one and hf_peer_train_step.py) make in either mode:
    build() (timed as the load) gives loss(inp, labels), the model (AdamW updates its trainable
    parameters) and its vocabulary size; the tokens are drawn as the C++ side draws them; a
    warm-up step, a.steps timed ones, the peaks (the load's apart), and with a.trace one more step
    traced. Returns the figures."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    loss_fn, model, vocab = build()
    sync()
    load_s = time.perf_counter() - t0
    # As the C++ side: the load's peaks, then the steps' own.
    load_memory = device_memory(device, "load_") if device.type == "cuda" else {"rss_after_load_bytes": peak_rss_bytes()}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (a.batch, a.seq + 1), generator=g).to(device)  # as the C++ side draws them
    inp, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        loss = loss_fn(inp, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return loss.item()

    losses, times, first_step_s = timed_steps(step, a.steps)
    med = statistics.median(times)
    memory = dict(device_memory(device), **load_memory)  # the steps' peaks, before the traced step
    if a.trace:  # one more step, traced (bench/trace_summary.py reads it)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step()
        prof.export_chrome_trace(a.trace)
    return dict({"torch_version": torch.__version__, "torchao_version": __import__("torchao").__version__,
                 "torch_threads": torch.get_num_threads(),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "load_s": load_s, "first_step_s": first_step_s, "trainable_params": sum(p.numel() for p in params),
                 "step_s": times, "median_step_s": med, "tokens_per_s": a.batch * a.seq / med, "losses": losses},
                **memory)


def bench(a):
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16

    def build():
        torch.manual_seed(0)  # the adapters' A (kaiming_lora_a)
        model = checkpoint_model(a.model, a.r, a.alpha, dtype)

        def loss(inp, labels):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                logits = model(inp)
                return F.cross_entropy(logits.reshape(-1, model.vocab), labels.reshape(-1), ignore_index=-100)
        return loss, model, model.vocab

    figures = measure(a, torch.device("cpu"), build)
    print(json.dumps(dict({"impl": "pytorch+torchao (peer)",
                           "compute": "torch.autocast cpu bfloat16" if a.dtype == "bf16" else "fp32"}, **figures)))


def seeded_draws(spec, device):
    """The weights bench/random_llama.h seeded_model draws, from the same seeds on the same device:
    the shape Llama takes, weight(kind, layer, name, shape) (to be called in the seed order:
    embedding, each layer's projections in spec order, lm_head) and lora_a(layer, j, r, in)."""
    def randn(shape, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32)

    k = iter(range(1 << 62))  # the weights' seed order: embedding, projections, lm_head
    weight = lambda kind, i, n, shape: randn(shape, spec["weight_seed"] + next(k)).mul_(0.02).to(torch.bfloat16)  # noqa: E731
    per_layer = len(spec["projections"])
    lora_a = lambda i, j, r, n_in: randn([r, n_in], spec["lora_seed"] + i * per_layer + j).div_(math.sqrt(3.0 * n_in))  # noqa: E731
    shape = dict(spec, inv_freq=torch.tensor(spec["inv_freq"], dtype=torch.float32),
                 projections=[[p["name"], p["shape"]] for p in spec["projections"]])
    return shape, weight, lora_a


def seeded_model(spec, device, ac, dtype):
    """The model bench/random_llama.h seeded_model builds, from the same seeds on the same device."""
    shape, weight, lora_a = seeded_draws(spec, device)
    return Llama(shape, weight, spec["lora_r"], spec["lora_alpha"], dtype, device, lora_a, ac)


def device_memory(device, prefix=""):
    if device.type != "cuda":
        return {} if prefix else {"peak_rss_bytes": peak_rss_bytes()}
    return {prefix + "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            prefix + "max_reserved_bytes": torch.cuda.max_memory_reserved(device)}


def bench_spec(a):
    """The device mode: the seeded model on --device, bf16, timed steps; one JSON object."""
    with open(a.spec) as f:
        spec = json.load(f)
    device = torch.device(a.device)

    def build():
        model = seeded_model(spec, device, a.ac, torch.float32 if a.dtype == "fp32" else torch.bfloat16)
        loss_fn = chunked_cross_entropy
        if a.mode == "compile":  # as torchtune's compile=True: each decoder layer, and the loss
            for layer in model.layers:
                layer.compile()
            loss_fn = torch.compile(chunked_cross_entropy)
        return (lambda inp, labels: loss_fn(model.hidden(inp), model.lm_head, labels, a.loss_chunks)), model, model.vocab

    figures = measure(a, device, build)
    print(json.dumps(dict({
        "impl": "pytorch+torchao (peer, torchtune's QLoRA structure)", "mode": a.mode,
        "compute_dtype": a.dtype, "activation_checkpointing": a.ac,
        "loss": f"chunked, {a.loss_chunks} chunks (torchtune)",
        # Dynamo's counts: unique_graphs ~ layers would mean a recompile per layer (and, past its
        # cache limit, layers run eagerly).
        "dynamo_stats": dict(torch._dynamo.utils.counters["stats"]) if a.mode == "compile" else None},
        **figures)))


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
    ap.add_argument("--spec", help="the device mode: the seeded model this JSON describes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="eager", choices=["eager", "compile"])
    ap.add_argument("--ac", action="store_true", help="activation checkpointing per decoder layer")
    ap.add_argument("--loss-chunks", type=int, default=8)
    ap.add_argument("--trace", help="the device mode: one more step traced into this Chrome trace")
    a = ap.parse_args()
    if a.write_model:
        write_model(a)
    elif a.spec:
        bench_spec(a)
    elif a.model:
        bench(a)
    else:
        ap.error("give --write-model DIR, --model DIR or --spec FILE")


if __name__ == "__main__":
    main()
