// export_tool: builds our LlamaModel from an HF dir with LoRA on every projection and seeded random
// B (so the adapter is non-trivial), then writes what the PEFT conformance test compares:
//   export_tool --checkpoint DIR --out DIR [--tokens 1,2,3] [--seed N] [--targets q_proj,...]
// --targets: the LoRA targets in PEFT spelling (default: every Llama projection), for families whose
// modules are named otherwise (Phi-3's qkv_proj, gate_up_proj).
// OUT/adapter/ (PEFT adapter), OUT/merged/ (merged HF model, MergeSource::Original),
// OUT/logits.safetensors ("tokens" int64 [1, seq], "logits" float32 [1, seq, vocab]).
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "qlora/checkpoint/export.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/llama.h"

namespace {
[[noreturn]] void usage(const std::string& why) {
  std::cerr << "export_tool: " << why << "\nusage: export_tool --checkpoint DIR --out DIR [--tokens 1,2,3] [--seed N]"
               " [--targets q_proj,...]\n";
  std::exit(2);
}
}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, out, tokens = "1,5,9,42,7,3,100,2", targets;
  uint64_t seed = 1234;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--checkpoint") checkpoint = v;
    else if (a == "--out") out = v;
    else if (a == "--tokens") tokens = v;
    else if (a == "--seed") seed = std::stoull(v);
    else if (a == "--targets") targets = v;
    else usage("unknown argument '" + a + "'");
  }
  if (checkpoint.empty() || out.empty()) usage("--checkpoint and --out are required");
  try {
    namespace ck = qlora::checkpoint;
    qlora::models::LlamaLoadOptions opt;
    opt.lora_targets = qlora::models::layer_peft_names(qlora::models::llama_architecture());
    if (!targets.empty()) {
      opt.lora_targets.clear();
      std::stringstream ts(targets);
      for (std::string t; std::getline(ts, t, ',');) opt.lora_targets.push_back(t);
    }
    opt.lora_r = 8;
    opt.lora_alpha = 16.0;
    opt.seed = seed;
    qlora::models::LlamaModel m = qlora::models::load_llama(checkpoint, opt);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
    {
      const c10::NoGradGuard g;
      for (auto& [name, t] : m.lora_parameters()) {
        if (name.find("lora_B") != std::string::npos) t.copy_(at::randn(t.sizes(), gen, t.options()).mul_(0.05));
      }
    }
    ck::AdapterInfo info{8, 16.0, 0.0, {}, checkpoint};
    ck::write_peft_adapter(out + "/adapter", m.lora_parameters(), info);
    ck::write_merged_model(out + "/merged", m, checkpoint, ck::MergeSource::Original);
    std::vector<int64_t> ids;
    std::stringstream ss(tokens);
    for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::stoll(item));
    const at::Tensor tok = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).view({1, -1});
    const c10::NoGradGuard g;
    const at::Tensor logits = m.forward(tok);
    qlora::io::save_safetensors(out + "/logits.safetensors", {{"tokens", tok}, {"logits", logits.contiguous()}});
  } catch (const std::exception& e) {
    std::cerr << "export_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
