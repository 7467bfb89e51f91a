// Gemma 4's per-layer input embeddings (PLE): besides the token embedding, every decoder layer gets
// a small input of its own, [per-layer dim] a token, formed once from the tokens before the first
// layer (transformers' Gemma4TextModel.get_per_layer_inputs and project_per_layer_inputs):
//   table   = embed_tokens_per_layer[token] * sqrt(dim)                  (the token's identity)
//   context = norm(per_layer_model_projection(embeds) * hidden^-0.5)     (the token in context)
//   input   = (context + table) * 2^-0.5, split into one [dim] slice per layer.
// Layer i's gate and projection use slice i (DecoderLayer::per_layer_input_gate).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "qlora/modules/options.h"

namespace qlora::modules {

struct PerLayerInputs {
  // [per-layer vocab, layers * dim]: Gemma 4 E4B's holds 2.8 B values, so it stays in host memory as
  // the checkpoint stores it (a zero-copy mapping) and only a batch's rows are read and sent on.
  at::Tensor table;
  at::Tensor projection;  // [layers * dim, hidden], frozen, compute dtype (on the model's device)
  at::Tensor norm;        // [dim]: per_layer_projection_norm's weight
  int64_t layers = 0, dim = 0;
  double rms_norm_eps = 1e-6;
  RmsScale norm_scale = RmsScale::kWeightFp32;
  bool defined() const { return dim > 0; }
};

// tokens: [batch, seq] int64; embeds: [batch, seq, hidden], the scaled token embeddings in the
// compute dtype. Returns [batch, seq, layers, dim] in embeds' dtype, on its device.
at::Tensor per_layer_inputs_forward(const PerLayerInputs& p, const at::Tensor& tokens, const at::Tensor& embeds);

}  // namespace qlora::modules
