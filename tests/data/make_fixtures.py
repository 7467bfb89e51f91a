"""Makes the small fixtures in tests/data (run from the repo root with the project venv):

    .venv/bin/python tests/data/make_fixtures.py [tiny_llama] [tokenizer] [tokenizer_tiktoken]

(no names: all of them; each is deterministic, so remaking one leaves the file as it was).

tiny_llama/: a Llama-shaped checkpoint with random bf16 weights (hidden 128, 2 layers, vocab
256), saved as two shards with model.safetensors.index.json, as HF writes large models. It is
the bundled example `qlora quantize` runs on with no arguments. Deterministic (seed 0).

tokenizer/tokenizer.model: a Llama-style BPE sentencepiece model (vocab 512, byte_fallback, unk 0,
bos 1, eos 2, no pad) trained on the bundled English text below plus the tiny task prompts, and
tokenizer/expected_ids.json: ids and decodes of ~50 strings by python sentencepiece, the reference
the C++ tokenizer test compares against. tiny_tasks.jsonl: 2000 Alpaca-style records of simple
deterministic tasks (add two numbers, reverse a word), the dataset where learning is visible.

tokenizer_tiktoken/tokenizer.model: a tiktoken-format BPE (as Llama-3's original/tokenizer.model)
with the 256 byte tokens and 400 merges learned here by a small byte-level BPE trainer over
text split with Llama-3's pre-tokenizer regex (the English above, task prompts and a few lines
of accents, CJK, emoji, digits and contractions), and tokenizer_tiktoken/expected_ids.json:
ids and decodes of ~80 strings by python tiktoken with Meta's Llama-3.1 special tokens, the
reference the C++ tokenizer test compares against.
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_llama(out_dir: str) -> None:
    # Imported here so that the conformance tests can import this module's tables cheaply.
    import torch
    from safetensors.torch import save_file

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


def legacy_tiny_tasks(path: str) -> None:
    """The data set of the embedded default before #12 (word list, 0-99 sums), byte for byte: the
    corpus of tokenizer/ and what tests/data/legacy_resume was trained on."""
    with open(path, "w") as f:
        for r in _tiny_task_records(2000, seed=0):
            f.write(json.dumps(r) + "\n")


def tiny_tokenizer(out_dir: str) -> None:
    import io
    import sentencepiece as spm

    records = _tiny_task_records(2000, seed=0)

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


# Meta's Llama-3 pre-tokenizer (llama3 tokenizer.py pat_str).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_special_tokens(num_base_tokens: int) -> dict:
    """Meta's Llama-3.1 special tokens: 11 named ones, then reserved ones numbered from 2."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    names = named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))]
    return {name: num_base_tokens + i for i, name in enumerate(names)}


# Written for this fixture: text whose pieces the merges should cover beyond plain English.
_UNICODE_LINES = """\
Café crème brûlée, naïve résumé, Straße, Ångström, São Paulo, Zürich, façade, señor.
日本語のテキストです。中文文本，你好，世界！東京と大阪。
Привет, мир! Καλημέρα κόσμε. Grüße aus Köln.
Emoji: 😀 🚀 👍🏽 ❤️ 🎉 and more 😀😀 in a row.
Numbers: 1234567 3.14159 2024-06-01 1,000,000 42 007 99 + 1 = 100.
Contractions: don't, I'm, we'll, they've, she'd, it's, you're; DON'T, I'M, WE'LL, They'Re.
Tabs\tand  spaces   and\n\nnew lines\r\nwith   trailing spaces   \n
    indented code: if (x == 1) { return y; }  // comment
"""


