// grpo_tool: GRPO micro-batches of the recipe's own path (train/grpo_batch.h, train/grpo_loss.h) on
// given completions and rewards, for tests/conformance/test_grpo_trl.py to compare with TRL:
//   grpo_tool --checkpoint DIR --rollout ROLLOUT.json --cases CASES.json --out DIR [--seed N]
//             [--targets q_proj,...]  (PEFT names; default: every Llama projection)
// A case's "temperature" divides the logits of every log-prob (DecoderModel::logit_temperature).
// ROLLOUT.json: {"stop_ids": [ids], "rows": [{"prompt": [ids], "completion": [ids], "reward": r or null,
// "old_logps": [one a completion token], optional}, ...]}, groups of num_generations consecutive rows;
// a null reward is unscorable (TRL's None). No BOS or EOS is added. A completion is truncated when its
// last token is not in stop_ids (TRL's rule). CASES.json: [{"name": N, <GrpoOptions field>: value,
// ...}, ...], the fields spelt as the grpo.* keys; the old_logps are used by the cases with
// num_iterations > 1. One process for all cases: libtorch's start-up is most of a case's time.
// The model: tests/tools/adapted_model.h's on DIR. Writes
//   OUT/adapter/: those initial adapters as a PEFT adapter;
//   OUT/<name>/result.safetensors: advantages [B], logps, mask [B, C], ref_logps (beta != 0), loss [],
//   clip_ratio [], mean_kl [] (beta != 0), and grad.<adapter key> per parameter.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "qlora/checkpoint/export.h"
#include "qlora/io/safetensors.h"
#include "qlora/train/grpo_batch.h"
#include "qlora/train/grpo_loss.h"
#include "tests/tools/adapted_model.h"

namespace {

namespace tr = qlora::train;

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "grpo_tool: " << why
            << "\nusage: grpo_tool --checkpoint DIR --rollout ROLLOUT.json --cases CASES.json --out DIR [--seed N]"
               " [--targets NAME,...]\n";
  std::exit(2);
}

struct Rollout {
  std::vector<tr::Completion> completions;
  at::Tensor rewards;    // [B]
  at::Tensor old_logps;  // [B, C], undefined when the rows have none
};

// The rows' old_logps as [B, C] (0 past each completion's end).
at::Tensor old_logps_of(const nlohmann::json& rows, int64_t width) {
  at::Tensor t = at::zeros({static_cast<int64_t>(rows.size()), width}, at::kFloat);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto v = rows[i].at("old_logps").get<std::vector<float>>();
    if (v.size() != rows[i].at("completion").size()) usage("row " + std::to_string(i) + ": one old_logps a completion token");
    t[static_cast<int64_t>(i)].narrow(0, 0, static_cast<int64_t>(v.size())).copy_(at::tensor(v));
  }
  return t;
}

Rollout read_rollout(const std::string& path) {
  std::ifstream f(path);
  if (!f) usage("cannot open " + path);
  const nlohmann::json j = nlohmann::json::parse(f);
  const auto stop_ids = j.at("stop_ids").get<std::vector<int64_t>>();
  Rollout r;
  std::vector<float> rewards;
  size_t width = 0;
  for (const nlohmann::json& row : j.at("rows")) {
    tr::Completion c{row.at("prompt").get<std::vector<int64_t>>(), row.at("completion").get<std::vector<int64_t>>()};
    c.truncated = tr::ends_truncated(c.completion, stop_ids);
    width = std::max(width, c.completion.size());
    const nlohmann::json& reward = row.at("reward");  // null: unscorable (TRL's None), NaN here
    rewards.push_back(reward.is_null() ? std::numeric_limits<float>::quiet_NaN() : reward.get<float>());
    r.completions.push_back(std::move(c));
  }
  if (r.completions.empty()) usage(path + ": no rows");
  r.rewards = at::tensor(rewards);
  if (j.at("rows")[0].contains("old_logps")) r.old_logps = old_logps_of(j.at("rows"), static_cast<int64_t>(width));
  return r;
}

