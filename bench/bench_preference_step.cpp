// The cost of lora_dpo's step and of DoRA against their baselines, measured in the same run on the
// ~100M Llama shape (the random checkpoint bench_train_step uses; NF4 base, LoRA on every decoder
// projection, AdamW, one rank through the sharded engine, set up by the recipes' own build_model):
//   sft   one SFT step over the pairs' 2P rows (chosen, then rejected), the response tokens scored
//   dpo   one sigmoid-DPO step over the same P pairs (train/preference_batch.h, the recipe's path):
//         the policy's forward and backward on the 2P rows plus the reference's no-grad forward
//   dpo_precomputed  the same with the reference's log-probs given (dpo.precompute_reference)
//   dora  the SFT step with lora.use_dora
// Each mode runs in its own process (re-executing this program with --worker MODE), so each peak
// RSS is its own. Prints one JSON object with the medians, peaks and ratios against #26's targets:
// dpo <= 1.4x sft's step, dpo's peak RSS <= sft's + 10%, dora <= 1.3x sft's (LoRA) step.
//
//   build/bench_preference_step [--hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000]
//                               [--seq 256] [--pairs 2] [--steps 3] [--dtype fp32|bf16|auto]
//                               [--no-activation-checkpointing]
// Activation checkpointing is on by default, as the shipped 7-8B DPO configs train: per step the SFT
// side then runs ~3 forwards' worth (forward, recompute, backward to x through the frozen base) and
// DPO adds the reference's one (~1.33x). Without it SFT is ~2 forwards' worth and DPO ~1.5x:
// the frozen NF4 base has no weight gradients, so its backward is one product per projection.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "bench/bench_dtype.h"
#include "bench/machine.h"
#include "bench/recipe_model.h"
#include "bench/run_json.h"
#include "bench/shape_args.h"
#include "kernels/cpu_isa.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/optim/adamw.h"
#include "qlora/train/preference_batch.h"

using nlohmann::json;
namespace fs = std::filesystem;
namespace tr = qlora::train;

namespace {

struct Args : qlora::bench::ShapeArgs {
  int64_t pairs = 2;
  bool ac = true;  // activation checkpointing, as the shipped 7-8B DPO configs train
  std::string dtype = "fp32", worker;
  at::ScalarType compute_dtype = at::kFloat;
  Args() { seq = 256; }
};

// P pairs of seq-token rows: a shared prompt of seq / 2 tokens, then each response's seq - seq / 2,
// scored; random ids from a fixed seed.
std::vector<qlora::data::PreferencePair> random_pairs(const Args& a) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const int64_t prompt = a.seq / 2;
  std::vector<qlora::data::PreferencePair> out;
  for (int64_t i = 0; i < a.pairs; ++i) {
    const at::Tensor ids = at::randint(0, a.vocab, {3, a.seq}, gen);
    qlora::data::PreferencePair p;
    for (auto [row, s] : {std::pair{int64_t{1}, &p.chosen}, std::pair{int64_t{2}, &p.rejected}}) {
      for (int64_t t = 0; t < a.seq; ++t) {
        s->tokens.push_back((t < prompt ? ids[0][t] : ids[row][t]).item<int64_t>());
        s->labels.push_back(t < prompt ? qlora::data::kIgnoreIndex : s->tokens.back());
      }
    }
    p.prompt_tokens = prompt;
    out.push_back(std::move(p));
  }
  return out;
}

