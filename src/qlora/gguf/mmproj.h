// The vision tower and projector of a multimodal checkpoint as the "mmproj" GGUF that llama.cpp's
// multimodal library reads beside the language model's GGUF (llama-mtmd-cli / llama-server --mmproj,
// and the clients built on them): general.architecture "clip", the clip.vision.* hyperparameters and
// the v.* / mm.* tensor names of llama.cpp's clip loader, as its own converter writes them for:
//   Qwen3.5 (and Qwen3.5-MoE)  projector "qwen3vl_merger": the 3-D patch convolution as its two frames'
//                              kernels (v.patch_embd.weight, .weight.1), qkv kept fused, the merger as
//                              v.post_ln, mm.0, mm.2;
//   Gemma 3                    projector "gemma3": SigLIP, mm.input_projection.weight as HF holds it
//                              ([vision, text]) and mm.soft_emb_norm.weight as 1 + the HF weight;
//   Gemma 4                    projector "gemma4v": the patch projection as a [H, 3, p, p] kernel, the
//                              x/y position tables, q/k norms, sandwich norms, the clamped linears'
//                              bounds as <tensor>.input_min ... scalars, the standardisation.
// Where llama.cpp would compute something other than transformers from the converter's metadata, the
// file says what transformers computes: Gemma 4's MLP activation (clip.use_gelu, tanh-GELU as HF;
// without it llama.cpp uses gelu_quick), the tower's LayerNorm epsilon (Qwen3.5: HF's 1e-6).
// Types: matrices in the file's type (f32, f16 or bf16); 1-D tensors, the patch and position
// embeddings and the clamp bounds in f32. Errors name the checkpoint and the key.
#pragma once

#include <string>

#include "qlora/gguf/convert.h"

namespace qlora::gguf {

// Whether checkpoint directory `dir` holds a vision tower an mmproj GGUF can be written for: its
// config.json is a Qwen3.5, Qwen3.5-MoE, Gemma 3 or Gemma 4 ConditionalGeneration with a vision_config,
// and its image processor's rules are beside it (preprocessor_config.json, or processor_config.json's
// "image_processor": the file carries the image mean and std llama.cpp normalises with). Where the
// tower is there but the rules are not, `why_not` (if given) says so, and no mmproj is written.
bool has_mmproj(const std::string& dir, std::string* why_not = nullptr);

// Checks, before a run trains, that write_mmproj would write `dir`'s tower (its config and tensors);
// throws std::invalid_argument saying why not.
void check_mmproj(const std::string& dir);

// Writes `out_path` atomically (options.type: f32, f16 or bf16); returns the number of tensors.
size_t write_mmproj(const std::string& dir, const std::string& out_path, const ConvertOptions& options);

}  // namespace qlora::gguf
