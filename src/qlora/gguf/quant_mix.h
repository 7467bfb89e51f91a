// Which ggml type each tensor of a GGUF file gets, as llama.cpp's llama-quantize chooses it by
// default (no --pure, no importance matrix, no overrides: llama_tensor_get_type in
// src/llama-quant.cpp) for the file type whose main type is given:
//
//   1-D tensors (norms, biases), ssm_conv1d (which llama.cpp's converter always writes in f32 and
//   llama-quantize keeps; ggml_ssm_conv reads f32 only) and a MoE layer's router ffn_gate_inp (the
//   converter keeps it in f32, llama-quantize never quantizes it; f16 could flip near-tied top-k
//   choices): f32. f32/f16/bf16 files: every other matrix in that type.
//   Other matrices llama.cpp never quantizes (norm weights, position embeddings): f16.
//   Experts' 3-D ffn_{gate,up,down}_exps [E, rows, cols]: rows of cols, as the 2-D ones, their
//   layer read from the name (with more than one expert llama-quantize counts ffn_* by name, not order).
//   The output head (token_embd when the embeddings are tied, i.e. there is no output.weight):
//   q6_K; q8_0 where its rows are not whole blocks of the main type (and in q8_0 files).
//   attn_v (and fused attn_qkv / attn_kv_b), counted over the file in llama.cpp's order (by layer,
//   then name): q6_K for q4_k_m and q5_k_m in the layers use_more_bits picks (the first and last
//   eighth, and every third in between); q5_K instead of q4_K on 80-layer GQA 70B models; q8_0 with
//   8 experts. attn_k with 8 experts: q8_0. attn_output with 8 experts in q4_k_m: q5_K.
//   ffn_down: q6_K in the use_more_bits layers for q4_k_m and q5_k_m (falcon's q4_k_m has its own).
//   Everything else: the main type.
// A row that is not whole blocks of the chosen type falls back as llama.cpp does: q4_K -> q5_0,
// q5_K -> q5_1, q6_K -> q8_0, and to f16 where even that does not fit (q8_0/q4_0 too: llama.cpp
// refuses those, its converter writes them in f16).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qlora/gguf/ggml_types.h"
#include "qlora/gguf/writer.h"

namespace qlora::gguf {

// What the choice reads of the model besides the tensors (llama.cpp's hparams).
struct ModelFacts {
  std::string arch = "llama";  // general.architecture
  int64_t n_layer = 0;
  int64_t n_head = 0, n_head_kv = 0;
  int64_t n_expert = 0;  // 0: a dense model
};

// One type per tensor (read: its GGUF name and shape), in the order given; `main` is the file's
// main type (type_from_name). Throws std::invalid_argument where llama.cpp would refuse (an expert
// tensor's layer outside the model).
std::vector<GgmlType> choose_types(const std::vector<TensorSpec>& tensors, const ModelFacts& facts, GgmlType main);
// The same, stored in each spec's type.
void set_types(std::vector<TensorSpec>& tensors, const ModelFacts& facts, GgmlType main);

}  // namespace qlora::gguf
