// vision_tool: runs a checkpoint's vision tower (models/vision/tower.h) on given pixel values and writes
// the image features, so Python conformance tests can compare them with transformers' get_image_features.
//   vision_tool --checkpoint DIR --inputs FILE [--nf4] [--dtype fp32|bf16] [--device cpu|cuda]
//               [--dump-weights FILE] [--lora-targets a,b --lora-r R --lora-alpha A] [--train-projector]
//               [--trainable FILE] --out FILE
// FILE (--inputs, safetensors): "pixel_values", and "image_grid_thw" (Qwen3.5) or "image_position_ids"
// (Gemma 4) as the processor names them; with "grad_output" [tokens, width], a backward of
// sum(features * grad_output) too.
// Writes --out: "features" float32 [tokens, width], "tokens_per_image" int64 [images], the metadata
// "tensors" (every checkpoint tensor the tower holds, by its model name, comma-separated), "checkpoint_keys"
// (the same by their keys in the checkpoint, Tower::checkpoint_key: what a merged export writes), and after a
// backward "grad.<name>" for each trainable tensor (peft's names: base_model.model.<module>.lora_A.weight,
// the projector's base_model.model.<param>).
// --dump-weights: the encoder linears' weights as the tower computes with them (NF4 dequantized),
//   "<module>.weight" float32, for a reference on the same values.
// --trainable FILE: values for the trainable tensors by those names (adapters with nonzero B, a moved
//   projector), loaded after they are created.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/io/safetensors.h"
#include "qlora/models/vision/tower.h"
#include "qlora/ops/nf4_ops.h"

namespace {

using qlora::models::vision::Tower;

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "vision_tool: " << why << "\n"
            << "usage: vision_tool --checkpoint DIR --inputs FILE [--nf4] [--dtype fp32|bf16] [--device D]"
               " [--dump-weights FILE] [--lora-targets a,b --lora-r R --lora-alpha A] [--train-projector]"
               " [--trainable FILE] --out FILE\n";
  std::exit(2);
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

double number(const std::string& text, const std::string& flag) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  usage(flag + ": '" + text + "' is not a number");
}

void dump_weights(Tower& tower, const std::string& path) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [module, lin] : tower.linears()) {
    const at::Tensor w = lin->base_nf4.defined() ? qlora::ops::nf4_dequantize(lin->base_nf4, at::kFloat)
                                                 : lin->base_dense.to(at::kFloat);
    out.emplace_back(module + ".weight", w.cpu().contiguous());
  }
  qlora::io::save_safetensors(path, out);
}

// Every checkpoint tensor the tower holds, by its model name (or by its key in the checkpoint:
// Tower::checkpoint_key), comma-separated.
std::string held_names(Tower& tower, bool checkpoint_keys) {
  std::string out;
  const auto add = [&](const std::string& name) {
    out += (out.empty() ? "" : ",") + (checkpoint_keys ? tower.checkpoint_key(name) : name);
  };
  for (auto& [name, t] : tower.frozen()) add(name);
  for (auto& [module, lin] : tower.linears()) {
    add(module + ".weight");
    if (lin->bias.defined()) add(module + ".bias");
  }
  for (auto& [name, t] : tower.projector()) add(name);
  return out;
}

void load_trainable(Tower& tower, const std::string& path) {
  const qlora::io::SafetensorsFile f = qlora::io::SafetensorsFile::open(path);
  for (auto& [name, t] : qlora::models::vision::tower_trainable(tower)) {
    const at::Tensor v = f.tensor(name);  // throws naming the file and key when absent
    if (v.sizes() != t.sizes()) throw std::invalid_argument(path + ": '" + name + "' has the wrong shape");
    at::NoGradGuard no_grad;
    t.copy_(v);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, inputs, out, dump, trainable;
  std::vector<std::string> targets;
  int64_t r = 8;
  double alpha = 16.0;
  bool projector = false;
  qlora::models::vision::TowerLoadOptions opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--checkpoint") checkpoint = next();
    else if (a == "--inputs") inputs = next();
    else if (a == "--out") out = next();
    else if (a == "--nf4") opt.base_in_nf4 = true;
    else if (a == "--dtype") {
      const std::string d = next();
      if (d != "fp32" && d != "bf16") usage("--dtype: fp32 or bf16");
      opt.compute_dtype = d == "bf16" ? at::kBFloat16 : at::kFloat;
    } else if (a == "--device") opt.device = at::Device(next());
    else if (a == "--dump-weights") dump = next();
    else if (a == "--lora-targets") targets = split(next());
    else if (a == "--lora-r") r = static_cast<int64_t>(number(next(), a));
    else if (a == "--lora-alpha") alpha = number(next(), a);
    else if (a == "--train-projector") projector = true;
    else if (a == "--trainable") trainable = next();
    else usage("unknown argument " + a);
  }
  if (checkpoint.empty() || inputs.empty() || out.empty()) usage("--checkpoint, --inputs and --out are required");
  try {
    std::unique_ptr<Tower> tower = qlora::models::vision::load_tower(checkpoint, opt);
    if (!targets.empty()) {
      at::Generator gen = at::detail::createCPUGenerator(0);
      qlora::models::vision::add_tower_lora(*tower, targets, r, alpha, false, 0.0, gen);
    }
    if (projector) qlora::models::vision::train_projector(*tower);
    if (!trainable.empty()) load_trainable(*tower, trainable);
    if (!dump.empty()) dump_weights(*tower, dump);
    const qlora::io::SafetensorsFile in = qlora::io::SafetensorsFile::open(inputs);
    const auto has = [&](const char* name) {
      for (const auto& t : in.tensors())
        if (t.name == name) return true;
      return false;
    };
    qlora::models::vision::PixelInputs images;
    images.pixel_values = in.tensor("pixel_values");
    if (has("image_grid_thw")) images.grid_thw = in.tensor("image_grid_thw");
    if (has("image_position_ids")) images.position_ids = in.tensor("image_position_ids");
    const at::Tensor features = tower->forward(images);
    const std::vector<int64_t> counts = tower->tokens_per_image(images);
    std::vector<std::pair<std::string, at::Tensor>> result = {
        {"features", features.detach().to(at::kFloat).cpu().contiguous()},
        {"tokens_per_image", at::tensor(counts, at::TensorOptions().dtype(at::kLong))}};
    if (has("grad_output")) {
      const at::Tensor g = in.tensor("grad_output").to(features.device());
      (features.to(at::kFloat) * g).sum().backward();
      for (auto& [name, t] : qlora::models::vision::tower_trainable(*tower))
        result.emplace_back("grad." + name, t.grad().defined() ? t.grad().to(at::kFloat).cpu().contiguous()
                                                                : at::zeros_like(t, at::kFloat).cpu());
    }
    qlora::io::save_safetensors(out, result,
                                {{"tensors", held_names(*tower, false)}, {"checkpoint_keys", held_names(*tower, true)}});
  } catch (const std::exception& e) {
    std::cerr << "vision_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