json run_worker(const Args& a) {
  const auto world = qlora::engine::World::join(qlora::engine::RankEnv{}, 0, std::chrono::seconds(60), c10::kCPU);
  qlora::config::RecipeConfig cfg = qlora::bench::recipe_config(a.compute_dtype, 8, 16.0, a.ac);
  cfg.lora.use_dora = a.worker == "dora";
  qlora::recipes::Model model = qlora::recipes::build_model(qlora::bench::session(cfg, c10::kCPU, *world),
                                                            qlora::bench::load_in_compute_dtype(a.workdir));
  qlora::models::DecoderModel& m = model.decoder;
  const std::unique_ptr<qlora::optim::AdamW> opt = qlora::recipes::make_adamw(cfg, model);
  const std::vector<qlora::data::PreferencePair> pairs = random_pairs(a);
  std::vector<int64_t> all(pairs.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  const qlora::data::Batch b = tr::pair_batch(pairs, all, 0);
  const double scored = static_cast<double>(b.labels.ne(qlora::data::kIgnoreIndex).sum().item<int64_t>());
  const bool dpo = a.worker.rfind("dpo", 0) == 0;
  // The precomputed mode's reference: the adapters-off log-probs, computed once before timing.
  const at::Tensor ref = a.worker == "dpo_precomputed" ? tr::row_logps(m, b, at::kCPU, true) : at::Tensor();
  std::vector<double> ref_times;  // dpo: the reference's forward alone, inside each step
  auto step = [&]() {
    at::Tensor loss;
    if (dpo) {
      // As pair_logps does without a given reference (the same call), timed apart.
      const auto t0 = std::chrono::steady_clock::now();
      const at::Tensor r = ref.defined() ? ref : tr::row_logps(m, b, at::kCPU, true);
      ref_times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      const tr::PairLogps lp = tr::pair_logps(m, b, tr::PreferenceLoss::kSigmoid, r, at::kCPU);
      loss = tr::preference_step_loss(tr::preference_terms(lp, {}), static_cast<double>(a.pairs), 0.0);
    } else {
      loss = m.loss(b.tokens, b.labels) / scored;
    }
    loss.backward();
    model.engine->finish_backward();
    opt->step();
    model.engine->gather_params();
    return loss.item<double>();
  };
  std::vector<double> times, losses = {step()};  // the first step warms up, untimed
  for (int64_t i = 0; i < a.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    losses.push_back(step());
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  return {{"mode", a.worker}, {"step_s", times}, {"reference_forward_s", median(ref_times)},
          {"median_step_s", median(times)}, {"losses", losses},
          {"rows", b.tokens.size(0)}, {"tokens", b.tokens.numel()}, {"scored_tokens", scored},
          {"peak_rss_bytes", qlora::io::peak_rss_bytes()}};
}

double ratio(const json& r, const char* mode, const char* base, const char* key) {
  return r[mode][key].get<double>() / r[base][key].get<double>();
}

}  // namespace

int main(int argc, char** argv) try {
  qlora::io::tune_cpu_memory();
  Args a;
  for (int i = 1; i < argc; ++i) {
    if (a.parse(argc, argv, i)) continue;
    const std::string s = argv[i];
    if (s == "--no-activation-checkpointing") {
      a.ac = false;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
    if (s == "--pairs") a.pairs = std::stoll(argv[++i]);
    else if (s == "--dtype") a.dtype = argv[++i];
    else if (s == "--worker") a.worker = argv[++i];
    else throw std::invalid_argument("unknown argument '" + s + "'");
  }
  a.finish();
  std::string why;
  a.compute_dtype = qlora::bench::resolve_bench_dtype(a.dtype, &why);
  if (!a.worker.empty()) {
    std::cout << run_worker(a).dump() << std::endl;
    return 0;
  }
  a.ensure_checkpoint(QLORA_PYTHON, QLORA_SOURCE_DIR);
  const std::string self = fs::read_symlink("/proc/self/exe").string() + a.flags() + " --pairs " +
                           std::to_string(a.pairs) + " --dtype " + a.dtype + " --workdir " + a.workdir +
                           (a.ac ? "" : " --no-activation-checkpointing");
  json r = {{"bench", "preference_step"},
            {"machine", {{"cpu", qlora::bench::cpu_model()}, {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)},
                         {"cpu_isa", qlora::kernels::isa_name(qlora::kernels::active_isa())},
                         {"loadavg_before", qlora::bench::load_average()}}},
            {"shape", {{"hidden", a.hidden}, {"layers", a.layers}, {"vocab", a.vocab}, {"seq", a.seq},
                       {"pairs", a.pairs}, {"rows", 2 * a.pairs}, {"steps", a.steps}, {"compute_dtype", a.dtype},
                       {"dtype_why", why}, {"base", "nf4"}, {"activation_checkpointing", a.ac}, {"lora", "r 8 on every decoder projection"}}}};
  for (const char* mode : {"sft", "dpo", "dpo_precomputed", "dora"}) r[mode] = qlora::bench::run_json(self + " --worker " + mode);
  for (const char* mode : {"sft", "dpo", "dpo_precomputed", "dora"})
    if (!r[mode].contains("median_step_s")) throw std::runtime_error(std::string(mode) + ": " + r[mode].dump());
  const double dpo = ratio(r, "dpo", "sft", "median_step_s"), mem = ratio(r, "dpo", "sft", "peak_rss_bytes"),
               dora = ratio(r, "dora", "sft", "median_step_s");
  r["ratios"] = {{"dpo_over_sft_step", dpo}, {"dpo_precomputed_over_sft_step", ratio(r, "dpo_precomputed", "sft", "median_step_s")},
                 {"dpo_over_sft_peak_rss", mem}, {"dora_over_lora_step", dora},
                 {"dora_over_lora_peak_rss", ratio(r, "dora", "sft", "peak_rss_bytes")}};
  r["targets"] = {{"dpo_step_le_1.4x_sft", dpo <= 1.4}, {"dpo_peak_le_1.1x_sft", mem <= 1.1}, {"dora_step_le_1.3x_lora", dora <= 1.3}};
  r["machine"]["loadavg_after"] = qlora::bench::load_average();
  std::cout << r.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_preference_step: " << e.what() << "\n";
  return 1;
}
