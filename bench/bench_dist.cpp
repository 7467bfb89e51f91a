// Sharded training on CPU ranks (Gloo), measured in one run and printed as one JSON object:
//   - tokens/s of the QLoRA step on 1 rank vs 2 ranks (~100M Llama shape, the recipe's path:
//     its build_model streaming each layer into the sharded engine), each rank batch 1 x seq;
//   - decoder-layer bytes all-gathered per step as NF4 against what bf16 weights would move (the
//     embedding and head are dense and move as stored, reported in the total);
//   - the 2-rank step with prefetch (gather overlapped with compute) against prefetch off;
//   - the merged per-epoch export of the same model on 1 process and 2 ranks (parallel writers)
//     against the raw sequential write speed of the same disk;
//   - with --shape NAME (--llama2-7b: --shape llama2-7b): a real model shape (random NF4,
//     bench/model_shapes.h) on 1 process (a world of one) and on 2 ranks, per-rank peak RSS beside
//     the single-process figure.
//
//   build/bench_dist [--hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000] [--seq 512]
//                    [--steps 3] [--workdir DIR]
//   build/bench_dist --shape llama2-7b|qwen2.5-7b|... [--layers N] [--seq 128] [--steps 1]
// Each configuration runs in fresh processes (this program relaunches itself with --worker under
// the qlora launcher), so every peak RSS is that configuration's own.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/random_llama.h"
#include "bench/recipe_model.h"
#include "bench/run_json.h"
#include "bench/shape_args.h"
#include "bench/timing.h"
#include "qlora/engine/launcher.h"
#include "qlora/engine/omp_wait_policy.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_export.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/checkpoint/export.h"
#include "qlora/optim/adamw.h"
#include "qlora/report/metrics.h"

using nlohmann::json;
namespace fs = std::filesystem;
using namespace qlora;

QLORA_OMP_WAIT_POLICY_PREINIT;  // the ranks' OpenMP workers spin briefly, then sleep (omp_wait_policy.h)

namespace {

struct Args : bench::ShapeArgs {
  bool worker = false, prefetch = true;
  std::string export_to;  // worker: time a merged per-epoch export into this directory instead of steps
};

using qlora::bench::seconds_since;

int64_t bytes_under(const fs::path& dir) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  return n;
}

