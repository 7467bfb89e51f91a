// QLoRA training-step throughput and peak memory on the CPU: qlora (load_decoder with an NF4 base,
// fp32 LoRA on q,k,v,o,gate,up,down, AdamW) against the same step in two peers, same shapes, same
// random checkpoint, same tokens, measured in the same run: PyTorch + torchao structured as
// torchtune's QLoRA (bench/peer_train_step.py, "peer"), and the stack most users run, transformers'
// LlamaForCausalLM + peft LoRA on a torchao NF4 base (bench/hf_peer_train_step.py, "peer_hf").
// Each side runs in its own process so its VmHWM (peak RSS) is its own: this program re-executes
// itself with --worker for the qlora side and popen()s the peers. Prints one JSON object.
//
//   build/bench_train_step [--hidden 768 --inter 2048 --layers 12 --heads 12 --vocab 32000]
//                          [--seq 512] [--batch 1] [--steps 3] [--r 8 --alpha 16]
//                          [--workdir DIR] [--no-peer] [--no-profile] [--runs N] [--dtype fp32|bf16|auto]
//       --dtype: the compute dtype (default fp32; "auto" as model.dtype = "auto" chooses: bf16 on a
//       CPU with native bf16). bf16: bf16 GEMMs accumulating in fp32, fp32 LoRA and AdamW, the GEMM
//       floor in bf16, and the peer under torch.autocast("cpu", bfloat16). The JSON names the CPU's
//       ISA and why the dtype was chosen.
//       --runs N: the whole measurement (qlora's step, its GEMM floor, the peers' steps) N times in
//       turn, each run's figures and their medians ("median_of_runs").
//   build/bench_train_step --shape NAME [--seq 128] [--steps 1] [--layers N] [--r 8 --alpha 16]
//                          [--no-activation-checkpointing]
//       NAME: llama2-7b|llama3.1-8b|mistral-7b|qwen2.5-7b|qwen3-8b|qwen3.5-9b|gemma2-9b|gemma3-12b|phi3-mini
//       (bench/model_shapes.h, parsed from each model's config.json; --llama2-7b is --shape
//       llama2-7b), all its layers unless --layers, built in memory with random NF4 weights
//       (writing and re-reading 13-18 GB of bf16 would dominate the run); reports seconds per
//       step and peak RSS, no peer.
//   build/bench_train_step --device cuda [--shape llama2-7b|llama3.1-8b|mistral-7b] [--seq 2048] [--batch 1]
//                          [--steps 5] [--layers N] [--r 8 --alpha 16] [--peer-modes eager,compile,hf|none]
//                          [--peak-tflops X] [--dtype bf16] [--no-activation-checkpointing]
//       the device mode: weights drawn from seeds on the device (bench/random_llama.h seeded_model),
//       the same ones for qlora's step and for the peer (bench/peer_train_step.py --spec: torch +
//       torchao NF4 structured as torchtune's QLoRA recipe, eager and torch.compile'd; "hf":
//       bench/hf_peer_train_step.py --spec, transformers + peft, eager), each in its own process;
//       bf16 compute, activation checkpointing, LoRA on all seven projections. Reports tokens/s,
//       peak device memory (max allocated and reserved), MFU against the device's dense bf16 peak
//       (bench/device_step.h) and the first losses' agreement. --device cpu runs the same on the
//       CPU (how tests check that both sides compute the same step).
//   build/bench_train_step --shape llama3.1-8b --layers 2 --seq 2048 --ce-compare [--lora-head]
//       the step with the chunked output loss (DecoderModel::loss) and with whole [tokens, vocab]
//       logits (--full-logits), each in its own worker: peak RSS, losses and step time of each.
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
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <iostream>
#include <string>
#include <vector>

