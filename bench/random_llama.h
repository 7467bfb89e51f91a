// Random models of any family's shape for the benches, built in memory (writing and re-reading
// 13-18 GB of bf16 for a 7-9B shape would dominate a run), from the family's architecture table
// as load_decoder builds a checkpoint: the same projections (fused ones included), biases, norms,
// tied embeddings and RoPE tables.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/models/decoder.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/rope.h"
#include "qlora/ops/nf4_ops.h"
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
// DecoderLoadOptions::on_layer_loaded does) in memory: NF4 projections, bf16 embeddings and
// lm_head (one tensor when the config ties them), unit norms and zero biases in the compute dtype
// (what load_decoder gives with base_in_nf4 and frozen_dtype bf16: fp32 compute by default, or bf16),
// LoRA (fp32) on every projection of the decoder layers (not the output head).
inline models::DecoderModel random_model(
    const models::DecoderConfig& config, int64_t r, double alpha, bool activation_checkpointing,
    const std::function<void(int64_t, modules::DecoderLayer&, const models::Architecture&)>& on_layer = {},
    at::ScalarType compute_dtype = at::kFloat) {
  models::DecoderModel m;
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
  auto unit_norm = [&](int64_t n) { return c.norm == modules::RmsScale::kOnePlusWeight ? at::zeros({n}, norm_dtype) : at::ones({n}, norm_dtype); };
  m.layers.reserve(static_cast<size_t>(c.num_hidden_layers));  // on_layer may keep references to layers
  // Drawn in bf16 and scaled in place: no fp32 [vocab, hidden] temporary.
  m.embed_tokens = at::randn({c.vocab_size, h}, gen, bf16).mul_(0.02);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    modules::DecoderLayer L;
    for (const models::NormRow& n : arch.layer_norms) {
      if (!models::in_layer(n.mixer, c, i)) continue;
      // Qwen3.5's DeltaNet tensors (conv, A_log, dt_bias, the plain-w gated norm): ones.
      L.*n.member = n.mixer == models::Mixer::kLinear ? at::ones(models::norm_shape(n, c, i), norm_dtype)
                                                      : unit_norm(models::dim_size(n.size, c, i));
    }
    for (const models::ProjectionRow& row : arch.projections) {
      if (!row.member || !models::in_layer(row.mixer, c, i)) continue;
      const std::vector<int64_t> shape = models::projection_shape(row, c, i);  // [out, in]
      L.*row.member = random_nf4_projection(shape[0], shape[1], gen);
      if (models::has_bias(row, c)) modules::lora_linear_set_bias(L.*row.member, at::zeros({shape[0]}, norm_dtype));
    }
    for (modules::LoraLinear* p : models::layer_projections(arch, L))
      if (p->out_features > 0) modules::lora_linear_add_adapter(*p, r, alpha, 0.0, gen, at::kCPU);
    m.layers.push_back(std::move(L));
    if (on_layer) on_layer(i, m.layers.back(), arch);
  }
  m.norm = unit_norm(h);
  m.lm_head = modules::lora_linear_dense(
      c.tie_word_embeddings ? m.embed_tokens
                            : at::randn(models::projection_shape(models::output_projection(arch), c, 0), gen, bf16).mul_(0.02));
  m.inv_freq = modules::rope_inv_freq(c.rope_dim(), c.rope());
  if (c.local_rope) m.inv_freq_local = modules::rope_inv_freq(c.rope_dim(), *c.local_rope);
  // Per-layer activation checkpointing, as a 7B QLoRA recipe runs: without it the saved
  // activations of 32 layers (~75 MB each at seq 128 in fp32) alone take ~2.4 GB.
  m.activation_checkpointing = activation_checkpointing;
  return m;
}

// Seeded weights, for a step that a peer in Python (bench/peer_train_step.py --spec) must compute
// on the same numbers: every tensor is drawn on `device` from that device's default generator
// reseeded per tensor, which equals torch.Generator(device).manual_seed(seed) in Python (the same
// ATen kernels, the same Philox or mt19937 stream from offset 0). Tensor k, in the order
// embed_tokens, then each layer's projections in the family's table order, then lm_head, is
// randn(shape) * 0.02 rounded to bf16, seed kWeightSeed + k; the LoRA A of projection j of layer i
// is randn([r, in]) / sqrt(3 in) (the variance of peft's kaiming-uniform), seed kLoraSeed + i * P + j
// (P projections a layer); B = 0. Norm weights are ones.
constexpr uint64_t kWeightSeed = 1000, kLoraSeed = 1000000;

inline at::Tensor seeded_randn(const std::vector<int64_t>& shape, uint64_t seed, at::Device device) {
  at::Generator g = at::globalContext().defaultGenerator(device);
  {
    std::lock_guard<std::mutex> lock(g.mutex());  // released before randn takes it
    g.set_current_seed(seed);
  }
  return at::randn(shape, g, at::TensorOptions().dtype(at::kFloat).device(device));
}

inline at::Tensor seeded_weight(const std::vector<int64_t>& shape, uint64_t k, at::Device device) {
  return seeded_randn(shape, kWeightSeed + k, device).mul_(0.02).to(at::kBFloat16);
}

