"""Makes the small fixtures in tests/data (run from the repo root with the project venv):

    .venv/bin/python tests/data/make_fixtures.py

tiny_llama/: a Llama-shaped checkpoint with random bf16 weights (hidden 128, 2 layers, vocab
256), saved as two shards with model.safetensors.index.json, as HF writes large models. It is
the bundled example `qlora quantize` runs on with no arguments. Deterministic (seed 0).

tokenizer/tokenizer.model: a Llama-style BPE sentencepiece model (vocab 512, byte_fallback, unk 0,
bos 1, eos 2, no pad) trained on the bundled English text below plus the tiny task prompts, and
tokenizer/expected_ids.json: ids and decodes of ~50 strings by python sentencepiece, the reference
the C++ tokenizer test compares against. tiny_tasks.jsonl: 2000 Alpaca-style records of simple
deterministic tasks (add two numbers, reverse a word), the dataset where learning is visible.
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


# Written for this fixture: a few KB of plain English so the merges cover ordinary words, not
# only the task vocabulary.
_ENGLISH = """\
Below is an instruction that describes a task. Write a response that appropriately completes the request.
The quick brown fox jumps over the lazy dog. A small model learns quickly when the task is simple.
Fine-tuning adapts a pretrained language model to a new task with a small amount of data.
Low-rank adapters add two thin matrices beside each frozen weight; only the adapters are trained.
The base weights are stored in four bits, so a large model fits on a single graphics card.
Numbers are split into single digits, which makes arithmetic easier to learn for a tiny model.
Reading a book on a rainy afternoon is one of the simple pleasures of life.
She walked to the market, bought fresh bread and apples, and came home before noon.
The teacher asked the students to write a short story about their favourite animal.
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
The train leaves the station at seven in the morning and arrives in the city by nine.
Good software is tested, documented, and easy to change when the requirements move.
A user asks a question, the assistant answers it politely and clearly.
You are a helpful assistant. Answer the question as briefly as you can.
What is the capital of France? The capital of France is Paris.
How many days are there in a week? There are seven days in a week.
Please summarize the following paragraph in one sentence.
Translate the sentence into French. Explain why the sky is blue.
The sky looks blue because air scatters short wavelengths of sunlight more than long ones.
Every morning the baker opens the shop, and the smell of warm bread fills the street.
In the garden there are roses, tulips, and a tall old tree with a swing.
The children played in the park until the sun went down and the lights came on.
He forgot his umbrella, so he waited under the bridge until the rain stopped.
Mountains, rivers, and forests cover most of the northern part of the country.
The meeting was moved to Thursday because several people were travelling.
"""

# Short common words for the reversal task (lower case ASCII, 3-6 letters).
_WORDS = """cat dog sun moon tree book lamp rain snow fish bird frog milk cake door road ship star wind
fire stone apple bread water house table chair plant river cloud light sound green black white
happy quick slow north south east west paper glass horse mouse tiger lion bear wolf duck goat
king queen city town farm shop park lake hill rock sand salt sugar honey lemon grape peach
music dance smile laugh dream sleep night early late cold warm blue red pink gold iron coin
ring bell drum song word line page note card game ball kite boat car bus train plane road""".split()


_ALPACA_PREAMBLE = ("Below is an instruction that describes a task, paired with an input that provides "
                    "further context. Write a response that appropriately completes the request.")


def _tiny_task_records(n: int, seed: int) -> list:
    import random
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        if rng.random() < 0.5:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            records.append({"instruction": "Add the numbers.", "input": f"{a} + {b}", "output": str(a + b)})
        else:
            w = rng.choice(_WORDS)
            records.append({"instruction": "Reverse the word.", "input": w, "output": w[::-1]})
    return records


# Strings whose ids the C++ tokenizer must reproduce exactly: plain words, digits, whitespace
# runs, leading/trailing spaces, newlines, punctuation, and non-ASCII text that only byte
# fallback can encode.
_CONFORMANCE_STRINGS = [
    "", " ", "  ", "a", "A", "hello", "Hello world", "hello  world", " leading space",
    "trailing space ", "\n", "line one\nline two", "tab\tseparated", "12 + 7", "19", "123456789",
    "3.14159", "-42", "Add the numbers.", "Reverse the word.", "cat", "tac", "elppa",
    "Below is an instruction that describes a task.", "### Instruction:\nAdd the numbers.\n\n### Response:\n",
    "[INST] <<SYS>>\nYou are helpful.\n<</SYS>>\n\nHi [/INST]", "<|im_start|>user\nhi<|im_end|>\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "<s>", "</s>",
    "café", "naïve résumé", "Straße", "日本語", "你好，世界", "Привет мир", "😀", "a😀b",
    "emoji 🚀 rocket", "∑ x² ≤ ∞", "tabs\t\tand  spaces", "UPPER lower MiXeD", "don't can't won't",
    "e-mail@example.com", "https://example.org/path?q=1", "(parentheses) [brackets] {braces}",
    "The quick brown fox jumps over the lazy dog.", "zzzzzzzz", "qwertyuiop asdfghjkl",
    "a\u00a0b", "end.\n\n",
]


def tiny_tokenizer(out_dir: str, tasks_path: str) -> None:
    import io
    import sentencepiece as spm

    records = _tiny_task_records(2000, seed=0)
    with open(tasks_path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")

    # The task records go into the corpus rendered with the Alpaca prompt (as qlora's alpaca
    # template writes it), so merges cover the preamble and a tiny model's sequences stay short.
    lines = [l for l in _ENGLISH.splitlines() if l]
    for r in records[:400]:
        lines += [_ALPACA_PREAMBLE, "### Instruction:", r["instruction"], "### Input:", r["input"],
                  "### Response:", r["output"]]
    model = io.BytesIO()
    # Options mirror Llama's tokenizer.model (BPE, byte fallback, split digits, identity
    # normalization, dummy prefix, no pad id). One thread keeps training deterministic.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=512,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        shuffle_input_sentence=False, minloglevel=2)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())

    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    cases = [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))}
             for t in _CONFORMANCE_STRINGS]
    expected = {"sentencepiece_version": spm.__version__, "vocab_size": sp.get_piece_size(),
                "bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "unk_id": sp.unk_id(),
                "pad_id": sp.pad_id(), "cases": cases}
    with open(os.path.join(out_dir, "expected_ids.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    tiny_llama(os.path.join(HERE, "tiny_llama"))
    tiny_tokenizer(os.path.join(HERE, "tokenizer"), os.path.join(HERE, "tiny_tasks.jsonl"))
