"""Conformance: qlora's C++ tiktoken-format tokenizer (Llama-3) gives the ids python tiktoken gives.

The reference is tiktoken.Encoding(pat_str=Meta's Llama-3 pattern, mergeable_ranks=
load_tiktoken_bpe(file), special_tokens=Meta's 256 Llama-3.1 specials).encode(text,
allowed_special="all"), and its decode. Checks, in order:
  1. tests/data/tokenizer_tiktoken/expected_ids.json (what the C++ unit test compares against)
     is still what the installed tiktoken produces;
  2. the C++ tests TiktokenTokenizer.* and Dataset.Llama3Chat* pass (with --data-tests);
  3. with tests/tools/tokenize_tool (--tool): ~2000 seeded random texts (scripts, emoji, digit
     runs, contractions in mixed case, unicode spaces, newlines, specials embedded, the empty
     string, long runs) encode to tiktoken's ids with the fixture vocab, and again with a vocab
     holding every pre-token of those texts as one token, where any difference in how the text is
     split into pre-tokens shows as a different id; random id lists decode as tiktoken decodes
     them (specials as text, split characters as U+FFFD) and texts round-trip;
  4. llama3-chat samples tokenize as Meta's ChatFormat / torchtune build them: one
     <|begin_of_text|>, header, "\\n\\n", content, <|eot_id|> per message, <|end_of_text|> last;
  5. encode speed on ~1 MB of text, printed next to tiktoken's (single thread; not asserted).

    python tests/conformance/test_tokenizer_tiktoken.py --tool build/tokenize_tool \\
        [--data-tests build/qlora_data_tests] [--workdir build/conformance_tiktoken]
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

import regex
import tiktoken
from tiktoken.load import load_tiktoken_bpe

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
sys.path.insert(0, DATA)
from make_fixtures import LLAMA3_PATTERN, llama3_special_tokens  # noqa: E402

MODEL = os.path.join(DATA, "tokenizer_tiktoken", "tokenizer.model")

# Runs drawn at random to build test texts: each entry is (characters, longest run).
_POOLS = [
    ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", 9), ("0123456789", 7),
    (" ", 4), ("\t\n\r\x0b\x0c", 3), (".,;:!?-_()[]{}<>|/\\\"'`~@#$%^&*+=", 3),
    ("éèêëàâäôöüçñßÅØæœ", 4), ("\u0301\u0308\u0327", 2), ("αβγδεζηθΑΒΓΔ", 5), ("абвгдежзАБВГ", 5),
    ("日本語中文字漢東京大阪", 4), ("ひらがなカタカナ", 4), ("한국어문자", 3),
    ("😀🚀👍🏽❤️🎉👨\u200d👩\u200d👧", 3), ("٠١٢٣٤٥Ⅻ½①", 4),
    ("\u00a0\u1680\u2000\u2007\u200a\u2028\u2029\u202f\u205f\u3000\u0085\u180e\u200b\ufeff", 3),
    ("\x00\x01\x1b\x7f", 1),
]
_FRAGMENTS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'ve", "'VE", "'m", "'M", "'ll", "'LL",
              "'lL", "'d", "'D", "'\u017f", "don't", "I'M", "<|eot_id|>", "<|begin_of_text|>",
              "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_100|>",
              "<|python_tag|>", "<|", "|>", "<|eot_id", "<|nope|>", "\r\n", "\n\n", "  \n"]


def random_texts(seed: int, count: int) -> list:
    rng = random.Random(seed)
    texts = ["", " ", "\n", "<|eot_id|>"]
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.15:
                parts.append(rng.choice(_FRAGMENTS))
            else:
                chars, longest = rng.choice(_POOLS)
                parts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, longest))))
        texts.append("".join(parts))
    # Long runs: one huge pre-token, whitespace runs, and a long mixed text.
    letters = "".join(rng.choice("abcdefghij") for _ in range(8000))
    texts += ["x" * 12000, " " * 12000, "\n" * 5000, " " * 3000 + "end", letters, " " + letters,
              "".join(texts[:300])]
    return texts


def split_specials(text: str, specials: dict) -> list:
    pattern = "|".join(re.escape(s) for s in specials)
    return [p for p in re.split(pattern, text) if p]


def boundary_vocab(texts: list, specials: dict, path: str) -> None:
    """256 byte tokens + every pre-token (as the Python `regex` module splits them) as one token."""
    import base64
    pieces = set()
    for t in texts:
        for chunk in split_specials(t, specials):
            pieces.update(p.encode("utf-8") for p in regex.findall(LLAMA3_PATTERN, chunk))
    tokens = [bytes([b]) for b in range(256)]
    tokens += sorted(p for p in pieces if 1 < len(p) <= 64)
    with open(path, "wb") as f:
        for rank, tok in enumerate(tokens):
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")


def encoding(model_path: str):
    """tiktoken's Encoding for a tiktoken file with Llama-3's pattern and specials, and the specials."""
    ranks = load_tiktoken_bpe(model_path)
    specials = llama3_special_tokens(len(ranks))
    return tiktoken.Encoding(os.path.basename(model_path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials), specials


def run_tool(tool: str, model: str, requests: dict, workdir: str, name: str) -> dict:
    req_path, out_path = os.path.join(workdir, name + ".req.json"), os.path.join(workdir, name + ".out.json")
    with open(req_path, "w") as f:
        json.dump(requests, f)
    subprocess.run([tool, model, req_path, out_path], check=True)
    with open(out_path) as f:
        return json.load(f)


def compare_encode(enc, texts, got, label, failures) -> None:
    for t, ids in zip(texts, got):
        want = enc.encode(t, allowed_special="all")
        if ids != want:
            failures.append(f"{label}: {t[:80]!r} (len {len(t)}): qlora {ids[:20]}..., tiktoken {want[:20]}...")


def meta_chat_ids(enc, sp, dialog) -> list:
    """Meta's ChatFormat for a whole dialog, plus the EOS torchtune appends to training samples."""
    ids = [sp["<|begin_of_text|>"]]
    for m in dialog:
        ids += [sp["<|start_header_id|>"]] + enc.encode(m["role"]) + [sp["<|end_header_id|>"]]
        ids += enc.encode("\n\n") + enc.encode(m["content"].strip()) + [sp["<|eot_id|>"]]
    return ids + [sp["<|end_of_text|>"]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", help="path of the tokenize_tool binary")
    ap.add_argument("--data-tests", help="path of the qlora_data_tests binary")
    ap.add_argument("--workdir", default="conformance_tiktoken")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    failures = []

    # 1. The committed fixture is what tiktoken says.
    enc, sp = encoding(MODEL)
    with open(os.path.join(DATA, "tokenizer_tiktoken", "expected_ids.json")) as f:
        expected = json.load(f)
    for key, got in [("vocab_size", enc.n_vocab), ("bos_id", sp["<|begin_of_text|>"]),
                     ("eos_id", sp["<|end_of_text|>"]), ("eot_id", sp["<|eot_id|>"]),
                     ("pad_id", sp["<|finetune_right_pad_id|>"])]:
        if expected[key] != got:
            failures.append(f"fixture {key} {expected[key]}, tiktoken {got}")
    for case in expected["cases"]:
        if enc.encode(case["text"], allowed_special="all") != case["ids"]:
            failures.append(f"fixture ids of {case['text']!r} differ from tiktoken {tiktoken.__version__}")
        if enc.decode(case["ids"]) != case["decoded"]:
            failures.append(f"fixture decode of {case['text']!r} differs")
    if failures:
        print("expected_ids.json disagrees with tiktoken (rerun tests/data/make_fixtures.py "
              "tokenizer_tiktoken):\n  " + "\n  ".join(failures))
        return 1
    print(f"fixture matches tiktoken {tiktoken.__version__} on {len(expected['cases'])} strings")

    # 2. The C++ unit tests that compare against the fixture.
    if args.data_tests:
        env = dict(os.environ, QLORA_TEST_DATA=os.path.abspath(DATA))
        if subprocess.call([args.data_tests, "--gtest_filter=TiktokenTokenizer.*:Dataset.Llama3Chat*"], env=env):
            print("C++ tiktoken tokenizer tests failed")
            return 1
    if not args.tool:
        return 0

    # 3. Random texts, two vocabularies; decode of random ids; round trips.
    texts = random_texts(seed=0, count=2000)
    rng = random.Random(1)
    id_lists = [[rng.randrange(enc.n_vocab) for _ in range(rng.randint(0, 12))] for _ in range(500)]
    id_lists += [[rng.randrange(256) for _ in range(rng.randint(1, 6))] for _ in range(500)]  # split chars
    dialogs = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 12 + 7."},
         {"role": "assistant", "content": "19"}],
        [{"role": "user", "content": "Café? 日本語 😀"}, {"role": "assistant", "content": "Oui.\n\nNon."},
         {"role": "user", "content": "Why don't you say\nmore"}, {"role": "assistant", "content": "I'M done."}],
    ]
    got = run_tool(args.tool, MODEL, {"encode": texts, "decode": id_lists, "llama3_chat": dialogs},
                   args.workdir, "fixture")
    for key in ("vocab_size", "bos_id", "eos_id", "eot_id", "pad_id"):
        if got[key] != expected[key]:
            failures.append(f"tool {key} {got[key]}, expected {expected[key]}")
    compare_encode(enc, texts, got["encode"], "fixture vocab", failures)
    for ids, text in zip(id_lists, got["decode"]):
        if text != enc.decode(ids):
            failures.append(f"decode {ids}: qlora {text!r}, tiktoken {enc.decode(ids)!r}")
    round_trip = run_tool(args.tool, MODEL, {"decode": got["encode"]}, args.workdir, "round_trip")["decode"]
    failures += [f"round trip of {t[:80]!r}" for t, back in zip(texts, round_trip) if t != back]
    for dialog, sample in zip(dialogs, got["llama3_chat"]):
        want = meta_chat_ids(enc, sp, dialog)
        if sample["tokens"] != want:
            failures.append(f"llama3-chat {dialog}: qlora {sample['tokens']}, Meta format {want}")

    boundary = os.path.join(args.workdir, "boundary.model")
    boundary_vocab(texts, sp, boundary)
    got_b = run_tool(args.tool, boundary, {"encode": texts}, args.workdir, "boundary")
    compare_encode(encoding(boundary)[0], texts, got_b["encode"], "pre-token vocab", failures)

    # 5. Speed on ~1 MB (task records and the fixture strings), printed only.
    with open(os.path.join(DATA, "tiny_tasks.jsonl")) as f:
        chunk = f.read() + "\n".join(c["text"] for c in expected["cases"])
    big = (chunk * (2**20 // len(chunk) + 1))[: 2**20]
    timed = run_tool(args.tool, MODEL, {"encode": [big]}, args.workdir, "speed")
    t0 = time.perf_counter()
    want = enc.encode(big, allowed_special="all")
    t_ref = time.perf_counter() - t0
    if timed["encode"][0] != want:
        failures.append("the 1 MB text encodes differently")
    mb = len(big.encode("utf-8")) / 2**20
    print(f"encode {mb:.2f} MB, one thread: qlora {mb / timed['encode_seconds']:.1f} MB/s, "
          f"tiktoken {tiktoken.__version__} {mb / t_ref:.1f} MB/s (fixture vocab of {expected['num_base_tokens']})")

    if failures:
        print(f"{len(failures)} mismatches with tiktoken:\n  " + "\n  ".join(failures[:30]))
        return 1
    print(f"{len(texts)} texts x 2 vocabularies, {len(id_lists)} decodes, {len(dialogs)} chats match tiktoken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
