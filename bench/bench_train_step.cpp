// QLoRA training-step throughput and peak memory on the CPU: qlora (load_llama with an NF4 base,
// fp32 LoRA on q,k,v,o,gate,up,down, AdamW) against the same step in PyTorch + torchao
// (bench/peer_train_step.py), same shapes, same random checkpoint, measured in the same run.
// Each side runs in its own process so its VmHWM (peak RSS) is its own: this program re-executes
// itself with --worker for the qlora side and popen()s the peer. Prints one JSON object.
//
//   build/bench_train_step [--hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000]
//                          [--seq 512] [--batch 1] [--steps 3] [--r 8 --alpha 16]
//                          [--workdir DIR] [--no-peer]
//   build/bench_train_step --shape NAME [--seq 128] [--steps 1] [--layers N] [--r 8 --alpha 16]
//                          [--no-activation-checkpointing]
//       NAME: llama2-7b|llama3.1-8b|mistral-7b|qwen2.5-7b|qwen3-8b|gemma2-9b|gemma3-12b|phi3-mini
//       (bench/model_shapes.h, parsed from each model's config.json; --llama2-7b is --shape
//       llama2-7b), all its layers unless --layers, built in memory with random NF4 weights
//       (writing and re-reading 13-18 GB of bf16 would dominate the run); reports seconds per
//       step and peak RSS, no peer.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Reduction.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "bench/memory_account.h"
#include "bench/random_llama.h"
#include "bench/shape_args.h"
#include "bench/run_json.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/models/llama.h"
#include "qlora/modules/layers.h"
#include "qlora/optim/adamw.h"
#include "quant/nf4_tensor.h"

using nlohmann::json;
namespace fs = std::filesystem;
using qlora::bench::run_json;

namespace {

struct Args : qlora::bench::ShapeArgs {
  int64_t batch = 1, r = 8;
  double alpha = 16.0;
  std::string model;
  bool peer = true, worker = false;
  bool no_ac = false;
};

// Every decoder projection of the Llama shape (random_model adapts those of its family).
const std::vector<std::string> kTargets = qlora::models::layer_peft_names(qlora::models::llama_architecture());

int64_t vm_hwm_bytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// /proc/loadavg's 1, 5 and 15 minute load: how busy the shared machine was around the run.
std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string one, five, fifteen;
  f >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The qlora side, in its own process: load, warm-up step, timed steps, through the training
// engine as the recipe runs it in one process (a world of one).
json run_worker(const Args& a) {
  qlora::bench::MemoryAccount& acct = qlora::bench::MemoryAccount::install();
  acct.phase("load");
  const auto t0 = std::chrono::steady_clock::now();
  const auto world = qlora::engine::World::join(qlora::engine::RankEnv{}, 0, std::chrono::seconds(60), c10::kCPU);
  const auto engine = qlora::engine::ShardedLlama::begin(*world, {});
  auto on_layer = [&engine](int64_t i, qlora::modules::DecoderLayer& L, const qlora::models::Architecture& a) {
    engine->shard_layer(i, L, a);
  };
  qlora::models::LlamaModel m;
  if (!a.shape.empty()) {
    m = qlora::bench::random_model(a.shape_config(), a.r, a.alpha, !a.no_ac, on_layer);
  } else {
    qlora::models::LlamaLoadOptions o;
    o.base_in_nf4 = true;
    o.compute_dtype = at::kFloat;
    o.lora_targets = kTargets;
    o.lora_r = a.r;
    o.lora_alpha = a.alpha;
    o.on_layer_loaded = on_layer;
    m = qlora::models::load_llama(a.model, o);
  }
  engine->finish(m);
  qlora::io::release_free_cpu_memory();  // as the recipe does after loading
  const double load_s = seconds_since(t0);
  const int64_t rss_after_load = vm_hwm_bytes();
  m.training = true;
  int64_t trainable = 0;
  for (const auto& [name, t] : m.lora_parameters()) trainable += t.numel();
  qlora::optim::AdamWOptions ao;
  ao.lr = 1e-4;
  qlora::optim::AdamW opt(engine->param_shards(), ao);
  const int64_t V = m.config.vocab_size;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor tokens = at::randint(0, V, {a.batch, a.seq + 1}, gen);  // [batch, seq + 1]
  // Labels already shifted, as data/batching produces them.
  const at::Tensor inp = tokens.narrow(1, 0, a.seq), labels = tokens.narrow(1, 1, a.seq);

  auto step = [&]() {
    acct.phase("forward");
    const at::Tensor logits = m.forward(inp);  // [batch, seq, V] fp32
    acct.phase("loss");
    at::Tensor loss = at::cross_entropy_loss(logits.view({-1, V}), labels.reshape({-1}), {},
                                             at::Reduction::Mean, -100);
    acct.phase("backward");
    loss.backward();
    engine->finish_backward();
    acct.phase("optimizer");
    opt.step();
    engine->gather_params();
    return loss.item<double>();
  };
  std::vector<double> losses, times;
  // A real shape skips the warm-up to stay within minutes on a small CPU; its one step then
  // includes first-touch costs, so it is an upper bound.
  const bool warmup = a.shape.empty();
  if (warmup) losses.push_back(step());
  for (int64_t i = 0; i < a.steps; ++i) {
    const auto t = std::chrono::steady_clock::now();
    losses.push_back(step());
    times.push_back(seconds_since(t));
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double med = sorted[sorted.size() / 2];
  return {{"impl", "qlora (C++)"}, {"threads", at::get_num_threads()}, {"load_s", load_s},
          {"trainable_params", trainable}, {"warmup_step", warmup}, {"step_s", times},
          {"median_step_s", med}, {"tokens_per_s", double(a.batch * a.seq) / med},
          {"peak_rss_bytes", vm_hwm_bytes()}, {"rss_after_load_bytes", rss_after_load}, {"losses", losses},
          {"memory_accounting", acct.report(qlora::bench::model_static_bytes(m))}};
}

std::string shape_flags(const Args& a) {
  return a.flags() + " --batch " + std::to_string(a.batch) + " --r " + std::to_string(a.r) + " --alpha " +
         std::to_string(a.alpha);
}

std::string self_exe() { return fs::read_symlink("/proc/self/exe").string(); }

}  // namespace

int main(int argc, char** argv) try {
  qlora::io::tune_cpu_memory();
  Args a;
  for (int i = 1; i < argc; ++i) {
    if (a.parse(argc, argv, i)) continue;
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
      return argv[++i];
    };
    if (s == "--batch") a.batch = std::stoll(next());
    else if (s == "--r") a.r = std::stoll(next());
    else if (s == "--alpha") a.alpha = std::stod(next());
    else if (s == "--model") a.model = next();
    else if (s == "--no-peer") a.peer = false;
    else if (s == "--worker") a.worker = true;
    else if (s == "--no-activation-checkpointing") a.no_ac = true;
    else { std::cerr << "bench_train_step: unknown argument " << s << "\n"; return 2; }
  }
  a.finish();
  if (a.batch < 1) throw std::invalid_argument("--batch must be >= 1");
  if (a.worker) {
    std::cout << run_worker(a).dump() << std::endl;
    return 0;
  }

