"""Conformance: qlora's C++ tokenizer gives the ids Python sentencepiece gives (the reference).

make_fixtures.py wrote tests/data/tokenizer/expected_ids.json with Python sentencepiece; the
C++ test (qlora_data_tests, Tokenizer.*) compares against that file. This script checks that the
file is still what the installed Python sentencepiece produces for tokenizer.model (so the C++
test never compares against a stale or hand-edited reference), then, when given the test binary,
runs its tokenizer tests.

    python tests/conformance/test_tokenizer_sentencepiece.py [--data-tests build/qlora_data_tests]
"""
import argparse
import json
import os
import subprocess
import sys

import sentencepiece as spm

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-tests", help="path of the qlora_data_tests binary")
    args = ap.parse_args()

    tok_dir = os.path.join(DATA, "tokenizer")
    sp = spm.SentencePieceProcessor(model_file=os.path.join(tok_dir, "tokenizer.model"))
    with open(os.path.join(tok_dir, "expected_ids.json")) as f:
        expected = json.load(f)

    failures = []
    for key, got in [("vocab_size", sp.get_piece_size()), ("bos_id", sp.bos_id()),
                     ("eos_id", sp.eos_id()), ("unk_id", sp.unk_id()), ("pad_id", sp.pad_id())]:
        if expected[key] != got:
            failures.append(f"{key}: fixture {expected[key]}, sentencepiece {got}")
    if len(expected["cases"]) < 50:
        failures.append(f"only {len(expected['cases'])} cases; want at least 50")
    for case in expected["cases"]:
        ids = sp.encode(case["text"])
        if ids != case["ids"]:
            failures.append(f"{case['text']!r}: fixture {case['ids']}, sentencepiece {ids}")
        if sp.decode(case["ids"]) != case["decoded"]:
            failures.append(f"{case['text']!r}: decode differs")
    if failures:
        print("expected_ids.json disagrees with sentencepiece " + spm.__version__ +
              " (rerun tests/data/make_fixtures.py):\n  " + "\n  ".join(failures))
        return 1
    print(f"fixture matches python sentencepiece {spm.__version__} on {len(expected['cases'])} strings")

    if args.data_tests:
        env = dict(os.environ, QLORA_TEST_DATA=os.path.abspath(DATA))
        rc = subprocess.call([args.data_tests, "--gtest_filter=Tokenizer.*"], env=env)
        if rc != 0:
            print("C++ tokenizer disagrees with the python sentencepiece reference")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