def _train_byte_bpe(pieces: list, n_merges: int) -> dict:
    """Byte-level BPE training: repeatedly merge the most frequent adjacent pair (ties: the
    smallest bytes), never across pre-token boundaries. Returns tiktoken's bytes -> rank."""
    from collections import Counter
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(p.encode("utf-8") for p in pieces)
    parts = {w: [w[i:i + 1] for i in range(len(w))] for w in words}
    for _ in range(n_merges):
        pairs = Counter()
        for w, count in words.items():
            p = parts[w]
            for a, b in zip(p, p[1:]):
                if a + b not in ranks:  # a token can be made only once
                    pairs[(a, b)] += count
        if not pairs:
            break
        a, b = min(pairs, key=lambda ab: (-pairs[ab], ab[0] + ab[1], ab[0]))
        ranks[a + b] = len(ranks)
        for w, p in parts.items():
            i, merged = 0, []
            while i < len(p):
                if i + 1 < len(p) and p[i] == a and p[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(p[i])
                    i += 1
            parts[w] = merged
    return ranks


# Strings whose ids the C++ tokenizer must reproduce for the tiktoken fixture: the sentencepiece
# list plus what is special to Llama-3's tokenizer (specials in text, contractions in any case,
# digit groups, whitespace before newlines, and U+180E, which PCRE2 alone counts as a space).
_TIKTOKEN_STRINGS = _CONFORMANCE_STRINGS + [
    "<|begin_of_text|>", "<|eot_id|><|eot_id|>", "x<|start_header_id|>y", "<|not_special|>",
    "<|eot_id", "<<|eot_id|>>", "<|reserved_special_token_246|>", "<|finetune_right_pad_id|>",
    "I'M HE'S we'RE They'll it'D you'Ve", "'s's", "x's", "1234567890", "a1b22c333d4444",
    "  \n  \n", "a  \n\n  b", "spaces at end   ", "\r\n\r\n", "(?!\\S) \u00a0 \u3000x",
    "a \u180eb", "\u180e\u180e", "x'\u017fy", "Café 日本語 😀 don't 123", "👍🏽❤️", " 🚀🚀",
    "tab\t\tend\t", "e\u0301 combining", "\x00\x01\x1f control", "\u2028line\u2029para",
    # Pieces longer than 64 bytes take the C++ heap merge instead of the short scan.
    "Reverse" * 12, " thenumbers" * 8, "x" * 100, "9" * 70, "😀" * 20,
]


def tiny_tiktoken(out_dir: str) -> None:
    import base64
    import regex
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    records = _tiny_task_records(200, seed=0)
    text = _ENGLISH + _UNICODE_LINES + "".join(
        f"{_ALPACA_PREAMBLE}\n\n### Instruction:\n{r['instruction']}\n\n### Input:\n{r['input']}"
        f"\n\n### Response:\n{r['output']}\n" for r in records)
    ranks = _train_byte_bpe(regex.findall(LLAMA3_PATTERN, text), n_merges=400)
    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "tokenizer.model")
    with open(model_path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")

    mergeable = load_tiktoken_bpe(model_path)
    specials = llama3_special_tokens(len(mergeable))
    enc = tiktoken.Encoding("tiny_llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=mergeable,
                            special_tokens=specials)
    cases = []
    for t in _TIKTOKEN_STRINGS:
        ids = enc.encode(t, allowed_special="all")
        cases.append({"text": t, "ids": ids, "decoded": enc.decode(ids)})
    expected = {"tiktoken_version": tiktoken.__version__, "num_base_tokens": len(mergeable),
                "vocab_size": enc.n_vocab, "bos_id": specials["<|begin_of_text|>"],
                "eos_id": specials["<|end_of_text|>"], "eot_id": specials["<|eot_id|>"],
                "pad_id": specials["<|finetune_right_pad_id|>"], "cases": cases}
    with open(os.path.join(out_dir, "expected_ids.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")


# ---- the embedded default's data and tokenizer (issue #12: a default that visibly learns) -----

TASK_ADD, TASK_REVERSE = "Add the numbers.", "Reverse the word."
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _heldout_records() -> list:
    """50 sums of two numbers in 0..99 and 50 real words (from _WORDS), alternating: the held-out
    set. Neither the training file nor the base's pretraining (tiny_default.cpp, which reads this
    file) contains these inputs; sums are held out in both orders."""
    import random
    rng = random.Random(12)
    words = rng.sample(sorted(set(_WORDS)), 50)
    pairs = set()
    while len(pairs) < 50:
        pairs.add((rng.randint(0, 99), rng.randint(0, 99)))
    records = []
    for (a, b), w in zip(sorted(pairs, key=lambda p: rng.random()), words):
        records.append({"instruction": TASK_ADD, "input": f"{a} + {b}", "output": str(a + b)})
        records.append({"instruction": TASK_REVERSE, "input": w, "output": w[::-1]})
    return records


def _train_records(n: int, heldout: list) -> list:
    """n records, half sums, half reversals of random 3-7 letter strings; no held-out input."""
    import random
    rng = random.Random(7)
    seen = {r["input"] for r in heldout}
    seen |= {" + ".join(r["input"].split(" + ")[::-1]) for r in heldout if r["instruction"] == TASK_ADD}
    records = []
    while len(records) < n:
        if len(records) % 2 == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            r = {"instruction": TASK_ADD, "input": f"{a} + {b}", "output": str(a + b)}
        else:
            w = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 7)))
            r = {"instruction": TASK_REVERSE, "input": w, "output": w[::-1]}
        if r["input"] not in seen:
            records.append(r)
    return records


def tiny_tasks(train_path: str, heldout_path: str) -> None:
    heldout = _heldout_records()
    for path, records in ((heldout_path, heldout), (train_path, _train_records(2000, heldout))):
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


