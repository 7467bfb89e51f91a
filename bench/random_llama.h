// Random Llama-shaped models for the benches, built in memory (writing and re-reading 13 GB of
// bf16 for a 7B shape would dominate a run).
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>

#include <cstdint>
#include <functional>

#include "qlora/models/llama.h"
#include "qlora/modules/layers.h"
#include "quant/nf4_tensor.h"

namespace qlora::bench {

// A frozen NF4 projection with random buffers: codes uniform over the 16 levels, block scalers
// absmax in about [0.01, 0.05] (int8 / factor + mean, as the format dequantizes them). The values
// only need to be finite and Llama-scaled; the step's cost does not depend on them.
inline qlora::modules::LoraLinear random_nf4_projection(int64_t out, int64_t in, at::Generator& gen) {
  qlora::Nf4Tensor w = qlora::nf4_empty({out, in}, at::kBFloat16, at::kCPU);
  w.codes.random_(0, 256, gen);
  w.scalers.random_(-128, 128, gen);
  w.factors.fill_(127.0 / 0.02);
  w.mean.fill_(0.03);
  return qlora::modules::lora_linear_nf4(std::move(w));
}

// Llama-2-7B (or its first `layers` layers; on_layer sees each as it is built, as
// LlamaLoadOptions::on_layer_loaded does) in memory: NF4 projections, bf16 embeddings and
// lm_head, fp32 norms and compute (what load_llama gives with base_in_nf4, fp32 compute and
// frozen_dtype bf16: 0.5 GB less than fp32 embeddings and lm_head), LoRA on all 7 projections.
inline qlora::models::LlamaModel random_llama2_7b(int64_t layers, int64_t r, double alpha, bool activation_checkpointing,
                                                  const std::function<void(int64_t, qlora::modules::DecoderLayer&, const qlora::models::Architecture&)>& on_layer = {}) {
  qlora::models::LlamaModel m;
  auto& c = m.config;
  c.model_type = "llama";
  c.hidden_size = 4096;
  c.intermediate_size = 11008;
  c.num_hidden_layers = layers;
  c.num_attention_heads = c.num_key_value_heads = 32;
  c.head_dim = 128;
  c.vocab_size = 32000;
  c.rms_norm_eps = 1e-5;
  c.max_position_embeddings = 4096;
  c.validate("llama2-7b bench shape");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const int64_t h = c.hidden_size;
  const qlora::models::Architecture& arch = qlora::models::llama_architecture();
  m.frozen_dtype = at::kBFloat16;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  m.layers.reserve(static_cast<size_t>(layers));  // on_layer may keep references to layers
  // Drawn in bf16 and scaled in place: no fp32 [vocab, hidden] temporary.
  m.embed_tokens = at::randn({c.vocab_size, h}, gen, bf16).mul_(0.02);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    qlora::modules::DecoderLayer L;
    L.input_layernorm = at::ones({h});
    L.post_attention_layernorm = at::ones({h});
    for (const qlora::models::ProjectionRow& row : arch.projections) {
      if (!row.member) continue;
      const std::vector<int64_t> shape = qlora::models::projection_shape(row, c);  // [out, in]
      L.*row.member = random_nf4_projection(shape[0], shape[1], gen);
    }
    for (qlora::modules::LoraLinear* p : qlora::models::layer_projections(arch, L))
      qlora::modules::lora_linear_add_adapter(*p, r, alpha, 0.0, gen, at::kCPU);
    m.layers.push_back(std::move(L));
    if (on_layer) on_layer(i, m.layers.back(), arch);
  }
  m.norm = at::ones({h});
  m.lm_head = qlora::modules::lora_linear_dense(at::randn({c.vocab_size, h}, gen, bf16).mul_(0.02));
  m.inv_freq = qlora::modules::rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling);
  // Per-layer activation checkpointing, as a 7B QLoRA recipe runs: without it the saved
  // activations of 32 layers (~75 MB each at seq 128 in fp32) alone take ~2.4 GB.
  m.activation_checkpointing = activation_checkpointing;
  return m;
}

}  // namespace qlora::bench