// Sequential write speed of the disk under `dir`: `bytes` in 8 MiB writes, then fsync (what a
// writer that streams one file could reach). A scratch file, never committed, so it bypasses
// io::commit_aside (durable_file.h) on purpose: the rename and directory fsync are not the disk's speed.
double raw_write_mb_s(const fs::path& dir, int64_t bytes) {
  const fs::path p = dir / "raw_write_probe.bin";
  std::vector<char> buf(8 << 20, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  FILE* f = std::fopen(p.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + p.string());
  for (int64_t left = bytes; left > 0; left -= static_cast<int64_t>(buf.size()))
    std::fwrite(buf.data(), 1, static_cast<size_t>(std::min<int64_t>(left, buf.size())), f);
  std::fflush(f);
  ::fsync(fileno(f));
  std::fclose(f);
  const double s = seconds_since(t0);
  fs::remove(p);
  return bytes / s / 1e6;
}


// One rank of one configuration; rank 0 prints the JSON.
json run_worker(const Args& a) {
  const engine::RankEnv env = engine::rank_env_from_environment();
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / env.local_world_size));
  // One process is a world of one: the same engine, nothing gathered.
  const std::unique_ptr<engine::World> world = engine::World::join(env, 0, std::chrono::seconds(900), c10::kCPU);
  // The recipe's model of the checkpoint (the embedding and head stored in bf16, as it stores a bf16
  // checkpoint's), or a real shape built in memory.
  config::RecipeConfig cfg = bench::recipe_config(at::kFloat, 8, 16.0, true);
  cfg.dist.prefetch = a.prefetch;
  recipes::DecoderBuilder build;
  if (!a.shape.empty())
    build = [&](const models::DecoderLoadOptions& o) {
      return bench::random_model(a.shape_config(), o.lora_r, o.lora_alpha, o.activation_checkpointing, o.on_layer_loaded);
    };
  const auto t0 = std::chrono::steady_clock::now();
  recipes::Model model = recipes::build_model(bench::session(cfg, c10::kCPU, *world, a.workdir), build);
  const double load_s = seconds_since(t0);
  models::DecoderModel& m = model.decoder;
  const std::shared_ptr<engine::ShardedDecoder>& engine = model.engine;
  const std::unique_ptr<optim::AdamW> opt = recipes::make_adamw(cfg, model);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7 + env.rank);
  const at::Tensor tokens = at::randint(0, m.config.vocab_size, {1, a.seq + 1}, gen);
  const at::Tensor inp = tokens.narrow(1, 0, a.seq), labels = tokens.narrow(1, 1, a.seq);
  auto step = [&] {
    // The mean token loss over all ranks, by the chunked output loss as the recipe forms it.
    const at::Tensor loss = m.loss(inp, labels) / static_cast<double>(labels.numel() * env.world_size);
    torch::autograd::backward({loss});
    engine->finish_backward();
    engine->clip_grad_norm(1.0);
    opt->step();
    engine->gather_params();
  };
  if (!a.export_to.empty()) {  // the export of this model instead of training steps
    const checkpoint::AdapterInfo info{8, 16.0, 0.0, {}, a.workdir};
    world->world().barrier();
    const auto te = std::chrono::steady_clock::now();
    engine::export_epoch(a.export_to, 0, m, *engine, *world, info, false, a.workdir, checkpoint::MergeSource::Nf4, "");
    const double secs = seconds_since(te);
    const int64_t bytes = bytes_under(fs::path(a.export_to) / "epoch_0");
    json j = {{"ranks", env.world_size}, {"export_s", secs}, {"export_bytes", bytes},
              {"export_mb_s", bytes / secs / 1e6}};
    world->finish();
    return j;
  }
  if (a.shape.empty()) step();  // warm-up (a real shape skips it to stay within minutes)
  const engine::ShardStats before = engine ? engine->stats() : engine::ShardStats{};
  std::vector<double> times;
  for (int64_t s = 0; s < a.steps; ++s) {
    const auto t = std::chrono::steady_clock::now();
    step();
    times.push_back(seconds_since(t));
  }
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  // Every rank's peak RSS, gathered to all.
  at::Tensor rss = at::full({1}, static_cast<double>(io::peak_rss_bytes()), at::kDouble);
  at::Tensor all_rss = at::empty({env.world_size}, at::kDouble);
  engine::wait(world->world().all_gather(all_rss, rss));
  json j = {{"ranks", env.world_size}, {"prefetch", a.prefetch},
            {"threads_per_rank", at::get_num_threads()}, {"load_s", load_s}, {"median_step_s", med},
            {"tokens_per_s", double(a.seq * env.world_size) / med}};
  std::vector<double> rss_v(all_rss.data_ptr<double>(), all_rss.data_ptr<double>() + env.world_size);
  j["peak_rss_bytes_per_rank"] = rss_v;
  {
    const engine::ShardStats& st = engine->stats();
    j["gathered_bytes_per_step"] = double(st.bytes_gathered - before.bytes_gathered) / a.steps;
    j["layer_gathered_bytes_per_step"] = double(st.layer_bytes_gathered - before.layer_bytes_gathered) / a.steps;
    j["layer_gathered_bytes_per_step_if_bf16"] = double(st.layer_bytes_as_bf16 - before.layer_bytes_as_bf16) / a.steps;
    j["gathers_per_step"] = double(st.gathers - before.gathers) / a.steps;
  }
  world->finish();
  return j;
}

std::string flags(const Args& a) { return a.flags() + " --workdir " + a.workdir; }

std::string self_exe() { return fs::read_symlink("/proc/self/exe").string(); }

// One configuration in fresh processes: `ranks` of them under the qlora launcher.
json configuration(const Args& a, int ranks, bool prefetch) {
  std::string cmd = self_exe() + " --launch " + std::to_string(ranks) + " --worker" + flags(a);
  if (!prefetch) cmd += " --no-prefetch";
  return bench::run_json(cmd);
}

}  // namespace

