// One lora_grpo step split into its phases, beside lora_finetune's step on the same tokens, on the
// ~100M Llama shape (the random checkpoint bench_train_step uses; NF4 base, LoRA r 8 on every decoder
// projection, AdamW, one rank through the sharded engine, set up by the recipes' own build_model):
//   generation  P prompts x G completions of --new tokens, one batch (models::generate_batch,
//               temperature 1, no stop token: every completion runs to --new)
//   old_policy  the completions' per-token log-probs, no gradient (grpo.num_iterations > 1)
//   reference   the same with the adapters off (grpo.beta != 0)
//   update      the policy's log-probs with their graph, DAPO's loss, backward, AdamW
//   sft         lora_finetune's step (summed cross-entropy over the completion tokens) on the same rows
// The library calls are the recipe's (train/grpo_batch.h, train/grpo_loss.h). Prints one JSON
// object: the phases' medians, the generated tokens/s, update / sft, and the peak RSS.
//
//   build/bench_grpo_step [--hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000]
//                         [--seq 64 (prompt tokens)] [--prompts 4] [--generations 4] [--new 64]
//                         [--steps 3] [--dtype fp32|bf16|auto]
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_dtype.h"
#include "bench/machine.h"
#include "bench/recipe_model.h"
#include "bench/shape_args.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/engine/omp_wait_policy.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/models/generate.h"
#include "qlora/optim/adamw.h"
#include "qlora/train/grpo_batch.h"
#include "qlora/train/grpo_loss.h"

using nlohmann::json;
namespace tr = qlora::train;

// libgomp's short spin, as qlora's programs run (engine/omp_wait_policy.h).
QLORA_OMP_WAIT_POLICY_PREINIT;

namespace {

struct Args : qlora::bench::ShapeArgs {
  int64_t prompts = 4, generations = 4, new_tokens = 64;
  std::string dtype = "fp32";
  Args() { seq = 64; }
};

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

using qlora::bench::median;

json run(const Args& a, at::ScalarType dtype) {
  const auto world = qlora::engine::World::join(qlora::engine::RankEnv{}, 0, std::chrono::seconds(60), c10::kCPU);
  const qlora::config::RecipeConfig cfg = qlora::bench::recipe_config(dtype, 8, 16.0, false);
  qlora::recipes::Model model = qlora::recipes::build_model(qlora::bench::session(cfg, c10::kCPU, *world),
                                                            qlora::bench::load_in_compute_dtype(a.workdir));
  qlora::models::DecoderModel& m = model.decoder;
  const std::unique_ptr<qlora::optim::AdamW> opt = qlora::recipes::make_adamw(cfg, model);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<std::vector<int64_t>> prompts;
  std::vector<qlora::models::BatchSequence> seqs;
  for (int64_t p = 0; p < a.prompts; ++p) {
    const at::Tensor ids = at::randint(3, a.vocab, {a.seq}, gen).contiguous();
    prompts.emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + a.seq);
    for (int64_t k = 0; k < a.generations; ++k) {
      qlora::models::GenerateOptions g{a.new_tokens, 1.0, 1.0, 0, qlora::models::sequence_seed(1, p * a.generations + k), {}};
      seqs.push_back({p, g});
    }
  }
  tr::GrpoOptions grpo;
  grpo.num_generations = a.generations;
  std::map<std::string, std::vector<double>> t;
  double sft_loss = 0;
  for (int64_t step = 0; step <= a.steps; ++step) {  // step 0 warms up, untimed
    std::vector<qlora::models::Completion> out;
    std::map<std::string, double> s;
    s["generation"] = seconds_of([&] { out = qlora::models::generate_batch(m, prompts, seqs); });
    std::vector<tr::Completion> comps;
    for (size_t i = 0; i < out.size(); ++i) comps.push_back({prompts[static_cast<size_t>(seqs[i].prompt)], out[i].ids, true});
    const tr::CompletionBatch b = tr::completion_batch(comps, 0);
    tr::GrpoInputs in;
    s["old_policy"] = seconds_of([&] { in.old_logps = tr::completion_logps(m, b, at::kCPU, tr::LogpsOf::kOld); });
    s["reference"] = seconds_of([&] { in.ref_logps = tr::completion_logps(m, b, at::kCPU, tr::LogpsOf::kReference); });
    const at::Tensor rewards = at::rand({static_cast<int64_t>(comps.size())}, gen);
    in.advantages = tr::grpo_advantages(rewards, a.generations, grpo.scale_rewards);
    in.mask = tr::grpo_loss_mask(b.completion_mask, b.truncated, false);
    const auto update = [&](const at::Tensor& loss) {
      loss.backward();
      model.engine->finish_backward();
      opt->step();
      model.engine->gather_params();
    };
    s["update"] = seconds_of([&] {
      in.logps = tr::completion_logps(m, b, at::kCPU, tr::LogpsOf::kPolicy);
      update(tr::grpo_loss(in, grpo).loss);
    });
    s["sft"] = seconds_of([&] {
      const at::Tensor loss = m.loss(b.rows.tokens, b.rows.labels) / static_cast<double>(b.rows.num_label_tokens);
      update(loss);
      sft_loss = loss.item<double>();
    });
    if (step > 0)
      for (const auto& [k, v] : s) t[k].push_back(v);
  }
  json r = {{"sft_loss", sft_loss}, {"peak_rss_bytes", qlora::io::peak_rss_bytes()}};
  double grpo_step = 0;
  for (const auto& [k, v] : t) {
    r[k + "_s"] = median(v);
    if (k != "sft") grpo_step += median(v);
  }
  const double generated = static_cast<double>(a.prompts * a.generations * a.new_tokens);
  r["grpo_step_s"] = grpo_step;
  r["generated_tokens_per_s"] = generated / median(t["generation"]);
  r["update_over_sft"] = median(t["update"]) / median(t["sft"]);
  r["grpo_step_over_sft"] = grpo_step / median(t["sft"]);
  return r;
}

}  // namespace