#include "bench/bench_dtype.h"
#include "bench/device_step.h"
#include "bench/machine.h"
#include "bench/memory_account.h"
#include "bench/random_llama.h"
#include "bench/recipe_model.h"
#include "bench/shape_args.h"
#include "bench/step_profile.h"
#include "bench/run_json.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/engine/omp_wait_policy.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/models/architecture.h"
#include "qlora/models/decoder.h"
#include "qlora/models/output_head.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/io/crash_report.h"
#include "qlora/optim/adamw.h"
#include "qlora/train/device.h"
#include "quant/nf4_tensor.h"

using nlohmann::json;
namespace fs = std::filesystem;
using qlora::bench::run_json;

// Both sides (this program's worker and the Python peer it starts) inherit the wait policy.
QLORA_OMP_WAIT_POLICY_PREINIT;  // OpenMP workers spin briefly, then sleep (omp_wait_policy.h)

namespace {

struct Args : qlora::bench::ShapeArgs {
  int64_t batch = 1, r = 8;
  double alpha = 16.0;
  std::string model;
  bool peer = true, worker = false;
  bool no_ac = false;
  bool ce_compare = false;  // run the step with the chunked loss and with whole logits, each in its own worker
  bool full_logits = false;  // worker: DecoderModel::chunked_loss = false
  bool lora_head = false;    // LoRA on the output head too
  bool profile = true;       // a profiled step (per-phase seconds) and the GEMM floor after the timed steps
  int64_t runs = 1;          // the whole default-shape measurement this many times (--runs)
  std::string device;          // --device: the seeded device mode (bench/device_step.h); empty: off
  std::string peer_modes = "eager,compile,hf";  // --peer-modes: the device mode's peers
  std::string trace;           // --trace PATH (worker): one more step traced into a Chrome trace
  double peak_tflops = 0;      // --peak-tflops: the device's dense bf16 peak for MFU; 0: from its name
  std::string dtype = "fp32";  // --dtype: fp32 | bf16 | auto
  at::ScalarType compute_dtype = at::kFloat;  // --dtype resolved (finish_dtype)
  std::string why;                            // and why

  // The device mode's defaults: a named shape (llama2-7b unless --shape), its full depth, seq 2048,
  // 5 timed steps after a warm-up.
  void device_defaults() {
    if (shape.empty()) shape = "llama2-7b";
    if (!seq_given) { seq = 2048; seq_given = true; }
    if (!steps_given) { steps = 5; steps_given = true; }
    profile = false;  // the phase profiler times CPU ops; a GPU runs them asynchronously
  }

