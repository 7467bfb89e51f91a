// Consolidating the trainable state of the Llama-2-7B QLoRA config (LoRA r 8 on q,k,v,o,gate,up,
// down of 32 layers: 20.0M adapter values, with AdamW's two moments 240 MB in fp32) onto one writer
// rank, on 2 and 4 CPU ranks (Gloo), measured in one run and printed as one JSON object:
//   qlora     dist::gather_groups_to: per layer group, one gather to the writer of every rank's
//             [adapter | exp_avg | exp_avg_sq] shard (32 collectives in all);
//   per_param the loop the tools users have today run: for every parameter and state kind, an
//             all-gather of that parameter's even shards (DTensor.full_tensor), rank 0 keeping a
//             copy (1344 collectives);
//   per_param_gather the same loop with gathers to rank 0 instead of all-gathers.
//   build/bench_state_dict [--reps 3]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "bench/run_json.h"
#include "qlora/dist/flat_layout.h"
#include "qlora/dist/launcher.h"
#include "qlora/dist/process_group.h"
#include "qlora/dist/sharded_state.h"

using nlohmann::json;
using namespace qlora;

namespace {

constexpr int64_t kLayers = 32, kHidden = 4096, kInter = 11008, kRank = 8, kKinds = 3;

// The adapters of one layer, as the recipe groups them: {A [r, in], B [out, r]} per projection.
std::vector<std::vector<int64_t>> layer_params() {
  const int64_t io[7][2] = {{kHidden, kHidden}, {kHidden, kHidden}, {kHidden, kHidden}, {kHidden, kHidden},
                            {kHidden, kInter},  {kHidden, kInter},  {kInter, kHidden}};
  std::vector<std::vector<int64_t>> out;
  for (const auto& p : io) {
    out.push_back({kRank, p[0]});
    out.push_back({p[1], kRank});
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

json run_worker(int reps) {
  const dist::RankEnv env = dist::rank_env_from_environment();
  at::set_num_threads(1);
  auto world = dist::World::join(env, 0, std::chrono::seconds(600), c10::kCPU);
  dist::Comm& c = world->world();
  const int n = c.size(), me = c.rank();
  // The sharded engine's layout: one flat fp32 group per layer, padded for n ranks.
  std::vector<std::vector<at::Tensor>> shards;
  std::vector<int64_t> used;
  int64_t values = 0;
  for (int64_t l = 0; l < kLayers; ++l) {
    dist::FlatLayout layout(at::kFloat, n);
    int k = 0;
    for (const auto& shape : layer_params()) layout.add("p" + std::to_string(k++), at::kFloat, shape);
    std::vector<at::Tensor> kinds;
    for (int64_t kind = 0; kind < kKinds; ++kind) kinds.push_back(at::randn({layout.shard_numel()}));
    shards.push_back(kinds);
    used.push_back(layout.used());
    values += layout.used();
  }
  auto timed = [&](auto&& fn) {
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      c.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      c.barrier();
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return median(t);
  };
  const double ours = timed([&] { dist::gather_groups_to(c, 0, shards, used); });
  // Per parameter: each evenly sharded on its own (padded to n), one collective each.
  std::vector<at::Tensor> pieces;
  for (int64_t l = 0; l < kLayers; ++l)
    for (const auto& shape : layer_params())
      for (int64_t kind = 0; kind < kKinds; ++kind) pieces.push_back(at::randn({(shape[0] * shape[1] + n - 1) / n}));
  const double per_param = timed([&] {
    for (const at::Tensor& p : pieces) {
      at::Tensor full = at::empty({p.numel() * n});
      dist::wait(c.all_gather(full, p));
      if (me == 0) full = full.clone();  // rank 0 keeps it for the writer
    }
  });
  const double per_param_gather = timed([&] {
    for (const at::Tensor& p : pieces) {
      at::Tensor full = me == 0 ? at::empty({p.numel() * n}) : at::empty({0});
      dist::wait(c.gather_to(0, full, p));
    }
  });
  json j = {{"ranks", n},
            {"values", values},
            {"state_bytes", values * kKinds * 4},
            {"collectives_qlora", kLayers},
            {"collectives_per_param", static_cast<int64_t>(pieces.size())},
            {"qlora_s", ours},
            {"per_param_all_gather_s", per_param},
            {"per_param_gather_s", per_param_gather},
            {"speedup_vs_per_param_all_gather", per_param / ours},
            {"speedup_vs_per_param_gather", per_param_gather / ours}};
  world->finish();
  return j;
}

}  // namespace

int main(int argc, char** argv) try {
  int reps = 3, launch = 0;
  bool worker = false;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
    else if (s == "--launch" && i + 1 < argc) launch = std::stoi(argv[++i]);
    else if (s == "--worker") worker = true;
    else { std::cerr << "bench_state_dict: unknown argument " << s << "\n"; return 2; }
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  if (launch > 1) {
    dist::LaunchOptions lo;
    lo.nproc_per_node = launch;
    return dist::launch(lo, self, {"--worker", "--reps", std::to_string(reps)});
  }
  if (worker) {
    const json j = run_worker(reps);
    if (dist::rank_env_from_environment().rank == 0) std::cout << j.dump() << std::endl;
    return 0;
  }
  json r = {{"bench", "state_dict_consolidation"}, {"backend", "gloo (CPU)"},
            {"config", "llama2-7b QLoRA: r 8 on q,k,v,o,gate,up,down x 32 layers, adapter + AdamW moments"},
            {"target", "qlora >= 5x the per-parameter loop"}};
  for (int ranks : {2, 4})
    r["ranks_" + std::to_string(ranks)] = bench::run_json(self + " --launch " + std::to_string(ranks) + " --worker --reps " +
                                                          std::to_string(reps));
  std::cout << r.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_state_dict: " << e.what() << "\n";
  return 1;
}
