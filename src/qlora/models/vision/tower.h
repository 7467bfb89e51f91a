// The vision tower of a multimodal checkpoint, computed as transformers 5.23 computes it: pixel values
// as the model's image processor gives them in, the image features that land at the image tokens of
// the language model out (transformers' model.get_image_features(...).pooler_output, the images'
// features one after another). A family declares its tower (Family::vision_tower, models/family.h);
// each tower is one file here:
//   Qwen3.5 (and Qwen3.5-MoE, whose vision classes and defaults are Qwen3.5's verbatim)
//                              qwen3_5_vision.cpp: model.visual.* (patches, ViT, merger)
//   Gemma 3                    gemma3_vision.cpp: SigLIP vision_tower.* + multi_modal_projector.*
//   Gemma 4                    gemma4_vision.cpp: model.vision_tower.* + model.embed_vision.*
// Weights: the encoder layers' attention and MLP linears are LoraLinears (NF4 under base_in_nf4, as the
// decoder's projections; otherwise dense in the compute dtype), so LoRA can be attached to them
// (add_tower_lora). Everything else stays dense in the compute dtype: norms, biases, position tables,
// the patch embedding (a convolution or linear over one patch: small), the projector (trainable as a
// whole: peft's modules_to_save), Gemma 4's clamp bounds and standardisation buffers. The forward is
// differentiable (autograd through every op).
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qlora/io/checkpoint_dir.h"
#include "qlora/models/unit_hooks.h"
#include "qlora/modules/lora_linear.h"

namespace qlora::models::vision {

struct TowerLoadOptions {
  bool base_in_nf4 = false;  // the encoder layers' linears read as NF4 (io::load_nf4)
  at::ScalarType compute_dtype = at::kFloat;
  at::Device device = at::kCPU;
};

// What a model's image processor gives for a batch of images (the tensors transformers passes to
// get_image_features), on any device; the tower moves them to its own.
struct PixelInputs {
  // Qwen3.5: [patches, C * T * P * P] (every image's patches in spatial-merge order, one after another);
  // Gemma 3: [images, C, S, S]; Gemma 4: [images, max_patches, P * P * C] (padded at the end).
  at::Tensor pixel_values;
  at::Tensor grid_thw;      // Qwen3.5: [images, 3] (t, h, w in patches), integer
  at::Tensor position_ids;  // Gemma 4: [images, max_patches, 2] (x, y), (-1, -1) on padding patches, integer
};

class Tower {
 public:
  virtual ~Tower() = default;
  // [image tokens, language model width] in the compute dtype: each image's features in order.
  virtual at::Tensor forward(const PixelInputs& in) const = 0;
  // How many image tokens each image of `in` gets (the rows of forward's result, image by image; Gemma 3:
  // each row of pixel_values, a pan-and-scan crop counting as an image).
  virtual std::vector<int64_t> tokens_per_image(const PixelInputs& in) const = 0;
  // The encoder layers' linears in checkpoint order, with their module names in transformers'
  // ConditionalGeneration model ("model.visual.blocks.0.attn.qkv"): what LoRA may target.
  virtual std::vector<std::pair<std::string, modules::LoraLinear*>> linears() = 0;
  // The projector's tensors with their parameter names in that model ("model.visual.merger.linear_fc1.weight").
  virtual std::vector<std::pair<std::string, at::Tensor*>> projector() = 0;
  // Every other tensor the tower holds (dense and frozen: patch embedding, position table, norms, biases
  // outside the linears, Gemma 4's clamp bounds and standardisation buffers), with the model's names: with
  // linears() (<module>.weight, <module>.bias) and projector(), the checkpoint's whole tower and projector.
  virtual std::vector<std::pair<std::string, at::Tensor*>> frozen() = 0;
  // The encoder linears' short names LoRA targets accept ("qkv", "proj", "linear_fc1", "linear_fc2").
  virtual std::vector<std::string> target_names() const = 0;
  bool training = false;  // enables LoRA dropout
  // Its encoder layers: units 0..depth()-1 of `hooks`; unit -1 is what runs before them (patch
  // embedding, positions) and unit depth() what runs after them (post-norm, the projector).
  virtual int64_t depth() const { return 0; }
  // The engine's calls around each unit of forward (and, through the units' outputs, of backward), as
  // DecoderModel::hooks (engine::ShardedDecoder::add_tower sets them: it gathers the unit's weights);
  // null: none.
  std::shared_ptr<UnitHooks> hooks;
  // Where the checkpoint it was loaded from keeps what the model names under each prefix (model's,
  // checkpoint's): {"model.visual.", "visual."}; set by the loader from the prefixes it found.
  std::vector<std::pair<std::string, std::string>> key_prefixes;
  // The checkpoint's key of the model's tensor `name` (linears(), projector(), frozen() names, with
  // .weight / .bias); `name` itself under no known prefix. A merged export keeps the checkpoint's layout.
  std::string checkpoint_key(const std::string& name) const;
  // The projector's tensors as loaded, in projector() order, where train_projector made trained copies of
  // them (peft's ModulesToSaveWrapper keeps its original module beside the copy); else empty.
  std::vector<at::Tensor> original_projector;

