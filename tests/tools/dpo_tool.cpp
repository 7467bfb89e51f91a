// dpo_tool: one preference step of `qlora run lora_dpo`'s own path (train/preference_batch.h) on
// given token ids, for tests/conformance/test_dpo_trl.py to compare with TRL:
//   dpo_tool --checkpoint DIR --pairs PAIRS.json --out DIR --loss sigmoid|ipo|hinge|orpo|simpo
//            [--beta B] [--label-smoothing E] [--gamma G] [--seed N] [--dora] [--rslora]
//            [--targets q_proj,k_proj,...]  (PEFT names; default: every Llama projection)
// PAIRS.json: [{"prompt": [ids], "chosen": [ids], "rejected": [ids]}, ...], used as given (no BOS
// or EOS added); each row is prompt + response, scored on the response's tokens.
// The model: tests/tools/adapted_model.h's on DIR (so the policy differs from the reference). Writes
//   OUT/adapter/: those initial adapters as a PEFT adapter;
//   OUT/result.safetensors: policy_{chosen,rejected}_logps, ref_{chosen,rejected}_logps (losses
//   with a reference), {chosen,rejected}_rewards [P], loss [], and grad.<adapter key> per parameter.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "qlora/checkpoint/export.h"
#include "qlora/io/safetensors.h"
#include "qlora/train/preference_batch.h"
#include "tests/tools/adapted_model.h"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "dpo_tool: " << why << "\nusage: dpo_tool --checkpoint DIR --pairs PAIRS.json --out DIR"
               " --loss sigmoid|ipo|hinge|orpo|simpo [--beta B] [--label-smoothing E] [--gamma G] [--seed N]"
               " [--dora] [--rslora] [--targets NAME,...]\n";
  std::exit(2);
}

// A record's "prompt" + "<side>" as one row, labelled on the response.
qlora::data::Sample row(const nlohmann::json& rec, const std::string& side) {
  qlora::data::Sample s;
  for (int64_t id : rec.at("prompt").get<std::vector<int64_t>>()) {
    s.tokens.push_back(id);
    s.labels.push_back(qlora::data::kIgnoreIndex);
  }
  for (int64_t id : rec.at(side).get<std::vector<int64_t>>()) {
    s.tokens.push_back(id);
    s.labels.push_back(id);
  }
  return s;
}

std::vector<qlora::data::PreferencePair> read_pairs(const std::string& path) {
  std::ifstream f(path);
  if (!f) usage("cannot open " + path);
  std::vector<qlora::data::PreferencePair> pairs;
  for (const nlohmann::json& rec : nlohmann::json::parse(f)) {
    qlora::data::PreferencePair p;
    p.chosen = row(rec, "chosen");
    p.rejected = row(rec, "rejected");
    p.prompt_tokens = static_cast<int64_t>(rec.at("prompt").size());
    pairs.push_back(std::move(p));
  }
  if (pairs.empty()) usage(path + ": no pairs");
  return pairs;
}

}  // namespace

int main(int argc, char** argv) {
  namespace tr = qlora::train;
  std::string checkpoint, pairs_path, out, loss_name;
  tr::PreferenceLossOptions lo;
  uint64_t seed = 1234;
  bool dora = false, rslora = false;
  std::string targets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dora") { dora = true; continue; }
    if (a == "--rslora") { rslora = true; continue; }
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--checkpoint") checkpoint = v;
    else if (a == "--pairs") pairs_path = v;
    else if (a == "--out") out = v;
    else if (a == "--loss") loss_name = v;
    else if (a == "--beta") lo.beta = std::stod(v);
    else if (a == "--label-smoothing") lo.label_smoothing = std::stod(v);
    else if (a == "--gamma") lo.simpo_gamma = std::stod(v);
    else if (a == "--seed") seed = std::stoull(v);
    else if (a == "--targets") targets = v;
    else usage("unknown argument '" + a + "'");
  }
  if (checkpoint.empty() || pairs_path.empty() || out.empty() || loss_name.empty())
    usage("--checkpoint, --pairs, --out and --loss are required");
  try {
    lo.loss = qlora::io::enum_from_name(tr::kPreferenceLossNames, loss_name, "--loss");
    const std::vector<qlora::data::PreferencePair> pairs = read_pairs(pairs_path);
    namespace tt = qlora::test_tools;
    qlora::models::DecoderModel m = tt::adapted_model(checkpoint, tt::split_targets(targets), seed, dora, rslora);
    qlora::checkpoint::AdapterInfo info{qlora::test_tools::kRank, qlora::test_tools::kAlpha, 0.0, {}, checkpoint};
    info.use_rslora = rslora;
    qlora::checkpoint::write_peft_adapter(out + "/adapter", m.peft_parameters(), info);

    std::vector<int64_t> all(pairs.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    const qlora::data::Batch b = tr::pair_batch(pairs, all, /*pad_id=*/0);
    const tr::PairLogps lp = tr::pair_logps(m, b, lo.loss, at::Tensor(), at::kCPU);
    const tr::PreferenceTerms t = tr::preference_terms(lp, lo);
    const at::Tensor loss = tr::preference_step_loss(t, static_cast<double>(pairs.size()), lp.chosen_tokens.sum().item<double>());
    loss.backward();
    std::vector<std::pair<std::string, at::Tensor>> result = {
        {"policy_chosen_logps", lp.chosen.detach()}, {"policy_rejected_logps", lp.rejected.detach()},
        {"chosen_rewards", t.chosen_rewards},        {"rejected_rewards", t.rejected_rewards},
        {"loss", loss.detach()}};
    if (lp.ref_chosen.defined()) {
      result.emplace_back("ref_chosen_logps", lp.ref_chosen);
      result.emplace_back("ref_rejected_logps", lp.ref_rejected);
    }
    for (auto& [name, p] : m.lora_parameters()) result.emplace_back("grad." + name, p.grad());
    for (auto& [name, t] : result) t = t.contiguous();
    qlora::io::save_safetensors(out + "/result.safetensors", result);
  } catch (const std::exception& e) {
    std::cerr << "dpo_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
