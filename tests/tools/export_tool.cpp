// export_tool: builds tests/tools/adapted_model.h's model on an HF dir (so the adapter is
// non-trivial), then writes what the PEFT conformance test compares:
//   export_tool --checkpoint DIR --out DIR [--tokens 1,2,3] [--seed N] [--targets q_proj,...]
//               [--dora] [--rslora]
// --targets: the LoRA targets in PEFT spelling (default: every Llama projection), for families whose
// modules are named otherwise (Phi-3's qkv_proj, gate_up_proj).
// OUT/adapter/ (PEFT adapter), OUT/merged/ (merged HF model, MergeSource::Original),
// OUT/logits.safetensors ("tokens" int64 [1, seq], "logits" float32 [1, seq, vocab]),
// OUT/grads.safetensors: d/d each adapter tensor (PEFT key) of the next-token cross-entropy of the
// tokens, mean over positions.
// --dora: DoRA adapters;
// --rslora: scale alpha / sqrt(r).
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/tensor.h>
#include <ATen/core/Generator.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "qlora/checkpoint/export.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/decoder.h"
#include "tests/tools/adapted_model.h"

namespace {
[[noreturn]] void usage(const std::string& why) {
  std::cerr << "export_tool: " << why << "\nusage: export_tool --checkpoint DIR --out DIR [--tokens 1,2,3] [--seed N]"
               " [--targets q_proj,...] [--dora] [--rslora]\n";
  std::exit(2);
}
}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, out, tokens = "1,5,9,42,7,3,100,2", targets;
  uint64_t seed = 1234;
  bool dora = false, rslora = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dora" || a == "--rslora") {
      (a == "--dora" ? dora : rslora) = true;
      continue;
    }
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
    qlora::models::DecoderModel m =
        qlora::test_tools::adapted_model(checkpoint, qlora::test_tools::split_targets(targets), seed, dora, rslora);
    ck::AdapterInfo info{qlora::test_tools::kRank, qlora::test_tools::kAlpha, 0.0, {}, checkpoint};
    info.use_rslora = rslora;
    ck::write_peft_adapter(out + "/adapter", m.peft_parameters(), info);
    ck::write_merged_model(out + "/merged", m, checkpoint, ck::MergeSource::Original);
    std::vector<int64_t> ids;
    std::stringstream ss(tokens);
    for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::stoll(item));
    const at::Tensor tok = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).view({1, -1});
    const at::Tensor logits = m.forward(tok);  // [1, seq, vocab]
    const int64_t n = tok.size(1) - 1;
    at::cross_entropy_loss(logits[0].narrow(0, 0, n), tok[0].narrow(0, 1, n)).backward();
    std::vector<std::pair<std::string, at::Tensor>> grads;
    for (auto& [name, t] : m.lora_parameters()) grads.emplace_back(name, m.to_peft(name, t.grad()).contiguous());
    qlora::io::save_safetensors(out + "/grads.safetensors", grads);
    qlora::io::save_safetensors(out + "/logits.safetensors", {{"tokens", tok}, {"logits", logits.detach().contiguous()}});
  } catch (const std::exception& e) {
    std::cerr << "export_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