int main(int argc, char** argv) try {
  qlora::io::tune_cpu_memory();
  Args a;
  for (int i = 1; i < argc; ++i) {
    if (a.parse(argc, argv, i)) continue;
    const std::string s = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
    if (s == "--prompts") a.prompts = std::stoll(argv[++i]);
    else if (s == "--generations") a.generations = std::stoll(argv[++i]);
    else if (s == "--new") a.new_tokens = std::stoll(argv[++i]);
    else if (s == "--dtype") a.dtype = argv[++i];
    else throw std::invalid_argument("unknown argument '" + s + "'");
  }
  a.finish();
  if (a.generations < 2) throw std::invalid_argument("--generations must be >= 2 (a group)");
  std::string why;
  const at::ScalarType dtype = qlora::bench::resolve_bench_dtype(a.dtype, &why);
  a.ensure_checkpoint(QLORA_PYTHON, QLORA_SOURCE_DIR);
  json r = {{"bench", "grpo_step"},
            {"machine", {{"cpu", qlora::bench::cpu_model()}, {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)},
                         {"cpu_isa", qlora::kernels::isa_name(qlora::kernels::active_isa())},
                         {"loadavg_before", qlora::bench::load_average()}}},
            {"shape", {{"hidden", a.hidden}, {"layers", a.layers}, {"vocab", a.vocab}, {"prompt_tokens", a.seq},
                       {"prompts", a.prompts}, {"generations", a.generations}, {"new_tokens", a.new_tokens},
                       {"steps", a.steps}, {"compute_dtype", a.dtype}, {"dtype_why", why}, {"base", "nf4"},
                       {"lora", "r 8 on every decoder projection"}, {"loss_type", "dapo"}}}};
  r["result"] = run(a, dtype);
  r["machine"]["loadavg_after"] = qlora::bench::load_average();
  std::cout << r.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_grpo_step: " << e.what() << "\n";
  return 1;
}