int main(int argc, char** argv) try {
  qlora::io::tune_cpu_memory();
  Args a;
  int launch = 0;
  std::vector<std::string> worker_args(argv + 1, argv + argc);  // what a launched rank is given
  for (int i = 1; i < argc; ++i) {
    if (a.parse(argc, argv, i)) continue;
    const std::string s = argv[i];
    if (s == "--launch") {
      if (i + 1 >= argc) throw std::invalid_argument("--launch needs a value");
      launch = std::stoi(argv[++i]);
      worker_args.erase(worker_args.begin() + (i - 2), worker_args.begin() + i);
    } else if (s == "--worker") a.worker = true;
    else if (s == "--no-prefetch") a.prefetch = false;
    else if (s == "--export-to" && i + 1 < argc) a.export_to = argv[++i];
    else { std::cerr << "bench_dist: unknown argument " << s << "\n"; return 2; }
  }
  a.finish();
  if (launch > 1) {  // this process is the launcher of one configuration
    engine::LaunchOptions lo;
    lo.nproc_per_node = launch;
    return engine::launch(lo, self_exe(), worker_args);
  }
  if (a.worker) {
    const json j = run_worker(a);
    if (engine::rank_env_from_environment().rank == 0) std::cout << j.dump() << std::endl;
    return 0;
  }

  json r = {{"bench", "dist"}, {"backend", "gloo (CPU)"}, {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)}};
  for (const char* v : {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"})  // what the ranks inherit
    if (const char* set = std::getenv(v)) r["omp_wait"][v] = set;
  if (!a.shape.empty()) {
    r["shape"] = {{"model", a.shape + " (random NF4, in memory)"}, {"layers", a.layers}, {"seq", a.seq}, {"steps", a.steps}};
    r["one_process"] = configuration(a, 1, true);
    r["two_ranks"] = configuration(a, 2, true);
  } else {
    a.ensure_checkpoint(QLORA_PYTHON, QLORA_SOURCE_DIR);
    r["shape"] = {{"hidden", a.hidden}, {"layers", a.layers}, {"vocab", a.vocab}, {"seq", a.seq},
                  {"batch_per_rank", 1}, {"steps", a.steps}, {"checkpoint", a.workdir}};
    r["one_rank"] = configuration(a, 1, true);
    r["two_ranks"] = configuration(a, 2, true);
    r["two_ranks_no_prefetch"] = configuration(a, 2, false);
    // Per-epoch export of the same model (merged from NF4): 1 process vs 2 ranks writing in
    // parallel, against the raw sequential write speed of the same disk.
    const fs::path ex = fs::temp_directory_path() / ("qlora_bench_export_" + std::to_string(::getpid()));
    fs::remove_all(ex);
    fs::create_directories(ex);
    // Measured first, with nothing else in flight (dirty pages of an export would slow it).
    const double raw = raw_write_mb_s(ex, int64_t{256} << 20);
    r["raw_sequential_write_mb_s"] = raw;
    r["export_one_rank"] = bench::run_json(self_exe() + " --worker" + flags(a) + " --export-to " + (ex / "one").string());
    r["export_two_ranks"] = bench::run_json(self_exe() + " --launch 2 --worker" + flags(a) + " --export-to " + (ex / "two").string());
    if (r["export_two_ranks"].contains("export_bytes")) {
      r["export_two_ranks_vs_raw_write"] = r["export_two_ranks"]["export_mb_s"].get<double>() / raw;
      if (r["export_one_rank"].contains("export_mb_s"))
        r["export_one_rank_vs_raw_write"] = r["export_one_rank"]["export_mb_s"].get<double>() / raw;
    }
    fs::remove_all(ex);
    const json& one = r["one_rank"];
    const json& two = r["two_ranks"];
    if (one.contains("tokens_per_s") && two.contains("tokens_per_s"))
      r["speedup_2_ranks_vs_1"] = two["tokens_per_s"].get<double>() / one["tokens_per_s"].get<double>();
    if (two.contains("layer_gathered_bytes_per_step"))
      r["layer_gather_bytes_nf4_vs_bf16"] = two["layer_gathered_bytes_per_step"].get<double>() /
                                            two["layer_gathered_bytes_per_step_if_bf16"].get<double>();
    if (two.contains("median_step_s") && r["two_ranks_no_prefetch"].contains("median_step_s"))
      r["step_time_prefetch_vs_not"] =
          two["median_step_s"].get<double>() / r["two_ranks_no_prefetch"]["median_step_s"].get<double>();
  }
  std::cout << r.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_dist: " << e.what() << "\n";
  return 1;
}
