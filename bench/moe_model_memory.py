#!/usr/bin/env python3
"""Whole-model training memory of three Mixture-of-Experts models, composed from bench_moe_layer's
per-layer figures: QLoRA (qlora: NF4 base) beside LoRA on a bf16 base (transformers + peft), one
training step at batch 1, --seq tokens (2048), LoRA rank --r (16) on every attention / Gated DeltaNet
projection and every expert (and Qwen3.5's shared expert), AdamW, activation checkpointing.

Why composed, not run: a full-depth 30B-35B model in bf16 (the peer) is 40-70 GB, past this 24 GiB
machine, and ours next to it would not be like with like. So each part is counted once, from the
published config.json's sizes, with the bytes per value measured by the bench:

  frozen weights  every matrix at NF4's measured bytes per value (the bench's expert bytes over their
                  values: codes, block scalers and their factors) or at 2 (bf16: the peer's base, and
                  on both sides embeddings, head, norms, routers, biases, convolutions, sinks). The
                  count is checked against the bench layer's own measured weights_bytes (to 0.5%).
  adapters        r x (in + out) per adapted matrix (experts: r x E x (in + out)), fp32, times 4:
                  the value, its gradient, AdamW's two moments (both sides keep adapters in fp32).
                  Checked against the bench's lora_bytes.
  activations     each layer's checkpointed input (seq x hidden, bf16), plus the largest per-layer
                  step transient: the bench's measured peak RSS over the RSS before one layer's
                  forward + backward at this seq (ours and the peer's, each its own).
  output head     the logits and their gradient (seq x vocab, fp32, twice), the same on both sides.

    bench/moe_model_memory.py bench/results/moe_layer_{qwen3-30b-a3b,gpt-oss-20b,qwen3.5-35b-a3b}_seq2048_r16.json

prints one JSON object with each model's parts and totals, ours and the peer's.
"""
import json
import sys

GIB = 1024 ** 3

# The published config.json sizes (the same sources as bench_moe_layer.cpp's kMoeShapes).
MODELS = {
    "qwen3-30b-a3b": dict(name="Qwen3-30B-A3B", layers=48, hidden=2048, vocab=151936, heads=32, kv=4, head_dim=128,
                          experts=128, inter=768, qk_norm=True),
    "gpt-oss-20b": dict(name="gpt-oss-20b", layers=24, hidden=2880, vocab=201088, heads=64, kv=8, head_dim=64,
                        experts=32, inter=2880, biases=True),
    "qwen3.5-35b-a3b": dict(name="Qwen3.5-35B-A3B", layers=40, hidden=2048, vocab=248320, heads=16, kv=2,
                            head_dim=256, experts=256, inter=512, qk_norm=True, output_gate=True, shared=512,
                            linear_every=4, lin_k_heads=16, lin_v_heads=32, lin_d=128, conv=4),
}


def attention(m):
    """The attention layer's matrices [(out, in)] and its other frozen values."""
    h, d = m["hidden"], m["head_dim"]
    q = m["heads"] * d * (2 if m.get("output_gate") else 1)
    mats = [(q, h), (m["kv"] * d, h), (m["kv"] * d, h), (h, m["heads"] * d)]
    other = 2 * d if m.get("qk_norm") else 0
    if m.get("biases"):
        other += q + 2 * m["kv"] * d + h + m["heads"]  # q/k/v/o biases, the sinks
    return mats, other


def deltanet(m):
    """A Gated DeltaNet layer's matrices and other frozen values (Qwen3.5)."""
    h, kd, vd = m["hidden"], m["lin_k_heads"] * m["lin_d"], m["lin_v_heads"] * m["lin_d"]
    mats = [(2 * kd + vd, h), (vd, h), (m["lin_v_heads"], h), (m["lin_v_heads"], h), (h, vd)]
    return mats, (2 * kd + vd) * m["conv"] + 2 * m["lin_v_heads"] + m["lin_d"]


