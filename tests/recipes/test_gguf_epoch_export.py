"""An epoch's GGUF export (checkpoint.gguf) through `qlora run lora_finetune`, checked by llama.cpp:

1. Gemma 3 with tied embeddings and LoRA on the output projection: the export unties the head, and
   llama.cpp's gemma3 reads it as output.weight. The run exits 0; llama.cpp's logits on the epoch's
   f32 GGUF equal transformers' on the epoch's merged model, and the trained head moved them by more
   than the tolerance (a file whose head were the embedding would fail);
2. Gemma 2 (llama.cpp's gemma2 has no output head of its own) with the same targets is refused at
   start, before any step, naming lora.targets, checkpoint.gguf and tie_word_embeddings;
3. a GGUF write that fails at the end of epoch 1 (QLORA_FAULT_PLAN gguf_fails_at_epoch=0: a full
   disk) loses nothing else: epoch_0 is committed with its adapter and merged model, epoch 2 and its
   GGUF follow, the run exits 1 naming the file that was not written, and a resume finds the run done.

    python tests/recipes/test_gguf_epoch_export.py --qlora build/qlora --qlora-faults build/qlora_faults
        --workdir build/recipe_gguf_epoch_export
"""
import glob
import os
import sys

import numpy as np
import torch

from recipe_common import Checks, losses, recipe_args, run_recipe

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "conformance"))
import _families  # noqa: E402
import _gguf_tokenizers as T  # noqa: E402
import test_gguf_families as G  # noqa: E402

TARGETS = 'lora.targets=["q","v","output"]'
# Two epochs of two steps at a high rate, so that the head's LoRA moves the logits well past TOL.
RUN = ["logging.progress=plain", "training.max_steps_per_epoch=2", "checkpoint.adapter_only=false",
       "data.max_seq_len=256", "training.batch_size=2", "optim.lr=3e-2", "optim.warmup_steps=0", "model.base=fp32", "model.dtype=fp32",
       TARGETS]
# ggml's GeLU reads an f16 table: ~1e-3 of the largest logit on f32 files (test_gguf_families.TOL_GELU).
TOL = G.TOL_GELU["f32"]


def build(work, case, **overrides):
    d = os.path.join(work, case)
    tok = T.SpTokenizer(T.gemma_sentencepiece(d))
    _families.build(case, 0, vocab_size=len(tok), max_position_embeddings=256, tie_word_embeddings=True,
                    **overrides).save_pretrained(d)
    return d, tok


def untied_head(check, a, work):
    base, tok = build(work, "gemma3", query_pre_attn_scalar=64, num_hidden_layers=6, layer_types=G.GEMMA3_6)
    out = os.path.join(work, "gemma3_run")
    r = run_recipe(a.qlora, out, f"model.checkpoint_dir={base}", "training.epochs=1", 'checkpoint.gguf=["f32"]', *RUN)
    files = glob.glob(os.path.join(out, "epoch_0", "*-f32.gguf"))
    if not check(r.returncode == 0 and len(files) == 1, f"gemma3, tied, LoRA on output, checkpoint.gguf: the run "
                 f"writes epoch_0's GGUF {files} {r.stderr[-400:]}"):
        return
    merged = _families.Gemma3ForCausalLM.from_pretrained(os.path.join(out, "epoch_0"), dtype=torch.float32).eval()
    ids = G.prompt_ids(tok)
    ref = G.hf_logits(merged, ids)
    ours = G.llama_cpp_logits(G.llama_cpp_model(files[0]), ids)
    with torch.no_grad():  # the same model with the embedding as its head: what a tied file would compute
        merged.lm_head.weight = torch.nn.Parameter(merged.model.embed_tokens.weight.clone())
    moved = G.rel_diff(G.hf_logits(merged, ids), ref)
    diff = G.rel_diff(ours, ref)
    check(diff < TOL < moved, f"llama.cpp's logits on the epoch's GGUF equal transformers' on its merged model: "
          f"{diff:.2e} (< {TOL:g}; the trained head moves them by {moved:.2e})")


def gemma2_refused(check, a, work):
    base, _ = build(work, "gemma2", query_pre_attn_scalar=64)
    out = os.path.join(work, "gemma2_run")
    r = run_recipe(a.qlora, out, f"model.checkpoint_dir={base}", "training.epochs=1", 'checkpoint.gguf=["f16"]', *RUN,
                   expect_rc=1)
    msg = r.stderr
    check(r.returncode == 1 and all(w in msg for w in ("checkpoint.gguf", "lora.targets", '"output"',
                                                       "tie_word_embeddings", "gemma2")) and
          not os.path.exists(os.path.join(out, "metrics.jsonl")),
          f"gemma2, tied, LoRA on output, checkpoint.gguf: refused before any step, naming the keys: {msg[-500:]}")


def failed_gguf_keeps_the_epoch(check, a, work):
    base = os.path.join(work, "gemma3")  # untied_head's
    out = os.path.join(work, "gemma3_disk_full")
    args = [f"model.checkpoint_dir={base}", "training.epochs=2", 'checkpoint.gguf=["f32"]', *RUN]
    r = run_recipe(a.qlora_faults, out, *args, fault="gguf_fails_at_epoch=0", expect_rc=1)
    e0, e1 = os.path.join(out, "epoch_0"), os.path.join(out, "epoch_1")
    kept = (os.path.isfile(os.path.join(e0, "adapter", "adapter_model.safetensors")) and
            glob.glob(os.path.join(e0, "*.safetensors")) and not glob.glob(os.path.join(e0, "*.gguf*")))
    check(r.returncode == 1 and kept and not os.path.exists(e0 + ".tmp") and len(losses(out)) == 4 and
          glob.glob(os.path.join(e1, "*-f32.gguf")),
          f"a GGUF that fails to write: epoch_0 committed with its adapter and merged model, training goes on to "
          f"epoch_1 and its GGUF (losses {len(losses(out))})")
    check("epoch_0's GGUF f32" in r.stderr and "not written" in r.stderr and "No space left" in r.stderr,
          f"the run exits 1 naming the GGUF that was not written: {r.stderr[-400:]}")
    r = run_recipe(a.qlora, out, *args, "checkpoint.resume=true")
    check(r.returncode == 0 and len(losses(out)) == 4, "a resume finds the run done (its checkpoints were saved)")


def main():
    a = recipe_args()
    check = Checks()
    torch.set_num_threads(2)
    work = os.path.abspath(a.workdir)
    untied_head(check, a, work)
    gemma2_refused(check, a, work)
    failed_gguf_keeps_the_epoch(check, a, work)
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
