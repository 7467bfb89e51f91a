// One vision training step (issue 52's bench): a Qwen3.5-9B-shaped language layer plus its full vision
// tower on one 1024x768 image with 256 text tokens, forward + backward, beside transformers + peft on
// the same inputs (bench/vision_peer.py). Its own program, not a mode of bench_train_step (557 lines,
// text-only decoders built in memory): this step needs a checkpoint with a tower and a processor
// written by transformers, images through the data path, and a peer of another model class.
//
// The model (vision_peer.py --write, once per --workdir): Qwen3_5ForConditionalGeneration with the
// 9B's vision_config and ONE full-attention language layer of the 9B's text shape, the vocabulary cut
// to 32000, random bf16 weights, its preprocessor_config.json keeping the image's size (64 x 48
// patches, 768 image tokens), one random PNG, and inputs.json (the tokens and labels both sides read:
// <|vision_start|>, the image's tokens, <|vision_end|>, --text-tokens random tokens, those scored).
// Ours, as `qlora run` loads it (recipes::build_model, recipes::load_vision_tower): NF4 base, LoRA
// r --r on q/k/v/o/gate/up/down of the language layer, the tower frozen with its encoder linears in
// NF4, computing in --dtype (auto: bf16 where its GEMMs are native). The step is the recipe's
// (train::summed_token_loss with train::BatchImages): the PNG decoded and processed, the tower's
// forward without gradient, the language model's loss over the scored tokens, backward into the
// adapters (recipes::backward_micro_batch). The tower's forward (processor included) is timed alone.
// The peer: vision_peer.py --run (bf16 model, peft LoRA on the same modules, transformers' processor).
//
// Each side runs in its own fresh process (this program starts itself with --worker), --runs times
// alternating: the first step's peak RSS over the RSS before it (VmHWM restarted just before), one
// untimed step, then the median of --reps timed steps. Prints one JSON object: the CPU, qlora's ISA,
// the load average.
//
//   build/bench_vision_step [--workdir DIR] [--shape qwen3.5-9b|tiny] [--width 1024 --height 768]
//                           [--text-tokens 256] [--r 8] [--alpha 16] [--reps 1] [--runs 1]
//                           [--threads 2] [--dtype auto|fp32|bf16] [--no-peer] [--profile]
// --profile: our worker profiles one more tower forward, most of the step (bench/step_profile.h:
// each ATen op's and qlora scope's self time by phase), where the time goes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_dtype.h"
#include "bench/machine.h"
#include "bench/recipe_model.h"
#include "bench/run_json.h"
#include "bench/step_profile.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/data/batching.h"
#include "qlora/data/sample_images.h"
#include "qlora/engine/omp_wait_policy.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/train/evaluate.h"

using nlohmann::json;
namespace fs = std::filesystem;

// libgomp's short spin, as qlora's programs run (engine/omp_wait_policy.h); the peer inherits it.
QLORA_OMP_WAIT_POLICY_PREINIT;

namespace {

struct Args {
  std::string workdir = "bench_vision_model", shape = "qwen3.5-9b", dtype = "auto", why;
  int64_t width = 1024, height = 768, text_tokens = 256, r = 8;
  double alpha = 16;
  int reps = 1, runs = 1, threads = 2;
  at::ScalarType compute = at::kFloat;
  bool peer = true, worker = false, profile = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
      return argv[++i];
    };
    if (s == "--workdir") a.workdir = next();
    else if (s == "--shape") a.shape = next();
    else if (s == "--width") a.width = std::stoll(next());
    else if (s == "--height") a.height = std::stoll(next());
    else if (s == "--text-tokens") a.text_tokens = std::stoll(next());
    else if (s == "--r") a.r = std::stoll(next());
    else if (s == "--alpha") a.alpha = std::stod(next());
    else if (s == "--reps") a.reps = std::stoi(next());
    else if (s == "--runs") a.runs = std::stoi(next());
    else if (s == "--threads") a.threads = std::stoi(next());
    else if (s == "--dtype") a.dtype = next();
    else if (s == "--no-peer") a.peer = false;
    else if (s == "--profile") a.profile = true;
    else if (s == "--worker") a.worker = true;
    else throw std::invalid_argument("unknown argument " + s);
  }
  if (a.width < 1 || a.height < 1 || a.text_tokens < 1 || a.r < 1 || a.reps < 1 || a.runs < 1)
    throw std::invalid_argument("--width, --height, --text-tokens, --r, --reps and --runs must be positive");
  a.compute = qlora::bench::resolve_bench_dtype(a.dtype, &a.why);
  return a;
}

std::string peer_script() { return std::string(QLORA_SOURCE_DIR) + "/bench/vision_peer.py"; }

json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  return json::parse(f);
}