def layer_parts(m, linear):
    """(adapted matrices, expert values, dense frozen values, adapter values) of one layer."""
    h, e, i = m["hidden"], m["experts"], m["inter"]
    mats, other = deltanet(m) if linear else attention(m)
    other += 2 * h + e * h  # the two norms, the router
    if m.get("biases"):
        other += e * (2 * i + h) + e  # the experts' and the router's biases
    if m.get("shared"):
        mats = mats + [(m["shared"], h), (m["shared"], h), (h, m["shared"])]
        other += h  # shared_expert_gate
    expert_values = e * 3 * i * h
    adapter = sum(o + n for o, n in mats) + e * ((h + 2 * i) + (i + h))
    return mats, expert_values, other, adapter


def is_linear(m, layer):
    every = m.get("linear_every")
    return bool(every) and (layer + 1) % every != 0


def compose(m, bench, seq, r):
    q, p = bench["qlora"], bench["peer"]
    nf4_per_value = q["weights_bytes_by_part"]["experts"] / (m["experts"] * 3 * m["inter"] * m["hidden"])
    # The bench's layer is a Qwen3-MoE layer of these sizes: attention (no output gate, biases or
    # sinks), experts, router, norms. Check the count against its measured bytes.
    plain = dict(m, output_gate=False, biases=False, shared=0)
    mats, ev, other, adapter = layer_parts(plain, linear=False)
    mat_values = sum(o * n for o, n in mats)
    checks = {
        "ours_layer_weights": (nf4_per_value * (mat_values + ev) + 2 * other, q["weights_bytes"]),
        "peer_layer_weights": (2 * (mat_values + ev + other), p["weights_bytes"]),
        "layer_lora": (4 * r * adapter, q["lora_bytes"]),
    }
    for label, (counted, measured) in checks.items():
        if abs(counted / measured - 1) > 0.005:
            raise SystemExit(f"{m['name']}: {label} counted {counted:.0f} B, the bench measured {measured} B")
    ours_w = peer_w = lora = 0.0
    for layer in range(m["layers"]):
        mats, ev, other, adapter = layer_parts(m, is_linear(m, layer))
        mat_values = sum(o * n for o, n in mats)
        ours_w += nf4_per_value * (mat_values + ev) + 2 * other
        peer_w += 2 * (mat_values + ev + other)
        lora += 16 * r * adapter  # fp32 value, gradient, two AdamW moments
    table = 2 * m["vocab"] * m["hidden"] * 2 + 2 * m["hidden"]  # embedding, head (untied), final norm: bf16
    boundaries = m["layers"] * seq * m["hidden"] * 2
    head = 2 * seq * m["vocab"] * 4
    ours = {"frozen_weights": ours_w + table, "adapters_and_adamw": lora, "checkpointed_inputs": boundaries,
            "layer_step_transient": q["peak_rss_delta_bytes"], "logits": head}
    peer = {"frozen_weights": peer_w + table, "adapters_and_adamw": lora, "checkpointed_inputs": boundaries,
            "layer_step_transient": p["peak_rss_delta_bytes"], "logits": head}
    return {"model": m["name"], "layers": m["layers"], "nf4_bytes_per_value": nf4_per_value,
            "checked_against_bench": {k: {"counted": c, "measured": v} for k, (c, v) in checks.items()},
            "ours_bytes": ours, "peer_bytes": peer,
            "ours_total_gib": sum(ours.values()) / GIB, "peer_total_gib": sum(peer.values()) / GIB,
            "ratio": sum(ours.values()) / sum(peer.values())}


def main(paths):
    out = {"what": "whole-model training memory composed from bench_moe_layer's per-layer figures "
                   "(bench/moe_model_memory.py's docstring)", "models": []}
    for path in paths:
        with open(path) as f:
            bench = json.load(f)
        run = bench["per_run"][0]
        key = bench["shape"]["model"].split()[0]
        seq, r = bench["shape"]["seq"], bench["shape"]["lora_r"]
        out["models"].append({"bench": path, "cpu": bench["machine"]["cpu"], "seq": seq, "r": r,
                              **compose(MODELS[key], run, seq, r)})
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
