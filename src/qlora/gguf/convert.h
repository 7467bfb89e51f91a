// An HF checkpoint directory (a merged export, or any model of a family qlora writes) as one GGUF
// file that llama.cpp, Ollama and LM Studio load: the architecture's metadata and tensor names as
// llama.cpp's loader reads them, the tokenizer (tokenizer_meta.h), and every weight in the chosen
// type, streamed one tensor at a time (peak memory: the largest tensor in fp32, plus its encoding).
//
// Families: llama/mistral, qwen2, qwen3, gemma2, gemma3 and qwen3_5 (text-only, or the language model
// of a Gemma3ForConditionalGeneration / Qwen3_5ForConditionalGeneration, whose vision tower is skipped
// with a log line), phi3, smollm3, olmo2/3, qwen3_moe and mixtral (each MoE layer's experts stacked
// into llama.cpp's 3-D ffn_*_exps from one tensor per expert or from the fused gate_up_proj /
// down_proj); each as the llama.cpp architecture, metadata keys, tensor names and value transforms
// arch.h lists. gpt-oss's MXFP4 experts (*_blocks, *_scales) are written in llama.cpp's MXFP4 type in
// the f32/f16/bf16 types (their codes moved, never decoded), decoded and encoded in the quantized ones.
// Types: f32, f16, bf16 (1-D tensors and ssm_conv1d stay f32, as llama.cpp's converter keeps them); q8_0, q4_0,
// q4_k_m, q5_k_m, q6_k with each tensor in the type llama-quantize's default mix gives it
// (quant_mix.h: e.g. the output head in q6_K, q6_K for some layers' attn_v/ffn_down in the _m
// mixes, q5_0/q5_1/q8_0 where rows are not whole 256-blocks), the same bytes as llama-quantize
// makes of our f32 file.
// Anything llama.cpp would compute differently (arch.h), a tensor without a GGUF name, or a
// tokenizer llama.cpp would split differently is refused by name before the file is opened.
#pragma once

#include <string>

#include "qlora/gguf/arch.h"
#include "qlora/gguf/ggml_types.h"

namespace qlora::gguf {

struct ConvertOptions {
  GgmlType type = GgmlType::F16;
  std::string name;  // general.name; empty: the directory's name
};

// The general.* metadata of a file written from checkpoint directory `dir`: the architecture, the
// kind (general.type: "model", "mmproj"), general.name (options.name, else the directory's name), the
// file type.
Metadata general_metadata(const std::string& arch, const std::string& kind, const ConvertOptions& options,
                          const std::string& dir);

// Writes `out_path` atomically from checkpoint directory `dir`; returns the number of tensors.
size_t write_gguf(const std::string& dir, const std::string& out_path, const ConvertOptions& options);

// Checks, before a run trains, that the merged export of checkpoint directory `dir` can be written
// as GGUF, so that no epoch's export fails for its model or tokenizer; throws std::invalid_argument
// saying why not. `untied_head`: the export's head is its own (a tied base with LoRA on the output
// projection), so its config.json says tie_word_embeddings = false.
void check_convertible(const std::string& dir, bool untied_head);

}  // namespace qlora::gguf