  void finish_dtype() {
    if (!device.empty() && !dtype_given) dtype = "bf16";  // the device mode computes in bf16 unless told
    compute_dtype = qlora::bench::resolve_bench_dtype(dtype, &why);
  }
  bool dtype_given = false;
};

// What the JSON says of the compute dtype and the CPU it was chosen on.
json dtype_json(const Args& a) {
  const auto& f = qlora::kernels::cpu_features();
  std::string isa = qlora::kernels::isa_name(qlora::kernels::active_isa());
  if (f.amx_bf16) isa += ", amx_bf16";
  return {{"compute_dtype", a.dtype}, {"why", a.why}, {"cpu_isa", isa},
          {"native_bf16", qlora::kernels::has_native_bf16()}, {"bf16_gemms_fast", qlora::kernels::bf16_gemms_fast()}};
}

// Every decoder projection of the Llama shape (random_model adapts those of its family).
const std::vector<std::string> kTargets = qlora::models::layer_peft_names(qlora::models::llama_architecture());

using qlora::bench::seconds_since;

// The frozen projections the step runs: every decoder layer's, and the output head.
std::vector<qlora::bench::GemmShape> gemm_shapes(const qlora::models::DecoderModel& m) {
  std::map<std::pair<int64_t, int64_t>, int64_t> count;
  for (const auto& layer : m.layers)
    for (const auto& row : qlora::models::architecture_of(m.config).projections)
      if (row.member && (layer.*row.member).out_features > 0)
        ++count[{(layer.*row.member).out_features, (layer.*row.member).in_features}];
  ++count[{m.lm_head.out_features, m.lm_head.in_features}];
  std::vector<qlora::bench::GemmShape> shapes;
  for (const auto& [s, n] : count) shapes.push_back({s.first, s.second, n});
  return shapes;
}

// The qlora side, in its own process: load, warm-up step, timed steps, through the training
// engine as the recipe runs it in one process (a world of one), the model and AdamW set up by the
// recipes' own build_model and make_adamw.
json run_worker(const Args& a) {
  qlora::bench::MemoryAccount& acct = qlora::bench::MemoryAccount::install();
  acct.phase("load");
  const auto t0 = std::chrono::steady_clock::now();
  const at::Device dev = qlora::train::resolve_device(a.device.empty() ? "cpu" : a.device, "--device");
  const auto world = qlora::engine::World::join(qlora::engine::RankEnv{}, 0, std::chrono::seconds(60), dev);
  // The default shape's checkpoint trains without activation checkpointing, as its peers do.
  const qlora::config::RecipeConfig cfg =
      qlora::bench::recipe_config(a.compute_dtype, a.r, a.alpha, !a.no_ac && a.model.empty(), 1e-4);
  qlora::recipes::DecoderBuilder build = qlora::bench::load_in_compute_dtype(a.model);
  if (!a.device.empty()) {
    build = [&](const qlora::models::DecoderLoadOptions& o) {
      return qlora::bench::seeded_model(a.shape_config(), o.lora_r, o.lora_alpha, o.activation_checkpointing, o.device,
                                        o.compute_dtype, o.on_layer_loaded);
    };
  } else if (!a.shape.empty()) {
    build = [&](const qlora::models::DecoderLoadOptions& o) {
      return qlora::bench::random_model(a.shape_config(), o.lora_r, o.lora_alpha, o.activation_checkpointing,
                                        o.on_layer_loaded, o.compute_dtype);
    };
  }
  const auto prepare = [&](qlora::models::DecoderModel& m) {
    if (a.lora_head) {
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(7);
      qlora::modules::lora_linear_add_adapter(m.lm_head, a.r, a.alpha, 0.0, g, at::kCPU);
    }
    m.chunked_loss = !a.full_logits;
  };
  qlora::recipes::Model model = qlora::recipes::build_model(qlora::bench::session(cfg, dev, *world), build, prepare);
  qlora::models::DecoderModel& m = model.decoder;
  const auto& engine = model.engine;
  const double load_s = seconds_since(t0);
  const int64_t rss_after_load = qlora::io::peak_rss_bytes();
  // The device's peaks while loading (the seeded draws' fp32 temporaries), then the steps' own:
  // cached blocks go back to the driver, so max reserved counts what the steps hold.
  const qlora::train::DeviceMemoryPeaks load_peaks = qlora::train::device_memory_peaks(dev);
  qlora::train::release_cached_device_memory(dev);
  qlora::train::reset_device_memory_peaks(dev);
  int64_t trainable = 0;
  for (const auto& [name, t] : m.lora_parameters()) trainable += t.numel();
  const std::unique_ptr<qlora::optim::AdamW> opt = qlora::recipes::make_adamw(cfg, model);
  const int64_t V = m.config.vocab_size, chunk = qlora::models::default_loss_chunk_tokens(std::min(V, m.lm_head_chunk_rows));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor tokens = at::randint(0, V, {a.batch, a.seq + 1}, gen).to(dev);  // [batch, seq + 1]
  // Labels already shifted, as data/batching produces them.
  const at::Tensor inp = tokens.narrow(1, 0, a.seq), labels = tokens.narrow(1, 1, a.seq);

  auto step = [&]() {
    acct.phase("forward and loss");
    // The mean token loss as the recipe forms it (every label counts here).
    at::Tensor loss = m.loss(inp, labels) / static_cast<double>(labels.numel());
    acct.phase("backward");
    loss.backward();
    engine->finish_backward();
    acct.phase("optimizer");
    opt->step();
    engine->gather_params();
    qlora::train::synchronize_device(dev);  // a wall clock around GPU work
    return loss.item<double>();
  };
  std::vector<double> losses, times;
  // A real shape skips the warm-up to stay within minutes on a small CPU; its one step then
  // includes first-touch costs, so it is an upper bound.
  const bool warmup = a.shape.empty() || !a.device.empty();
  const auto first = std::chrono::steady_clock::now();
  if (warmup) losses.push_back(step());
  const double first_step_s = seconds_since(first);
  for (int64_t i = 0; i < a.steps; ++i) {
    const auto t = std::chrono::steady_clock::now();
    losses.push_back(step());
    times.push_back(seconds_since(t));
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double med = sorted[sorted.size() / 2];
  // Peak RSS and its accounting before the profiled step and the GEMM floor's own matrices.
  json out = {{"impl", "qlora (C++)"}, {"threads", at::get_num_threads()}, {"load_s", load_s},
          {"trainable_params", trainable}, {"warmup_step", warmup}, {"step_s", times},
          {"median_step_s", med}, {"tokens_per_s", double(a.batch * a.seq) / med},
          {"peak_rss_bytes", qlora::io::peak_rss_bytes()}, {"rss_after_load_bytes", rss_after_load}, {"losses", losses},
          {"loss", a.full_logits ? "whole [tokens, vocab] logits" : "chunked, " + std::to_string(chunk) + " tokens"},
          {"memory_accounting", acct.report(qlora::bench::model_static_bytes(m))}};
  if (!a.device.empty()) {  // the steps' peaks, before the traced step
    const auto peaks = qlora::train::device_memory_peaks(dev);
    out["device"] = qlora::train::device_name(dev);
    out["first_step_s"] = first_step_s;
    if (peaks.allocated >= 0) {
      out["max_allocated_bytes"] = peaks.allocated;
      out["max_reserved_bytes"] = peaks.reserved;
      out["load_max_allocated_bytes"] = load_peaks.allocated;
      out["load_max_reserved_bytes"] = load_peaks.reserved;
    }
  }
  if (!a.trace.empty()) qlora::bench::trace_step([&] { step(); }, a.trace, dev.is_cuda());
  if (a.profile) {
    // One more step under the phase profiler, then the same step's GEMMs alone.
    qlora::bench::StepProfile prof;
    const auto t = std::chrono::steady_clock::now();
    step();
    out["phases"] = qlora::bench::phase_breakdown(prof, seconds_since(t));
    const double floor_s = qlora::bench::gemm_floor_s(gemm_shapes(m), a.batch * a.seq, a.compute_dtype);
    out["gemm_floor_s"] = floor_s;
    out["step_over_gemm_floor"] = med / floor_s;
  }
  return out;
}

std::string shape_flags(const Args& a) {
  return a.flags() + " --batch " + std::to_string(a.batch) + " --r " + std::to_string(a.r) + " --alpha " +
         std::to_string(a.alpha) + " --dtype " + a.dtype + (a.lora_head ? " --lora-head" : "");
}

std::string self_exe() { return fs::read_symlink("/proc/self/exe").string(); }

// The step with the chunked loss and with whole logits, each in its own worker (so each peak RSS is
// its own), and what chunking saves.
json ce_compare(const std::string& worker) {
  const json c = run_json(worker), f = run_json(worker + " --full-logits");
  json r = {{"chunked", c}, {"whole_logits", f}};
  if (!c.contains("peak_rss_bytes") || !f.contains("peak_rss_bytes")) return r;
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  const double pc = c["peak_rss_bytes"].get<double>(), pf = f["peak_rss_bytes"].get<double>();
  const double lc = c["losses"][0].get<double>(), lf = f["losses"][0].get<double>();
  r["peak_rss_gib_chunked"] = pc / kGiB;
  r["peak_rss_gib_whole_logits"] = pf / kGiB;
  r["peak_rss_saved_gib"] = (pf - pc) / kGiB;
  r["median_step_s_chunked"] = c["median_step_s"];
  r["median_step_s_whole_logits"] = f["median_step_s"];
  r["first_loss_rel_diff"] = std::abs(lc - lf) / std::abs(lf);
  return r;
}

// The command line of a Python script in bench/, run by the build's Python.
std::string bench_python(const std::string& script) {
  return std::string(QLORA_PYTHON) + " " + QLORA_SOURCE_DIR + "/bench/" + script;
}

// A peer's script: "hf" is transformers + peft (hf_peer_train_step.py), any other mode the
// torchtune-structured peer (peer_train_step.py). Both take the same flags and print the same figures.
std::string peer_script(const std::string& mode) {
  return bench_python(mode == "hf" ? "hf_peer_train_step.py" : "peer_train_step.py");
}

// The largest relative difference between the first n losses of two sides, or null where either
// has none (a side failed).
json losses_max_rel_diff(const json& x, const json& y, size_t n) {
  if (!x.contains("losses") || !y.contains("losses")) return nullptr;
  double worst = 0;
  for (size_t i = 0; i < std::min(n, std::min(x["losses"].size(), y["losses"].size())); ++i) {
    const double u = x["losses"][i].get<double>(), v = y["losses"][i].get<double>();
    worst = std::max(worst, std::abs(u - v) / std::abs(v));
  }
  return worst;
}

// One measurement of the default shape: qlora's step and its GEMM floor, then each peer's step, and
// their ratios (the targets are against the torchtune-structured peer).
json default_shape_run(const Args& a, const std::string& dir) {
  json r;
  const json q = run_json(self_exe() + " --worker --model " + dir + shape_flags(a));
  r["qlora"] = q;
  if (q.contains("step_over_gemm_floor")) r["step_over_gemm_floor"] = q["step_over_gemm_floor"];
  if (!a.peer) return r;
  const json p = run_json(peer_script("eager") + " --model " + dir + shape_flags(a));
  r["peer"] = p;
  const json h = run_json(peer_script("hf") + " --model " + dir + shape_flags(a));
  r["peer_hf"] = h;
  r["first_loss_rel_diff"] = {{"qlora_vs_peer", losses_max_rel_diff(q, p, 1)},
                              {"peer_hf_vs_peer", losses_max_rel_diff(h, p, 1)}};
  if (q.contains("tokens_per_s") && h.contains("tokens_per_s"))
    r["ratio_tokens_per_s_vs_peer_hf"] = q["tokens_per_s"].get<double>() / h["tokens_per_s"].get<double>();
  if (q.contains("tokens_per_s") && p.contains("tokens_per_s")) {
    const double tps = q["tokens_per_s"].get<double>() / p["tokens_per_s"].get<double>();
    const double rss = q["peak_rss_bytes"].get<double>() / p["peak_rss_bytes"].get<double>();
    r["ratio_tokens_per_s"] = tps;
    r["ratio_peak_rss"] = rss;
    // #25's bf16 targets (against the autocast peer) allow peak RSS up to the peer's.
    const double rss_max = a.dtype == "bf16" ? 1.0 : 0.8;
    r["target"] = "tokens/s ratio >= 1.5, peak RSS ratio <= " + std::string(rss_max == 1.0 ? "1.0" : "0.8") +
                  ", step <= 1.3x its GEMM floor";
    r["target_met"] = tps >= 1.5 && rss <= rss_max && q.value("step_over_gemm_floor", 99.0) <= 1.3;
  }
  return r;
}

// Tokens/s, peak device memory and MFU of one side's JSON, and its losses.
json device_figures(const json& side, double flops_per_token, double peak) {
  if (!side.contains("tokens_per_s")) return {{"error", side.value("error", std::string("no result"))}};
  const double tps = side["tokens_per_s"].get<double>();
  json f = {{"tokens_per_s", tps}, {"losses", side["losses"]}};
  for (const char* k : {"max_allocated_bytes", "max_reserved_bytes", "load_max_allocated_bytes",
                        "load_max_reserved_bytes", "peak_rss_bytes"})
    if (side.contains(k)) f[k] = side[k];
  f["mfu"] = peak > 0 ? json(tps * flops_per_token / peak) : json(nullptr);
  return f;
}

// The device mode: qlora's step on the seeded model (bench/random_llama.h), then each peer mode's
// on the same weights (bench/peer_train_step.py --spec), each in its own process on a.device;
// tokens/s, peak device memory, MFU, and how far the first losses agree.
json device_run(const Args& a) {
  const qlora::models::DecoderConfig c = a.shape_config();
  qlora::bench::check_seeded_family(c);
  // Per process: two runs at once (ctest -j) must not share a spec or a trace.
  const std::string tag = a.shape + "_l" + std::to_string(a.layers) + "_b" + std::to_string(a.batch) + "_" +
                          std::to_string(getpid());
  const std::string spec = (fs::temp_directory_path() / ("qlora_bench_seeded_" + tag + ".json")).string();
  std::ofstream(spec) << qlora::bench::seeded_spec(c, a.r, a.alpha).dump() << "\n";
  const qlora::bench::StepFlops fl = qlora::bench::step_flops_per_token(c, a.r, a.seq);
  json r = {{"bench", "train_step_device"},
            {"machine", {{"cpu", qlora::bench::cpu_model()}, {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)}}},
            {"dtype", dtype_json(a)},
            {"shape", {{"model", a.shape + " (seeded random weights, NF4 base, in device memory)"},
                       {"layers", a.layers}, {"vocab", c.vocab_size}, {"seq", a.seq}, {"batch", a.batch},
                       {"steps", a.steps}, {"lora_r", a.r}, {"lora_alpha", a.alpha}, {"compute_dtype", a.dtype},
                       {"lora_targets", qlora::models::layer_peft_names(qlora::models::architecture_of(c))},
                       {"activation_checkpointing", !a.no_ac}}},
            {"model_flops_per_token", {{"frozen_projections", fl.frozen}, {"lora", fl.lora},
                                       {"causal_attention", fl.attention}, {"total", fl.total()}}}};
  const std::string ac = a.no_ac ? " --no-activation-checkpointing" : "";
  // Each side traces one more step; bench/trace_summary.py says where its device time went.
  const std::string traces = (fs::temp_directory_path() / ("qlora_bench_trace_" + tag)).string();
  fs::create_directories(traces);
  const std::string summary = bench_python("trace_summary.py ");
  const json q = run_json(self_exe() + " --worker --device " + a.device + shape_flags(a) + ac + " --trace " +
                          traces + "/qlora.json");
  if (q.contains("tokens_per_s")) r["profile"]["qlora"] = run_json(summary + traces + "/qlora.json");
  const std::string name = q.value("device", a.device);
  const double peak = a.peak_tflops > 0 ? a.peak_tflops * 1e12 : qlora::bench::bf16_peak_flops(name);
  r["device"] = {{"name", name}, {"bf16_peak_tflops", peak > 0 ? json(peak / 1e12) : json(nullptr)}};
  r["traces"] = traces;
  r["qlora"] = q;
  r["figures"]["qlora"] = device_figures(q, fl.total(), peak);
  double best_peer = 0;
  std::string best_mode;
  std::stringstream modes(a.peer_modes);
  for (std::string mode; std::getline(modes, mode, ',');) {
    if (mode == "none" || mode.empty()) continue;
    const json p = run_json(peer_script(mode) + " --spec " + spec + " --device " + a.device + " --mode " +
                            (mode == "hf" ? "eager" : mode) + " --seq " +
                            std::to_string(a.seq) + " --batch " + std::to_string(a.batch) + " --steps " +
                            std::to_string(a.steps) + " --dtype " + a.dtype + (a.no_ac ? "" : " --ac") + " --trace " +
                            traces + "/peer_" + mode + ".json");
    r["peers"][mode] = p;
    if (p.contains("tokens_per_s")) r["profile"]["peer_" + mode] = run_json(summary + traces + "/peer_" + mode + ".json");
    r["figures"]["peer_" + mode] = device_figures(p, fl.total(), peak);
    if (p.contains("tokens_per_s") && p["tokens_per_s"].get<double>() > best_peer) {
      best_peer = p["tokens_per_s"].get<double>();
      best_mode = mode;
    }
    // Both compute the same thing: the same first losses.
    if (const json d = losses_max_rel_diff(q, p, 3); !d.is_null()) r["first_losses_max_rel_diff"][mode] = d;
  }
  if (best_peer > 0 && q.contains("tokens_per_s")) {
    const json& bp = r["peers"][best_mode];
    r["vs_faster_peer"] = {{"peer", best_mode}, {"ratio_tokens_per_s", q["tokens_per_s"].get<double>() / best_peer}};
    if (q.contains("max_allocated_bytes") && bp.contains("max_allocated_bytes")) {
      r["vs_faster_peer"]["ratio_max_allocated"] = q["max_allocated_bytes"].get<double>() / bp["max_allocated_bytes"].get<double>();
      r["vs_faster_peer"]["ratio_max_reserved"] = q["max_reserved_bytes"].get<double>() / bp["max_reserved_bytes"].get<double>();
    }
    r["target"] = "tokens/s >= 1.3x the faster peer at no more peak memory (max reserved); MFU >= 0.5";
  }
  return r;
}

// The median over runs of each figure (a run that lacks one is left out of its median), and each
// run's value beside it.
json median_of_runs(const std::vector<json>& runs) {
  const std::vector<std::pair<std::string, json::json_pointer>> figures = {
      {"qlora_step_s", json::json_pointer("/qlora/median_step_s")},
      {"gemm_floor_s", json::json_pointer("/qlora/gemm_floor_s")},
      {"peer_step_s", json::json_pointer("/peer/median_step_s")},
      {"peer_hf_step_s", json::json_pointer("/peer_hf/median_step_s")},
      {"ratio_tokens_per_s", json::json_pointer("/ratio_tokens_per_s")},
      {"step_over_gemm_floor", json::json_pointer("/step_over_gemm_floor")},
      {"qlora_peak_rss_bytes", json::json_pointer("/qlora/peak_rss_bytes")},
      {"peer_peak_rss_bytes", json::json_pointer("/peer/peak_rss_bytes")},
      {"peer_hf_peak_rss_bytes", json::json_pointer("/peer_hf/peak_rss_bytes")},
      {"ratio_peak_rss", json::json_pointer("/ratio_peak_rss")}};
  json m;
  for (const auto& [name, at] : figures) {
    std::vector<double> v;
    for (const json& r : runs)
      if (r.contains(at)) v.push_back(r.at(at).get<double>());
    if (v.empty()) continue;
    m["per_run"][name] = v;
    std::sort(v.begin(), v.end());
    m[name] = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) try {
  qlora::io::install_crash_report(argv[0]);
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
    else if (s == "--ce-compare") a.ce_compare = true;
    else if (s == "--full-logits") a.full_logits = true;
    else if (s == "--lora-head") a.lora_head = true;
    else if (s == "--no-profile") a.profile = false;
    else if (s == "--runs") a.runs = std::stoll(next());
    else if (s == "--dtype") { a.dtype = next(); a.dtype_given = true; }
    else if (s == "--device") a.device = next();
    else if (s == "--peer-modes") a.peer_modes = next();
    else if (s == "--trace") a.trace = next();
    else if (s == "--peak-tflops") a.peak_tflops = std::stod(next());
    else { std::cerr << "bench_train_step: unknown argument " << s << "\n"; return 2; }
  }
  if (!a.device.empty()) a.device_defaults();
  a.finish();
  a.finish_dtype();
  if (a.batch < 1) throw std::invalid_argument("--batch must be >= 1");
  if (a.runs < 1) throw std::invalid_argument("--runs must be >= 1");
  if (a.worker) {
    std::cout << run_worker(a).dump() << std::endl;
    return 0;
  }
  if (!a.device.empty()) {
    std::cout << device_run(a).dump(2) << std::endl;
    return 0;
  }

  json r = {{"bench", "train_step"},
            {"machine", {{"cpu", qlora::bench::cpu_model()}, {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)},
                         {"loadavg_before", qlora::bench::load_average()}}},
            {"dtype", dtype_json(a)}};
  for (const char* v : {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"})  // what both sides inherit
    if (const char* set = std::getenv(v)) r["omp_wait"][v] = set;
  if (!a.shape.empty()) {
    const qlora::models::DecoderConfig c = a.shape_config();
    r["shape"] = {{"model", a.shape + " (random NF4, in memory)"}, {"model_type", c.model_type},
                  {"hidden", c.hidden_size}, {"intermediate", c.intermediate_size}, {"heads", c.num_attention_heads},
                  {"kv_heads", c.num_key_value_heads}, {"head_dim", c.head_dim}, {"vocab", c.vocab_size},
                  {"tied_embeddings", c.tie_word_embeddings}, {"layers", a.layers},
                  {"full_depth", qlora::bench::model_shape_config(a.shape).num_hidden_layers}, {"seq", a.seq},
                  {"batch", a.batch}, {"steps", a.steps}, {"lora_r", a.r}, {"lora_alpha", a.alpha},
                  {"lora_targets", qlora::models::layer_peft_names(qlora::models::architecture_of(c))},
                  {"base", "nf4"}, {"compute_dtype", a.dtype}, {"frozen_dtype", "bf16"},
                  {"activation_checkpointing", !a.no_ac}, {"lora_head", a.lora_head}};
    const std::string worker =
        self_exe() + " --worker --no-profile" + shape_flags(a) + (a.no_ac ? " --no-activation-checkpointing" : "");
    if (a.ce_compare) {
      r["ce_compare"] = ce_compare(worker);
      r["machine"]["loadavg_after"] = qlora::bench::load_average();
      std::cout << r.dump(2) << std::endl;
      return 0;
    }
    json q = run_json(worker);
    r["qlora"] = q;
    if (q.contains("peak_rss_bytes")) {
      r["seconds_per_step"] = q["median_step_s"];
      r["peak_rss_gib"] = q["peak_rss_bytes"].get<double>() / (1024.0 * 1024 * 1024);
      if (a.shape == "llama2-7b" && a.seq == 128) r["target_peak_rss_le_4.9gb_met"] = q["peak_rss_bytes"].get<double>() <= 4.9e9;
    }
    r["machine"]["loadavg_after"] = qlora::bench::load_average();
    std::cout << r.dump(2) << std::endl;
    return 0;
  }

  // One random bf16 checkpoint for every side, written by the peer script once per shape.
  const std::string dir = a.workdir;
  a.ensure_checkpoint(QLORA_PYTHON, QLORA_SOURCE_DIR);
  r["shape"] = {{"hidden", a.hidden}, {"intermediate", a.inter}, {"layers", a.layers}, {"heads", a.heads},
                {"vocab", a.vocab}, {"seq", a.seq}, {"batch", a.batch}, {"steps", a.steps}, {"lora_r", a.r},
                {"lora_alpha", a.alpha}, {"lora_targets", kTargets}, {"base", "nf4"}, {"compute_dtype", a.dtype},
                {"checkpoint", dir}};
  if (a.runs == 1) {
    r.update(default_shape_run(a, dir));
  } else {  // the whole measurement (qlora, floor, peers) again per run, and the medians over runs
    std::vector<json> runs;
    for (int64_t i = 0; i < a.runs; ++i) runs.push_back(default_shape_run(a, dir));
    r["median_of_runs"] = median_of_runs(runs);
    r["runs"] = runs;
  }
  r["machine"]["loadavg_after"] = qlora::bench::load_average();
  std::cout << r.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_train_step: " << e.what() << "\n";
  return 1;
}
