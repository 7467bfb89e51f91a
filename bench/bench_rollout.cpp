// GRPO's rollout phase: generated tokens/s of models::generate_batch (all of a step's completions
// in one batch, each prompt prefilled once, the KV cache) beside transformers' generate on the
// same model and batch (bench/rollout_peer.py), measured in the same run. The peer writes a random
// Llama of the given shape (~100M by default: hidden 768, MLP 2048, 12 layers of 12 heads, vocab
// 32000) to a temporary directory. --base nf4 (the default, as lora_grpo's rollouts run): ours
// loads the decoder projections as NF4, and the peer multiplies by the same values dense (torchao's
// NF4 round trip of each, in fp32); --base dense: both load fp32. Both generate greedily (no EOS,
// so every sequence makes --new tokens) for --prompts prompts of different lengths x
// --generations each. Prints one JSON object: the CPU, both sides' median seconds and tokens/s,
// the speedup and how many sequences came out token for token equal.
//
//   build/bench_rollout [--hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000] [--base nf4|dense]
//                       [--prompts 8] [--generations 4] [--new 64] [--reps 2] [--threads N] [--no-peer]
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "bench/machine.h"
#include "bench/run_json.h"
#include "qlora/engine/omp_wait_policy.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/models/generate.h"

using nlohmann::json;

// libgomp's short spin, as qlora's programs run (engine/omp_wait_policy.h); the peer inherits it.
QLORA_OMP_WAIT_POLICY_PREINIT;

namespace {

struct Args {
  int64_t hidden = 768, inter = 2048, layers = 12, heads = 12, vocab = 32000;
  int64_t prompts = 8, generations = 4, new_tokens = 64;
  int reps = 2, threads = 0;
  bool peer = true, nf4 = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
      return argv[++i];
    };
    if (s == "--hidden") a.hidden = std::stoll(next());
    else if (s == "--inter") a.inter = std::stoll(next());
    else if (s == "--layers") a.layers = std::stoll(next());
    else if (s == "--heads") a.heads = std::stoll(next());
    else if (s == "--vocab") a.vocab = std::stoll(next());
    else if (s == "--prompts") a.prompts = std::stoll(next());
    else if (s == "--generations") a.generations = std::stoll(next());
    else if (s == "--new") a.new_tokens = std::stoll(next());
    else if (s == "--reps") a.reps = std::stoi(next());
    else if (s == "--threads") a.threads = std::stoi(next());
    else if (s == "--no-peer") a.peer = false;
    else if (s == "--base") {
      const std::string b = next();
      if (b != "nf4" && b != "dense") throw std::invalid_argument("--base is nf4 or dense, not " + b);
      a.nf4 = b == "nf4";
    }
    else throw std::invalid_argument("unknown argument " + s);
  }
  if (a.prompts < 1 || a.generations < 1 || a.new_tokens < 1 || a.reps < 1)
    throw std::invalid_argument("--prompts, --generations, --new and --reps must be >= 1");
  return a;
}

// Prompt i: 16 + 4i tokens (different lengths, as a step's prompts are), as rollout_peer.py's prompt_ids.
int64_t prompt_length(int64_t i) { return 16 + 4 * i; }
std::vector<int64_t> prompt_ids(int64_t i, int64_t vocab) {
  std::vector<int64_t> ids;
  for (int64_t j = 0; j < prompt_length(i); ++j) ids.push_back((31 * i + 17 * j + 5) % vocab);
  return ids;
}

std::string shape_flags(const Args& a) {
  return " --hidden " + std::to_string(a.hidden) + " --inter " + std::to_string(a.inter) + " --layers " +
         std::to_string(a.layers) + " --heads " + std::to_string(a.heads) + " --vocab " + std::to_string(a.vocab);
}