// The model, image and inputs in --workdir, written by vision_peer.py unless inputs.json there says
// they are of this shape and size already. Returns inputs.json.
json ensure_model(const Args& a) {
  const std::string inputs = a.workdir + "/inputs.json";
  if (fs::exists(inputs)) {
    const json j = read_json(inputs);
    if (j.value("shape", "") == a.shape && j.value("width", 0) == a.width && j.value("height", 0) == a.height &&
        j.value("text_tokens", 0) == a.text_tokens)
      return j;
  }
  std::ostringstream cmd;
  cmd << QLORA_PYTHON << " " << peer_script() << " --write " << a.workdir << " --shape " << a.shape << " --width "
      << a.width << " --height " << a.height << " --text-tokens " << a.text_tokens << " >&2";
  if (std::system(cmd.str().c_str()) != 0) throw std::runtime_error("failed: " + cmd.str());
  return read_json(inputs);
}

using qlora::bench::seconds_since;
using qlora::bench::median;


// The step's batch as data::collate makes it from a sample with one image (labels shifted there).
qlora::data::Batch vision_batch(const json& in, const std::string& workdir, const qlora::data::DatasetOptions& opts) {
  qlora::data::SampleImage img;
  img.source.path = workdir + "/image.png";
  img.source.name = "image.png";
  img.origin = workdir + "/inputs.json";
  img.num_image_tokens = in.at("image_tokens").get<int64_t>();
  img.grid = qlora::data::image_pixels(img, opts).grid;
  qlora::data::Sample s{in.at("input_ids").get<std::vector<int64_t>>(), in.at("labels").get<std::vector<int64_t>>(),
                        false, {img}};
  return qlora::data::collate({s}, 0);
}

// Our side, in this (fresh) process.
json worker(const Args& a) {
  const json in = read_json(a.workdir + "/inputs.json");
  const auto world = qlora::engine::World::join(qlora::engine::RankEnv{}, 0, std::chrono::seconds(60), c10::kCPU);
  const qlora::config::RecipeConfig cfg = qlora::bench::recipe_config(a.compute, a.r, a.alpha, false);
  const qlora::recipes::Session s = qlora::bench::session(cfg, c10::kCPU, *world, a.workdir);
  qlora::recipes::Model m = qlora::recipes::build_model(s);
  qlora::data::DatasetOptions opts;
  opts.image_processor = std::make_shared<const qlora::images::ImageProcessor>(
      qlora::images::processor_from_dir(a.workdir));
  const qlora::train::BatchImages images =
      qlora::recipes::load_vision_tower(s, m, opts, /*trained_on_images=*/true, /*other_images=*/false);
  if (a.threads > 0) at::set_num_threads(a.threads);  // build_model fits them to the model
  qlora::io::release_free_cpu_memory();
  const qlora::data::Batch batch = vision_batch(in, a.workdir, opts);
  int64_t trainable = 0;
  for (const auto& [name, t] : m.decoder.lora_parameters()) trainable += t.numel();

  double loss_value = 0;
  auto step = [&]() {
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor loss = qlora::train::summed_token_loss(m.decoder, batch, false, c10::kCPU, images) /
                            static_cast<double>(batch.num_label_tokens);
    qlora::recipes::backward_micro_batch(m, loss, /*last=*/true);
    loss_value = loss.item<double>();
    return seconds_since(t0);
  };
  auto tower = [&]() {
    const auto t0 = std::chrono::steady_clock::now();
    at::NoGradGuard no_grad;
    images.of(m.decoder, batch, c10::kCPU);
    return seconds_since(t0);
  };

  json out;
  const int64_t rss0 = qlora::io::proc_status_bytes("VmRSS");
  out["hwm_reset"] = qlora::bench::restart_peak_rss();
  out["first_step_s"] = step();
  out["loss"] = loss_value;
  out["peak_rss_delta_bytes"] = qlora::io::proc_status_bytes("VmHWM") - rss0;
  out["peak_rss_bytes"] = qlora::io::proc_status_bytes("VmHWM");
  out["rss_before_step_bytes"] = rss0;
  step();
  std::vector<double> t, t_tower;
  for (int i = 0; i < a.reps; ++i) t.push_back(step());
  tower();
  for (int i = 0; i < a.reps; ++i) t_tower.push_back(tower());
  out["impl"] = "qlora recipes::build_model + load_vision_tower (NF4 base and tower linears, LoRA on the language "
                "layer), train::summed_token_loss with BatchImages";
  out["compute_dtype"] = a.dtype;
  out["threads"] = at::get_num_threads();
  out["trainable_params"] = trainable;
  out["fwd_bwd_s"] = median(t);
  out["times_s"] = t;
  out["tower_fwd_s"] = median(t_tower);
  if (a.profile) {  // one more tower forward (most of the step), each op's self time in its phase
    const qlora::bench::StepProfile prof;
    out["profile"]["tower_fwd_s"] = tower();
    out["profile"]["phases_s"] = prof.phases();
    out["profile"]["top_ops_s"] = prof.top_ops(20);
  }
  return out;
}