// Throws unless `c` is a plain Llama layout (unfused projections without biases, untied
// embeddings, norms that scale by w, one RoPE): the layout the Python peer implements.
inline void check_seeded_family(const models::DecoderConfig& c) {
  const models::Architecture& arch = models::architecture_of(c);
  bool plain = !c.tie_word_embeddings && c.norm == modules::RmsScale::kWeight && !c.local_rope && arch.layer_norms.size() == 2;
  for (const models::ProjectionRow& row : arch.projections)  // the output row has no member
    plain = plain && (!row.member || (row.fused_parts.empty() && !models::has_bias(row, c)));
  if (!plain)
    throw std::invalid_argument("the seeded bench model (and its Python peer) covers the Llama layout only "
                                "(llama2-7b, llama3.1-8b, mistral-7b); '" + c.model_type + "' is not one");
}

// The model of `c`'s shape with seeded weights on `device`: NF4 projections quantized there from
// the seeded bf16 weights, bf16 embeddings and lm_head, unit norms in the compute dtype, fp32 LoRA
// on every decoder projection.
inline models::DecoderModel seeded_model(
    const models::DecoderConfig& c, int64_t r, double alpha, bool activation_checkpointing, at::Device device,
    at::ScalarType compute_dtype,
    const std::function<void(int64_t, modules::DecoderLayer&, const models::Architecture&)>& on_layer = {}) {
  check_seeded_family(c);
  const models::Architecture& arch = models::architecture_of(c);
  models::DecoderModel m;
  m.config = c;
  m.compute_dtype = compute_dtype;
  m.frozen_dtype = at::kBFloat16;
  const int64_t h = c.hidden_size, per_layer = static_cast<int64_t>(models::layer_peft_names(arch).size());
  const auto norm_opts = at::TensorOptions().dtype(compute_dtype).device(device);
  at::Generator cpu = at::make_generator<at::CPUGeneratorImpl>(0);  // lora_linear_add_adapter's draw, overwritten
  uint64_t k = 0;
  m.embed_tokens = seeded_weight({c.vocab_size, h}, k++, device);
  m.layers.reserve(static_cast<size_t>(c.num_hidden_layers));  // on_layer may keep references to layers
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    modules::DecoderLayer L;
    for (const models::NormRow& n : arch.layer_norms) L.*n.member = at::ones({models::dim_size(n.size, c, i)}, norm_opts);
    int64_t j = 0;
    for (const models::ProjectionRow& row : arch.projections) {
      if (!row.member) continue;  // the output projection: lm_head, below
      const std::vector<int64_t> shape = models::projection_shape(row, c, i);  // [out, in]
      modules::LoraLinear& p = L.*row.member;
      p = modules::lora_linear_nf4(ops::nf4_quantize(seeded_weight(shape, k++, device)));
      modules::lora_linear_add_adapter(p, r, alpha, 0.0, cpu, device);
      const at::Tensor a = seeded_randn({r, shape[1]}, kLoraSeed + static_cast<uint64_t>(i * per_layer + j++), device);
      at::NoGradGuard no_grad;
      p.lora_a.copy_(a.div_(std::sqrt(3.0 * static_cast<double>(shape[1]))));
    }
    m.layers.push_back(std::move(L));
    if (on_layer) on_layer(i, m.layers.back(), arch);
  }
  m.norm = at::ones({h}, norm_opts);
  m.lm_head = modules::lora_linear_dense(seeded_weight({c.vocab_size, h}, k++, device));
  m.inv_freq = modules::rope_inv_freq(c.head_dim, c.rope()).to(device);
  m.activation_checkpointing = activation_checkpointing;
  return m;
}

// What the Python peer needs to build the same model: the shape, the projections in seed order
// with their [out, in], and the RoPE inverse frequencies (any scaling already applied).
inline nlohmann::json seeded_spec(const models::DecoderConfig& c, int64_t r, double alpha) {
  const models::Architecture& arch = models::architecture_of(c);
  nlohmann::json projections = nlohmann::json::array();
  const std::vector<std::string> names = models::layer_peft_names(arch);
  size_t j = 0;
  for (const models::ProjectionRow& row : arch.projections)
    if (row.member) projections.push_back({{"name", names.at(j++)}, {"shape", models::projection_shape(row, c, 0)}});
  const at::Tensor inv = modules::rope_inv_freq(c.head_dim, c.rope()).to(at::kDouble).contiguous();
  return {{"hidden", c.hidden_size}, {"layers", c.num_hidden_layers}, {"heads", c.num_attention_heads},
          {"kv_heads", c.num_key_value_heads}, {"head_dim", c.head_dim}, {"vocab", c.vocab_size},
          {"rms_norm_eps", c.rms_norm_eps}, {"projections", projections},
          {"inv_freq", std::vector<double>(inv.data_ptr<double>(), inv.data_ptr<double>() + inv.numel())},
          {"weight_seed", kWeightSeed}, {"lora_seed", kLoraSeed}, {"lora_r", r}, {"lora_alpha", alpha}};
}

}  // namespace qlora::bench
