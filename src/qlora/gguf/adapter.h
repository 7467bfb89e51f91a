// A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, as qlora exports it into
// epoch_N/adapter/) as a GGUF LoRA adapter, which llama.cpp's --lora and Ollama's ADAPTER apply to
// the base model's GGUF: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and for
// each adapted matrix W its "<W's GGUF name>.lora_a" ([r, in]) and ".lora_b" ([out, r]), with the
// row order llama.cpp's converter gives W (B's rows follow W's Q/K permutation).
//
// A LoRA on a MoE layer's experts (peft's target_parameters on the fused experts.gate_up_proj and
// experts.down_proj: A [r * E, in] expert-major, B [out, r * E] expert-minor) is written per expert as
// llama.cpp applies it to ffn_{gate,up,down}_exps: lora_a [E, r, in], lora_b [E, out, r] (gate_up's B
// split into its gate and up rows, its A written for both).
//
// llama.cpp scales by alpha / r; an rsLoRA adapter (alpha / sqrt(r)) is written with alpha * sqrt(r)
// so the product is the same. DoRA, bias training, modules_to_save, trainable tokens, fan_in_fan_out and a matrix
// the architecture has no GGUF name for are refused by name before the file is opened; so is a LoRA
// on an output head the base ties to its embedding (the base's GGUF has no output.weight for llama.cpp
// to apply it to; the epoch's merged model, converted whole, holds the trained head).
#pragma once

#include <string>

#include "qlora/gguf/ggml_types.h"

namespace qlora::gguf {

struct AdapterOptions {
  GgmlType type = GgmlType::F16;  // f32, f16, bf16 or q8_0 (a tensor whose rows are not blocks: f16)
  std::string name;               // general.name; empty: the base's directory name
};

// `adapter_dir` holds the PEFT files; `base_dir` is the checkpoint whose config.json (and key
// layout) the adapter was trained on: the epoch's export, or the base model. Writes `out_path`
// atomically; returns the number of tensors.
size_t write_adapter_gguf(const std::string& adapter_dir, const std::string& base_dir, const std::string& out_path,
                          const AdapterOptions& options);

}  // namespace qlora::gguf