// One run: both sides, each in its own process, and the ratios.
json measure(const Args& a) {
  std::ostringstream flags;
  flags << " --workdir " << a.workdir << " --r " << a.r << " --alpha " << a.alpha << " --reps " << a.reps
        << " --threads " << a.threads;
  json r{{"load_average", qlora::bench::load_average()}};
  r["qlora"] = qlora::bench::run_json(qlora::bench::self_exe("bench_vision_step") + " --worker --dtype " + a.dtype +
                                      " --shape " + a.shape + flags.str() + (a.profile ? " --profile" : ""));
  if (!a.peer) return r;
  std::string peer_flags = flags.str();
  peer_flags.replace(peer_flags.find(" --workdir "), 11, " --run ");
  r["peer"] = qlora::bench::run_json(std::string(QLORA_PYTHON) + " " + peer_script() + peer_flags + " 2>/dev/null");
  r["load_average_after"] = qlora::bench::load_average();
  const json &q = r["qlora"], &p = r["peer"];
  if (q.contains("fwd_bwd_s") && p.contains("fwd_bwd_s")) {
    r["speedup_vs_peer"] = p["fwd_bwd_s"].get<double>() / q["fwd_bwd_s"].get<double>();
    r["tower_speedup_vs_peer"] = p["tower_fwd_s"].get<double>() / q["tower_fwd_s"].get<double>();
    r["peak_rss_delta_ratio"] = q["peak_rss_delta_bytes"].get<double>() / p["peak_rss_delta_bytes"].get<double>();
    r["peak_rss_ratio"] = q["peak_rss_bytes"].get<double>() / p["peak_rss_bytes"].get<double>();
  }
  return r;
}

// The medians over the runs; memory from the first run (it does not vary).
json summary(const json& per_run) {
  json s;
  for (const char* side : {"qlora", "peer"}) {
    std::vector<double> step, tower;
    for (const json& r : per_run)
      if (r.contains(side) && r[side].contains("fwd_bwd_s")) {
        step.push_back(r[side]["fwd_bwd_s"].get<double>());
        tower.push_back(r[side]["tower_fwd_s"].get<double>());
      }
    if (step.empty()) continue;
    const json& f = per_run[0][side];
    s[std::string(side) + "_fwd_bwd_s"] = median(step);
    s[std::string(side) + "_tower_fwd_s"] = median(tower);
    s[std::string(side) + "_peak_rss_delta_bytes"] = f["peak_rss_delta_bytes"];
    s[std::string(side) + "_peak_rss_bytes"] = f["peak_rss_bytes"];
  }
  std::vector<double> speedups;
  for (const json& r : per_run)
    if (r.contains("speedup_vs_peer")) speedups.push_back(r["speedup_vs_peer"].get<double>());
  if (!speedups.empty()) {
    s["speedup_vs_peer"] = median(speedups);
    s["speedup_per_run"] = speedups;
    s["peak_rss_delta_ratio"] = per_run[0]["peak_rss_delta_ratio"];
    s["target"] = "speedup_vs_peer >= 1.5";
    s["target_met"] = median(speedups) >= 1.5;
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "bench_vision_step: " << e.what()
              << "\nusage: bench_vision_step [--workdir DIR] [--shape qwen3.5-9b|tiny] [--width 1024 --height 768] "
                 "[--text-tokens 256] [--r 8] [--alpha 16] [--reps 1] [--runs 1] [--threads 2] "
                 "[--dtype auto|fp32|bf16] [--no-peer] [--profile]\n";
    return 2;
  }
  try {
    qlora::io::tune_cpu_memory();  // as the training programs run
    if (a.threads > 0) at::set_num_threads(a.threads);
    if (a.worker) {
      std::cout << worker(a).dump() << std::endl;
      return 0;
    }
    const json in = ensure_model(a);
    json j{{"bench", "vision_step_fwd_bwd"},
           {"machine", {{"cpu", qlora::bench::cpu_model()}, {"load_average", qlora::bench::load_average()},
                        {"qlora_isa", qlora::kernels::isa_name(qlora::kernels::active_isa())},
                        {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)}, {"threads", a.threads}}},
           {"shape", {{"model", a.shape + " (Qwen3_5ForConditionalGeneration: the tower and one full-attention "
                                          "language layer, random weights)"},
                      {"vision_config", in["vision_config"]}, {"text_config", in["text_config"]},
                      {"image", std::to_string(a.width) + "x" + std::to_string(a.height)},
                      {"image_tokens", in["image_tokens"]}, {"text_tokens", a.text_tokens},
                      {"seq", in["input_ids"].size()}, {"lora_r", a.r}, {"lora_alpha", a.alpha},
                      {"lora_targets", "q/k/v/o/gate/up/down_proj of the language layer; the tower frozen"},
                      {"compute", a.dtype}, {"why", a.why}, {"base", "nf4 (ours, tower linears too) / bf16 (peer)"}}},
           {"reps", a.reps},
           {"runs", a.runs}};
    for (int i = 0; i < a.runs; ++i) {
      std::cerr << "bench_vision_step: run " << i + 1 << " of " << a.runs << std::endl;
      j["per_run"].push_back(measure(a));
    }
    j["summary"] = summary(j["per_run"]);
    j["machine"]["load_average_after"] = qlora::bench::load_average();
    std::cout << j.dump(2) << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_vision_step: " << e.what() << "\n";
    return 1;
  }
}