def tiny_prompts(train_path: str, heldout_path: str) -> None:
    """GRPO's prompts (data.format = "prompt", configs/tiny_qlora_grpo.toml): the sums of
    tiny_tasks.jsonl (the first 512) and of tiny_tasks_heldout.jsonl (all 50) as string prompts in
    the plain layout the tiny base was pre-trained on but for a full stop after the sum
    ("Add the numbers.\n35 + 4.\n", answered "39"), with the sum as the answer its reward checks.
    The base never saw that stop, and answers few of them (its pre-trained layout, all of them):
    a task it cannot already do, which GRPO teaches it from the reward alone."""
    for src, dst, n in (("tiny_tasks.jsonl", train_path, 512), ("tiny_tasks_heldout.jsonl", heldout_path, 50)):
        with open(os.path.join(HERE, src)) as f:
            sums = [r for r in map(json.loads, f) if r["instruction"] == TASK_ADD][:n]
        with open(dst, "w") as f:
            for r in sums:
                prompt = f"{r['instruction']}\n{r['input']}.\n"
                f.write(json.dumps({"prompt": prompt, "answer": r["output"]}) + "\n")


def _proto_fields(buf: bytes):
    """(field, wire type, raw value) of a protobuf message: just enough to rename pieces."""
    def varint(i):
        v = shift = 0
        while True:
            c = buf[i]
            v, shift, i = v | (c & 0x7F) << shift, shift + 7, i + 1
            if c < 0x80:
                return v, i
    i = 0
    while i < len(buf):
        key, i = varint(i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            start = i
            _, i = varint(i)
            yield field, wire, buf[start:i]
        elif wire == 2:
            n, i = varint(i)
            yield field, wire, buf[i:i + n]
            i += n
        elif wire == 5:
            yield field, wire, buf[i:i + 4]
            i += 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")


def _proto_emit(field: int, wire: int, value: bytes) -> bytes:
    def varint(v):
        out = bytearray()
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                return bytes(out)
    return varint(field << 3 | wire) + (varint(len(value)) + value if wire == 2 else value)


def _rename_pieces(model: bytes, names: dict) -> bytes:
    """ModelProto with SentencePiece.piece (field 1 of each field-1 message) renamed by `names`."""
    out = b""
    for field, wire, value in _proto_fields(model):
        if field == 1:
            value = b"".join(_proto_emit(f, w, names.get(v, v) if f == 1 else v)
                             for f, w, v in _proto_fields(value))
        out += _proto_emit(field, wire, value)
    return out


def tiny_default_tokenizer(out_dir: str) -> None:
    """tokenizer_chars/tokenizer.model: one piece per character (letters and digits never merge,
    so a word's reversal and a sum's digits are token by token), the Alpaca scaffolding and the
    two task instructions as whole pieces (a prompt is ~10 pieces plus its input), byte fallback
    for everything else. Sentencepiece takes user-defined symbols comma-separated, and the
    preamble has a comma, so placeholders are trained and renamed in the model file."""
    import io
    import sentencepiece as spm

    symbols = [_ALPACA_PREAMBLE, "\n\n### Instruction:\n", "\n\n### Input:\n", "\n\n### Response:\n",
               TASK_ADD, TASK_REVERSE]
    chars = sorted(set(_LETTERS + _LETTERS.upper() + "0123456789 +-=.,:;!?'\"()#"))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["".join(chars)]), model_writer=model, model_type="char",
        vocab_size=3 + len(symbols) + 256 + len(chars), byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, num_threads=1, user_defined_symbols=[f"SYMBOL{i}" for i in range(len(symbols))],
        minloglevel=2)
    # In the model file a space is sentencepiece's U+2581, as the normalizer writes it.
    names = {f"SYMBOL{i}".encode(): s.replace(" ", "\u2581").encode() for i, s in enumerate(symbols)}
    proto = _rename_pieces(model.getvalue(), names)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    prompt = f"{_ALPACA_PREAMBLE}\n\n### Instruction:\n{TASK_REVERSE}\n\n### Input:\nkite\n\n### Response:\n"
    assert len(sp.encode(prompt)) == 9 and sp.decode(sp.encode(prompt)) == prompt, sp.encode(prompt, out_type=str)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(proto)


if __name__ == "__main__":
    import sys
    wanted = set(sys.argv[1:]) or {"tiny_llama", "tokenizer", "tokenizer_tiktoken", "tiny_tasks", "tiny_prompts",
                                   "tokenizer_chars"}
    if "tiny_llama" in wanted:
        tiny_llama(os.path.join(HERE, "tiny_llama"))
    if "tokenizer" in wanted:
        tiny_tokenizer(os.path.join(HERE, "tokenizer"))
    if "tokenizer_tiktoken" in wanted:
        tiny_tiktoken(os.path.join(HERE, "tokenizer_tiktoken"))
    if "tiny_tasks" in wanted:
        tiny_tasks(os.path.join(HERE, "tiny_tasks.jsonl"), os.path.join(HERE, "tiny_tasks_heldout.jsonl"))
    if "tiny_prompts" in wanted:
        tiny_prompts(os.path.join(HERE, "tiny_prompts.jsonl"), os.path.join(HERE, "tiny_prompts_heldout.jsonl"))
    if "tokenizer_chars" in wanted:
        tiny_default_tokenizer(os.path.join(HERE, "tokenizer_chars"))
