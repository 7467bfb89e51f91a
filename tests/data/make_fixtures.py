"""Makes the small fixtures in tests/data (run from the repo root with the project venv):

    .venv/bin/python tests/data/make_fixtures.py

tiny_llama/: a Llama-shaped checkpoint with random bf16 weights (hidden 128, 2 layers, vocab
256), saved as two shards with model.safetensors.index.json, as HF writes large models. It is
the bundled example `qlora quantize` runs on with no arguments. Deterministic (seed 0).
"""
import json
import os

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_llama(out_dir: str) -> None:
    hidden, inter, layers, vocab, heads, kv_heads = 128, 352, 2, 256, 4, 2
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = w(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = w(hidden, inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = w(vocab, hidden)

    os.makedirs(out_dir, exist_ok=True)
    names = list(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        f.write("\n")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    tiny_llama(os.path.join(HERE, "tiny_llama"))
