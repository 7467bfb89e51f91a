"""model.untrained_tokens (issue 37) through the real binary, on tiny random Llamas (transformers'
save_pretrained, fp32) whose rows of tokens the alpaca template uses were zeroed, as Llama-3 base
leaves its reserved special tokens: BOS (near zero) and EOS (zero) in the embedding, those and a
piece of the preamble in the untied lm_head; one unused id zero in both, which must stay as it is.

1. the default ("error") refuses before training, naming the tokens, the matrices and the key; a bad
   value of the key is refused naming it and the accepted values;
2. "mean" trains with finite losses; the merged export's rows of those tokens are the mean of the
   trained rows of their own matrix (norm >= 1e-3 x the median row norm), every other row the base's;
   the epoch's GGUF holds the same rows; a GGUF LoRA of the adapter is refused (it cannot hold them);
3. peft loads the adapter (trainable_token_indices, one entry per matrix) on the zeroed base and its
   logits equal the merged model's;
4. 2 ranks: one process's losses and rows; SIGKILL + resume: the same losses and the same exported
   rows (every rank recomputes them at start from the whole data set);
5. a tied base: the adapter's trainable_token_indices is a list (peft ties the head to it), the
   merged embedding holds the mean, peft's logits equal the merged model's.
"""
import glob
import json
import math
import os
import shutil
import subprocess

import sentencepiece
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from recipe_common import RANKS_TOL, Checks, losses, max_diff, recipe_args, run_recipe, safetensors_of

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
SP_TOKENIZER = os.path.join(DATA, "tokenizer", "tokenizer.model")  # 512 pieces, <unk> 0, <s> 1, </s> 2
BOS, EOS = 1, 2
RUN = ["model.device=cpu", "model.dtype=fp32", f"data.path={DATA}/tiny_tasks.jsonl", "data.format=instruct",
       "data.template=alpaca", "data.max_seq_len=128", "training.epochs=1", "training.max_steps_per_epoch=4",
       "training.batch_size=2", "training.grad_accum=1", 'lora.targets=["q", "v"]', "checkpoint.adapter_only=false",
       "checkpoint.merge_from=original", "logging.progress=plain"]
# fp32 throughout: peft and the merged model differ only in the order of sums (LoRA applied or merged).
LOGITS_TOL = 1e-4
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def pieces():
    """The preamble's first piece (in every sample's inputs) and an id no sample uses."""
    sp = sentencepiece.SentencePieceProcessor(model_file=SP_TOKENIZER)
    preamble = sp.encode("Below is an instruction that describes a task")[0]
    used = set()
    with open(os.path.join(DATA, "tiny_tasks.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            used.update(sp.encode(" ".join([r["instruction"], r["input"], r["output"]])))
    used.update(sp.encode("Below is an instruction that describes a task, paired with an input that provides further "
                          "context. Write a response that appropriately completes the request. ### Instruction: "
                          "### Input: ### Response:"))
    unused = max(i for i in range(3, sp.get_piece_size()) if i not in used and i != preamble)
    return preamble, sp.id_to_piece(preamble), unused


def write_base(path, tie, preamble, unused):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
                      tie_word_embeddings=tie, bos_token_id=BOS, eos_token_id=EOS)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        e = m.model.embed_tokens.weight
        e[BOS] = 1e-7 * torch.randn(64)  # near zero, as Llama-3 base's reserved tokens
        e[[EOS, unused]] = 0
        if not tie:
            m.lm_head.weight[[BOS, EOS, preamble, unused]] = 0
    m.save_pretrained(path)
    shutil.copy(SP_TOKENIZER, os.path.join(path, "tokenizer.model"))


def trained_mean(w):
    """The rule: rows with norm >= 1e-3 x the median row norm are trained; their mean (fp64 -> fp32)."""
    n = w.float().norm(dim=1)
    return w.double()[n >= 1e-3 * n.median()].mean(0).float()


def rows_check(check, what, got, base, fixed, mean):
    """`fixed` rows of `got` equal `mean`, every other row equals `base`'s."""
    rest = [i for i in range(base.shape[0]) if i not in fixed]
    err = (got[fixed] - mean).abs().max().item()
    check(err <= 1e-6 and torch.equal(got[rest], base[rest]),
          f"{what}: rows {fixed} are the mean of the trained rows (max err {err:.1e}), every other row the base's")


def logits_check(check, what, base_dir, export):
    from peft import PeftModel
    ids = torch.tensor([[BOS, 5, 40, 7, EOS, 9, 100]])
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    peft_model = PeftModel.from_pretrained(load(base_dir), os.path.join(export, "adapter")).eval()
    with torch.no_grad():
        diff = (peft_model(ids).logits - load(export)(ids).logits).abs().max().item()
    check(diff <= LOGITS_TOL, f"{what}: peft's logits (base + adapter with its token rows) equal the merged model's "
                              f"(max diff {diff:.1e})")


def adapter_config(export):
    with open(os.path.join(export, "adapter", "adapter_config.json")) as f:
        return json.load(f)


def gguf_check(check, export, merged):
    from gguf import GGUFReader
    files = glob.glob(os.path.join(export, "*-f32.gguf"))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(files[0]).tensors} if files else {}
    ok = bool(tensors) and torch.equal(tensors["token_embd.weight"], merged[EMBED]) and \
        torch.equal(tensors["output.weight"], merged[HEAD])
    check(ok, "the epoch's GGUF holds the merged export's token_embd and output rows")


