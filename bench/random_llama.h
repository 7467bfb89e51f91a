// Random models of any family's shape for the benches, built in memory (writing and re-reading
// 13-18 GB of bf16 for a 7-9B shape would dominate a run), from the family's architecture table
// as load_llama builds a checkpoint: the same projections (fused ones included), biases, norms,
// tied embeddings and RoPE tables.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <functional>

#include "qlora/models/llama.h"
#include "qlora/modules/layers.h"
#include "quant/nf4_tensor.h"

namespace qlora::bench {

// A frozen NF4 projection with random buffers: codes uniform over the 16 levels, block scalers
// absmax in about [0.01, 0.05] (int8 / factor + mean, as the format dequantizes them). The values
// only need to be finite and Llama-scaled; the step's cost does not depend on them.
inline modules::LoraLinear random_nf4_projection(int64_t out, int64_t in, at::Generator& gen) {
  Nf4Tensor w = nf4_empty({out, in}, at::kBFloat16, at::kCPU);
  w.codes.random_(0, 256, gen);
  w.scalers.random_(-128, 128, gen);
  w.factors.fill_(127.0 / 0.02);
  w.mean.fill_(0.03);
  return modules::lora_linear_nf4(std::move(w));
}

// A model of `config`'s shape (on_layer sees each layer as it is built, as
// LlamaLoadOptions::on_layer_loaded does) in memory: NF4 projections, bf16 embeddings and
// lm_head (one tensor when the config ties them), unit norms and zero biases in the compute dtype
// (what load_llama gives with base_in_nf4 and frozen_dtype bf16: fp32 compute by default, or bf16),
// LoRA (fp32) on every projection of the decoder layers (not the output head).
inline models::LlamaModel random_model(
    const models::LlamaConfig& config, int64_t r, double alpha, bool activation_checkpointing,
    const std::function<void(int64_t, modules::DecoderLayer&, const models::Architecture&)>& on_layer = {},
    at::ScalarType compute_dtype = at::kFloat) {
  models::LlamaModel m;
  m.config = config;
  m.compute_dtype = compute_dtype;
  const auto& c = m.config;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const int64_t h = c.hidden_size;
  const models::Architecture& arch = models::architecture_of(c);
  m.frozen_dtype = at::kBFloat16;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  // A norm weight that scales by 1: w = 1, or w = 0 where the family scales by (1 + w) (Gemma).
  const auto norm_dtype = at::TensorOptions().dtype(compute_dtype);
  auto unit_norm = [&](int64_t n) { return c.norm_plus_one ? at::zeros({n}, norm_dtype) : at::ones({n}, norm_dtype); };
  m.layers.reserve(static_cast<size_t>(c.num_hidden_layers));  // on_layer may keep references to layers
  // Drawn in bf16 and scaled in place: no fp32 [vocab, hidden] temporary.
  m.embed_tokens = at::randn({c.vocab_size, h}, gen, bf16).mul_(0.02);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    modules::DecoderLayer L;
    for (const models::NormRow& n : arch.layer_norms) L.*n.member = unit_norm(models::dim_size(n.size, c));
    for (const models::ProjectionRow& row : arch.projections) {
      if (!row.member) continue;
      const std::vector<int64_t> shape = models::projection_shape(row, c);  // [out, in]
      L.*row.member = random_nf4_projection(shape[0], shape[1], gen);
      if (models::has_bias(row, c)) modules::lora_linear_set_bias(L.*row.member, at::zeros({shape[0]}, norm_dtype));
    }
    for (modules::LoraLinear* p : models::layer_projections(arch, L))
      modules::lora_linear_add_adapter(*p, r, alpha, 0.0, gen, at::kCPU);
    m.layers.push_back(std::move(L));
    if (on_layer) on_layer(i, m.layers.back(), arch);
  }
  m.norm = unit_norm(h);
  m.lm_head = modules::lora_linear_dense(
      c.tie_word_embeddings ? m.embed_tokens
                            : at::randn(models::projection_shape(models::output_projection(arch), c), gen, bf16).mul_(0.02));
  m.inv_freq = modules::rope_inv_freq(c.head_dim, c.rope());
  if (c.local_rope) m.inv_freq_local = modules::rope_inv_freq(c.head_dim, *c.local_rope);
  // Per-layer activation checkpointing, as a 7B QLoRA recipe runs: without it the saved
  // activations of 32 layers (~75 MB each at seq 128 in fp32) alone take ~2.4 GB.
  m.activation_checkpointing = activation_checkpointing;
  return m;
}

}  // namespace qlora::bench