// A case's options; an unknown field is an error naming it.
tr::GrpoOptions options_of(const nlohmann::json& c) {
  namespace io = qlora::io;
  tr::GrpoOptions o;
  for (const auto& [key, v] : c.items()) {
    if (key == "name" || key == "temperature") continue;  // temperature: the model's (run_case)
    if (key == "loss_type") o.loss_type = io::enum_from_name(tr::kGrpoLossTypeNames, v.get<std::string>(), "grpo.loss_type");
    else if (key == "importance_sampling_level")
      o.importance_sampling_level = io::enum_from_name(tr::kImportanceSamplingLevelNames, v.get<std::string>(),
                                                       "grpo.importance_sampling_level");
    else if (key == "scale_rewards")
      o.scale_rewards = io::enum_from_name(tr::kRewardScalingNames, v.get<std::string>(), "grpo.scale_rewards");
    else if (key == "num_generations") o.num_generations = v.get<int64_t>();
    else if (key == "epsilon") o.epsilon = v.get<double>();
    else if (key == "epsilon_high") o.epsilon_high = v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
    else if (key == "beta") o.beta = v.get<double>();
    else if (key == "num_iterations") o.num_iterations = v.get<int64_t>();
    else if (key == "mask_truncated_completions") o.mask_truncated_completions = v.get<bool>();
    else if (key == "use_bias_correction_kl") o.use_bias_correction_kl = v.get<bool>();
    else if (key == "max_completion_length") o.max_completion_length = v.get<int64_t>();
    else throw std::invalid_argument("unknown case field '" + key + "'");
  }
  tr::validate(o);
  return o;
}

// One case on the model: its terms, backward, and what it wrote. Leaves the adapters' grads reset.
void run_case(qlora::models::DecoderModel m, const Rollout& r, const tr::CompletionBatch& b,
              const tr::GrpoOptions& o, double temperature, const std::string& out) {
  m.logit_temperature = temperature;  // a shallow copy: the same adapters
  tr::GrpoInputs in;
  in.advantages = tr::grpo_advantages(r.rewards, o.num_generations, o.scale_rewards);
  in.mask = tr::grpo_loss_mask(b.completion_mask, b.truncated, o.mask_truncated_completions);
  if (o.beta != 0.0) in.ref_logps = tr::completion_logps(m, b, at::kCPU, tr::LogpsOf::kReference);
  if (o.num_iterations > 1) in.old_logps = r.old_logps;
  at::Tensor entropy;  // [B, C]
  in.logps = tr::completion_logps(m, b, at::kCPU, tr::LogpsOf::kPolicy, &entropy);
  const tr::GrpoTerms t = tr::grpo_loss(in, o);
  t.loss.backward();
  std::vector<std::pair<std::string, at::Tensor>> result = {
      {"advantages", in.advantages}, {"logps", in.logps.detach()}, {"mask", in.mask},
      {"loss", t.loss.detach()},     {"clip_ratio", t.clip_ratio},
      {"entropy", (entropy * in.mask).sum() / in.mask.sum().clamp_min(1.0)}};  // lora_grpo's metric
  if (in.ref_logps.defined()) {
    result.emplace_back("ref_logps", in.ref_logps);
    result.emplace_back("mean_kl", t.mean_kl);
  }
  for (auto& [name, p] : m.lora_parameters()) {
    result.emplace_back("grad." + name, p.grad());
    p.mutable_grad() = at::Tensor();
  }
  for (auto& [name, t] : result) t = t.contiguous();
  std::filesystem::create_directories(out);
  qlora::io::save_safetensors(out + "/result.safetensors", result);
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, rollout_path, cases_path, out, targets;
  uint64_t seed = 1234;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--checkpoint") checkpoint = v;
    else if (k == "--rollout") rollout_path = v;
    else if (k == "--cases") cases_path = v;
    else if (k == "--out") out = v;
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--targets") targets = v;
    else usage("unknown argument '" + k + "'");
  }
  if (checkpoint.empty() || rollout_path.empty() || cases_path.empty() || out.empty())
    usage("--checkpoint, --rollout, --cases and --out are required");
  try {
    std::ifstream f(cases_path);
    if (!f) usage("cannot open " + cases_path);
    const nlohmann::json cases = nlohmann::json::parse(f);
    const Rollout r = read_rollout(rollout_path);
    namespace tt = qlora::test_tools;
    qlora::models::DecoderModel m = tt::adapted_model(checkpoint, tt::split_targets(targets), seed, false, false);
    const qlora::checkpoint::AdapterInfo info{qlora::test_tools::kRank, qlora::test_tools::kAlpha, 0.0, {}, checkpoint};
    qlora::checkpoint::write_peft_adapter(out + "/adapter", m.peft_parameters(), info);
    const tr::CompletionBatch b = tr::completion_batch(r.completions, /*pad_id=*/0);
    for (const nlohmann::json& c : cases) {
      const std::string name = c.at("name").get<std::string>();
      try {
        const tr::GrpoOptions o = options_of(c);
        if (o.num_iterations > 1 && !r.old_logps.defined()) throw std::invalid_argument("num_iterations > 1 needs the rows' old_logps");
        run_case(m, r, b, o, c.value("temperature", 1.0), out + "/" + name);
      } catch (const std::exception& e) {
        throw std::runtime_error("case " + name + ": " + e.what());
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "grpo_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