def untied(check, a, preamble, piece, unused):
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731
    base_dir = w("base_untied")
    write_base(base_dir, False, preamble, unused)
    run = [*RUN, f"model.checkpoint_dir={base_dir}"]
    r = run_recipe(a.qlora, w("refused"), *run, expect_rc=1)
    named = ['1 "<s>"', '2 "</s>"', f"{preamble} {json.dumps(piece, ensure_ascii=False)}", "embed_tokens", "lm_head",
             'model.untrained_tokens = "mean"']
    check(r.returncode == 1 and all(s in r.stderr for s in named) and f"{unused} " not in r.stderr,
          f"default: refused naming the tokens, both matrices and the key, not the unused id ({r.stderr.strip()[-400:]})")
    r = run_recipe(a.qlora, w("bad_key"), *run, "model.untrained_tokens=zero", expect_rc=1)
    check(r.returncode == 1 and "model.untrained_tokens" in r.stderr and "error, mean" in r.stderr,
          f"model.untrained_tokens=zero: refused naming the key and the accepted values ({r.stderr.strip()[-200:]})")

    r = run_recipe(a.qlora, w("mean"), *run, "model.untrained_tokens=mean", 'checkpoint.gguf=["f32"]')
    ls = losses(w("mean")) if r.returncode == 0 else []
    check(len(ls) == 4 and all(math.isfinite(x) for x in ls), f"mean: 4 steps, finite losses {ls}")
    check("set to the mean" in r.stdout and '2 "</s>"' in r.stdout, "mean: the log names the tokens")
    export = os.path.join(w("mean"), "epoch_0")
    base, merged = safetensors_of(base_dir), safetensors_of(export)
    fixed = sorted([BOS, EOS, preamble])
    rows_check(check, "merged embed_tokens", merged[EMBED], base[EMBED], [BOS, EOS], trained_mean(base[EMBED]))
    rows_check(check, "merged lm_head", merged[HEAD], base[HEAD], fixed, trained_mean(base[HEAD]))
    gguf_check(check, export, merged)
    r = subprocess.run([a.qlora, "gguf", export, "--adapter", "-o", w("adapter.gguf")], capture_output=True, text=True)
    check(r.returncode != 0 and "trainable_token_indices" in r.stderr,
          f"qlora gguf --adapter refuses the token rows a GGUF LoRA cannot hold ({r.stderr.strip()[-200:]})")
    tti = adapter_config(export).get("trainable_token_indices")
    check(tti == {"embed_tokens": fixed, "lm_head": fixed}, f"adapter_config: trainable_token_indices {tti}")
    logits_check(check, "untied", base_dir, export)

    r = run_recipe(a.qlora, w("ranks2"), *run, "model.untrained_tokens=mean", "training.batch_size=1", nproc=2)
    two = safetensors_of(os.path.join(w("ranks2"), "epoch_0")) if r.returncode == 0 else {}
    check(r.returncode == 0 and max_diff(losses(w("ranks2")), ls) <= RANKS_TOL and
          all(torch.equal(two[k], merged[k]) for k in (EMBED, HEAD)),
          f"2 ranks: one process's losses within {RANKS_TOL} and the same exported rows")

    r = run_recipe(a.qlora_faults, w("killed"), *run, "model.untrained_tokens=mean", "checkpoint.save_every_steps=2",
                   fault="kill_after_step=3", expect_rc=-9)
    r = run_recipe(a.qlora, w("killed"), *run, "model.untrained_tokens=mean", "checkpoint.save_every_steps=2",
                   "checkpoint.resume=true")
    resumed = safetensors_of(os.path.join(w("killed"), "epoch_0")) if r.returncode == 0 else {}
    check(r.returncode == 0 and losses(w("killed")) == ls and all(torch.equal(resumed[k], merged[k]) for k in (EMBED, HEAD)),
          "SIGKILL + resume: the same losses and the same exported rows")


def tied(check, a, preamble, unused):
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731
    base_dir = w("base_tied")
    write_base(base_dir, True, preamble, unused)
    r = run_recipe(a.qlora, w("tied"), *RUN, f"model.checkpoint_dir={base_dir}", "model.untrained_tokens=mean")
    check(r.returncode == 0 and "tied to lm_head" in r.stdout, "tied: mean trains; the log says the head is tied")
    export = os.path.join(w("tied"), "epoch_0")
    base, merged = safetensors_of(base_dir), safetensors_of(export)
    rows_check(check, "tied: merged embed_tokens", merged[EMBED], base[EMBED], [BOS, EOS], trained_mean(base[EMBED]))
    check(HEAD not in merged, "tied: the merged export stays tied (no lm_head.weight)")
    tti = adapter_config(export).get("trainable_token_indices")
    check(tti == [BOS, EOS], f"tied: trainable_token_indices is the list {tti}")
    logits_check(check, "tied", base_dir, export)


def main():
    a = recipe_args()
    check = Checks()
    preamble, piece, unused = pieces()
    untied(check, a, preamble, piece, unused)
    tied(check, a, preamble, unused)
    return check.summary()


if __name__ == "__main__":
    raise SystemExit(main())