 protected:
  // forward() calls enter(u) before unit u runs and leave(u, out) after, `out` its output.
  void enter(int64_t unit) const;
  void leave(int64_t unit, const at::Tensor& out) const;
};

// While one is alive, `tower`'s projector() tensors are the ones as loaded (Tower::original_projector), as
// peft's ModulesToSaveWrapper uses its original module with the adapters disabled: beside each
// modules::AdaptersDisabled of a reference policy (lora_dpo's, lora_grpo's); the trained copies are put back
// when it ends. Nothing where the projector is frozen or `tower` is null (a text-only model).
class OriginalProjector {
 public:
  explicit OriginalProjector(Tower* tower);
  ~OriginalProjector();
  OriginalProjector(const OriginalProjector&) = delete;
  OriginalProjector& operator=(const OriginalProjector&) = delete;

 private:
  Tower* tower_;
  std::vector<at::Tensor> trained_;
};

// The calls forward() makes to tower.hooks, without running it: a rank whose batch holds no image
// runs this where the others run the tower, so the shard group's gathers pair up (a rank that
// trains the tower then takes part in its backward's gathers too: engine::ShardedDecoder).
void skip_forward(const Tower& tower);

// Loads the tower of a checkpoint whose config.json is `config` (the multimodal one: its
// vision_config and the keys beside it). Errors name the checkpoint, the key and what was expected.
using TowerLoader = std::unique_ptr<Tower> (*)(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                               const TowerLoadOptions& opt);
std::unique_ptr<Tower> load_qwen3_5_tower(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                          const TowerLoadOptions& opt);
std::unique_ptr<Tower> load_gemma3_tower(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                         const TowerLoadOptions& opt);
std::unique_ptr<Tower> load_gemma4_tower(const io::CheckpointDir& ckpt, const nlohmann::json& config,
                                         const TowerLoadOptions& opt);

// The tower of the checkpoint directory `dir` (its config.json's family; std::invalid_argument when
// that family has no tower).
std::unique_ptr<Tower> load_tower(const std::string& dir, const TowerLoadOptions& opt);

// LoRA on the tower's linears whose short names are in `targets` (Tower::target_names; an unknown
// name is std::invalid_argument listing them; dropout as LoraLinear's, drawn while Tower::training), A drawn
// from `gen` in linears() order, as peft's
// LoraConfig(target_modules=...) on those modules initialises them. Returns how many were adapted.
int64_t add_tower_lora(Tower& tower, const std::vector<std::string>& targets, int64_t r, double alpha, bool rslora,
                       double dropout, at::Generator gen);
// Makes the projector's tensors trainable, as peft's modules_to_save does: fp32 copies requiring grad (the
// originals kept in Tower::original_projector), kept like the adapters (peft's copy keeps the model's dtype: equal under fp32 compute; under bf16 the forward
// casts our fp32 copy to bf16, so the values used are the same until an update rounds them differently).
void train_projector(Tower& tower);
// Trainable tensors with peft's names: base_model.model.<module>.lora_A.weight / lora_B.weight, and
// the projector's base_model.model.<param> (peft's saved modules_to_save keys).
std::vector<std::pair<std::string, at::Tensor>> tower_trainable(Tower& tower);
// The modules of the linears LoRA adapts (linears()' names), in order; peft's target modules.
std::vector<std::string> adapted_modules(Tower& tower);
// The module holding the trained projector's tensors, peft's modules_to_save entry (Qwen3.5:
// "model.visual.merger"; Gemma 3: "model.multi_modal_projector"); "" when the projector is frozen.
std::string projector_module(Tower& tower);

}  // namespace qlora::models::vision