  json r = {{"bench", "train_step"},
            {"machine", {{"cpu", cpu_model()}, {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)},
                         {"loadavg_before", load_average()}}}};
  if (!a.shape.empty()) {
    const qlora::models::LlamaConfig c = a.shape_config();
    r["shape"] = {{"model", a.shape + " (random NF4, in memory)"}, {"model_type", c.model_type},
                  {"hidden", c.hidden_size}, {"intermediate", c.intermediate_size}, {"heads", c.num_attention_heads},
                  {"kv_heads", c.num_key_value_heads}, {"head_dim", c.head_dim}, {"vocab", c.vocab_size},
                  {"tied_embeddings", c.tie_word_embeddings}, {"layers", a.layers},
                  {"full_depth", qlora::bench::model_shape_config(a.shape).num_hidden_layers}, {"seq", a.seq},
                  {"batch", a.batch}, {"steps", a.steps}, {"lora_r", a.r}, {"lora_alpha", a.alpha},
                  {"lora_targets", qlora::models::layer_peft_names(qlora::models::architecture_of(c))},
                  {"base", "nf4"}, {"compute_dtype", "fp32"}, {"frozen_dtype", "bf16"},
                  {"activation_checkpointing", !a.no_ac}};
    json q = run_json(self_exe() + " --worker" + shape_flags(a) + (a.no_ac ? " --no-activation-checkpointing" : ""));
    r["qlora"] = q;
    if (q.contains("peak_rss_bytes")) {
      r["seconds_per_step"] = q["median_step_s"];
      r["peak_rss_gib"] = q["peak_rss_bytes"].get<double>() / (1024.0 * 1024 * 1024);
      if (a.shape == "llama2-7b" && a.seq == 128) r["target_peak_rss_le_4.9gb_met"] = q["peak_rss_bytes"].get<double>() <= 4.9e9;
    }
    r["machine"]["loadavg_after"] = load_average();
    std::cout << r.dump(2) << std::endl;
    return 0;
  }

  // One random bf16 checkpoint for both sides, written by the peer script once per shape.
  const std::string dir = a.workdir;
  const std::string py = std::string(QLORA_PYTHON) + " " + QLORA_SOURCE_DIR + "/bench/peer_train_step.py";
  a.ensure_checkpoint(QLORA_PYTHON, QLORA_SOURCE_DIR);
  r["shape"] = {{"hidden", a.hidden}, {"intermediate", a.inter}, {"layers", a.layers}, {"heads", a.heads},
                {"vocab", a.vocab}, {"seq", a.seq}, {"batch", a.batch}, {"steps", a.steps}, {"lora_r", a.r},
                {"lora_alpha", a.alpha}, {"lora_targets", kTargets}, {"base", "nf4"}, {"compute_dtype", "fp32"},
                {"checkpoint", dir}};
  const json q = run_json(self_exe() + " --worker --model " + dir + shape_flags(a));
  r["qlora"] = q;
  if (a.peer) {
    const json p = run_json(py + " --model " + dir + shape_flags(a));
    r["peer"] = p;
    if (q.contains("tokens_per_s") && p.contains("tokens_per_s")) {
      const double tps = q["tokens_per_s"].get<double>() / p["tokens_per_s"].get<double>();
      const double rss = q["peak_rss_bytes"].get<double>() / p["peak_rss_bytes"].get<double>();
      r["ratio_tokens_per_s"] = tps;
      r["ratio_peak_rss"] = rss;
      r["target"] = "tokens/s ratio >= 1.5 and peak RSS ratio <= 0.8";
      r["target_met"] = tps >= 1.5 && rss <= 0.8;
    }
  }
  r["machine"]["loadavg_after"] = load_average();
  std::cout << r.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_train_step: " << e.what() << "\n";
  return 1;
}