// Ours: the median of --reps timed generate_batch calls after a short warm-up; the last ids.
json ours(const Args& a, const std::string& dir, std::vector<std::vector<int64_t>>& ids) {
  qlora::models::DecoderLoadOptions lo;  // fp32 compute, the decoder projections NF4 or dense
  lo.base_in_nf4 = a.nf4;
  const qlora::models::DecoderModel m = qlora::models::load_decoder(dir, lo);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t i = 0; i < a.prompts; ++i) prompts.push_back(prompt_ids(i, a.vocab));
  std::vector<qlora::models::BatchSequence> seqs;
  for (int64_t i = 0; i < a.prompts * a.generations; ++i) {
    qlora::models::BatchSequence s;
    s.prompt = i / a.generations;
    s.options.max_new_tokens = a.new_tokens;  // greedy, no stop ids
    seqs.push_back(s);
  }
  std::vector<double> times;
  int64_t tokens = 0;
  const auto run = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<qlora::models::Completion> out = qlora::models::generate_batch(m, prompts, seqs);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    ids.clear();
    tokens = 0;
    for (const auto& c : out) ids.push_back(c.ids), tokens += static_cast<int64_t>(c.ids.size());
  };
  run();  // warm-up (full length: the allocator's sizes settle)
  times.clear();
  for (int i = 0; i < a.reps; ++i) run();
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double s = sorted[sorted.size() / 2];
  return {{"impl", std::string("qlora models::generate_batch (fp32, ") + (a.nf4 ? "NF4" : "dense") + " base)"}, {"threads", at::get_num_threads()},
          {"seconds", s}, {"times", times}, {"tokens", tokens}, {"tokens_per_s", double(tokens) / s}};
}

json measure(const Args& a) {
  const std::string py = std::string(QLORA_PYTHON) + " " + QLORA_SOURCE_DIR + "/bench/rollout_peer.py";
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("bench_rollout_" + std::to_string(getpid()));
  json r;
  const json w = qlora::bench::run_json(py + " --write " + dir.string() + shape_flags(a) + " 2>/dev/null");
  if (w.contains("error")) return {{"error", w}};
  try {
    std::vector<std::vector<int64_t>> ids;
    r["qlora"] = ours(a, dir.string(), ids);
    if (a.peer) {
      std::string lengths;
      for (int64_t i = 0; i < a.prompts; ++i) lengths += (i ? "," : "") + std::to_string(prompt_length(i));
      r["peer"] = qlora::bench::run_json(py + " --run " + dir.string() + " --lengths " + lengths + " --generations " +
                                         std::to_string(a.generations) + " --new " + std::to_string(a.new_tokens) +
                                         " --reps " + std::to_string(a.reps) + " --threads " +
                                         std::to_string(a.threads) + (a.nf4 ? " --nf4" : "") + " 2>/dev/null");
    }
    if (r.contains("peer") && r["peer"].contains("ids")) {
      int64_t equal = 0;
      std::vector<int64_t> first_differ;  // per unequal pair: the first position where the tokens differ
      for (size_t i = 0; i < ids.size() && i < r["peer"]["ids"].size(); ++i) {
        const auto theirs = r["peer"]["ids"][i].get<std::vector<int64_t>>();
        if (theirs == ids[i]) {
          ++equal;
          continue;
        }
        const auto mis = std::mismatch(theirs.begin(), theirs.end(), ids[i].begin(), ids[i].end());
        first_differ.push_back(mis.first - theirs.begin());
      }
      r["sequences_equal"] = equal;
      r["first_difference_at"] = first_differ;
      r["peer"].erase("ids");
      r["speedup"] = r["qlora"]["tokens_per_s"].get<double>() / r["peer"]["tokens_per_s"].get<double>();
    }
  } catch (const std::exception& e) {
    r["error"] = e.what();
  }
  std::filesystem::remove_all(dir);  // ~270 MB of bf16 at the default shape
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "bench_rollout: " << e.what()
              << "\nusage: bench_rollout [--hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000]"
                 " [--base nf4|dense] [--prompts 8] [--generations 4] [--new 64] [--reps 2] [--threads N] [--no-peer]\n";
    return 2;
  }
  qlora::io::tune_cpu_memory();
  if (a.threads > 0) at::set_num_threads(a.threads);
  json j{{"bench", "rollout_generate"},
         {"machine", qlora::bench::machine_json()},
         {"shape", {{"hidden", a.hidden}, {"intermediate", a.inter}, {"layers", a.layers}, {"heads", a.heads},
                    {"vocab", a.vocab}, {"dtype", "fp32"}, {"base", a.nf4 ? "nf4" : "dense"}}},
         {"batch", {{"prompts", a.prompts}, {"prompt_lengths", "16 + 4 i"}, {"generations", a.generations},
                    {"new_tokens", a.new_tokens}, {"sampling", "greedy"}}},
         {"reps", a.reps}};
  j["runs"] = measure(a);
  j["machine"]["load_average_after"] = qlora::bench::load_average();
  std::cout << j.dump(2) << std::endl;
  return j["runs"].contains("error") ? 1 : 0;
}
