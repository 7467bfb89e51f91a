// The benches' models through the recipes' own setup (recipes/session.h: build_model, make_adamw):
// what a bench times is the model and optimizer a recipe trains, never a copy of its setup. A bench
// describes its model as a recipe config and, where no checkpoint holds it, says how it is built
// (random_llama.h's random_model and seeded_model) from the load options that config gives.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

#include "qlora/config/config.h"
#include "qlora/engine/process_group.h"
#include "qlora/models/architecture.h"
#include "qlora/models/decoder.h"
#include "qlora/optim/adamw.h"
#include "recipes/session.h"

namespace qlora::bench {

// The recipe config of the benches' QLoRA: an NF4 base computing in `dtype`, LoRA r / alpha without
// dropout on every decoder projection (Llama's names; random_model and seeded_model adapt those of
// their family), its A drawn from seed 0 (DecoderLoadOptions' default), AdamW at `lr` with torch's
// other defaults (optim/adamw.h).
inline config::RecipeConfig recipe_config(at::ScalarType dtype, int64_t r, double alpha, bool activation_checkpointing,
                                          double lr = optim::AdamWOptions{}.lr) {
  config::RecipeConfig c;
  c.model.base = config::BaseFormat::NF4;
  c.model.dtype = dtype;
  c.model.activation_checkpointing = activation_checkpointing;
  c.lora.targets = models::layer_peft_names(models::llama_architecture());
  c.lora.rank = r;
  c.lora.alpha = alpha;
  c.lora.dropout = 0.0;
  c.training.seed = 0;
  const optim::AdamWOptions torch_defaults;
  c.optim.lr = lr;
  c.optim.betas = {torch_defaults.beta1, torch_defaults.beta2};
  c.optim.eps = torch_defaults.eps;
  c.optim.weight_decay = torch_defaults.weight_decay;
  return c;
}

// One bench process's session of `cfg` on `world`, its base checkpoint `base_dir` (empty: a model
// built in memory). No output directory, metrics or exports: a bench saves nothing.
inline recipes::Session session(const config::RecipeConfig& cfg, c10::Device device, engine::World& world,
                                const std::string& base_dir = "") {
  return {"bench", cfg, device, world, world.rank() == 0, base_dir, {}, {}};
}

// load_decoder of `dir` with the embedding and head in the compute dtype, as the Python peers hold
// them (a recipe keeps a bf16 checkpoint's in bf16 under fp32 compute: build_model without a builder).
inline recipes::DecoderBuilder load_in_compute_dtype(const std::string& dir) {
  return [dir](const models::DecoderLoadOptions& o) { return models::load_decoder(dir, o); };
}

}  // namespace qlora::bench
