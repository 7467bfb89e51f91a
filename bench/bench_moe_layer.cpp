// One Qwen3-30B-A3B decoder layer forward + backward as training runs it, beside transformers +
// peft on the same shape in the same invocation (bench/moe_peer.py).
//
// The shape is Qwen3-30B-A3B's (kQwen3MoeConfig below): hidden 2048, 32 query / 4 KV heads of 128
// with q/k norms, 128 experts of width 768 (moe_intermediate_size), top 8, norm_topk_prob true.
// Ours: modules::decoder_layer_forward on a random layer (bench/random_llama.h: NF4 q/k/v/o with
// LoRA r --r; each expert's gate_up [1536, 2048] and down [2048, 768] its own random NF4 weight,
// LoRA on every expert as peft holds it, modules::experts_add_adapters), computing in --dtype
// (auto: what model.dtype = "auto" picks on this CPU, bf16 where its GEMMs are native), batch 1,
// --seq tokens; backward of a random gradient into the input and every adapter. The router weight
// [128, 2048], the input and the output gradient are seeded draws (random_llama.h's seeded_randn)
// that the peer repeats bit for bit, so both route the same tokens with the same router: a random
// router spreads them (tokens-per-expert statistics in the JSON, each side's own).
// The peer: transformers' Qwen3MoeDecoderLayer in bf16 with its default implementations (sdpa,
// grouped_mm experts) and peft LoRA (target_modules q/k/v/o_proj, target_parameters
// mlp.experts.gate_up_proj / down_proj), the way users fine-tune it without qlora.
//
// Each side runs in its own fresh process (this program starts itself with --worker), --runs times
// alternating: the first step's peak RSS over the RSS before it (VmHWM restarted just before the
// step through /proc/self/clear_refs on both sides) is the step's memory, then one untimed step,
// then the median of --reps timed steps. Ours also times the MoE block alone (router + experts,
// fwd + bwd on the layer's normalised input) with and without the experts' adapters, and profiles
// one layer step and one MoE block step (bench/step_profile.h): where the time goes.
// Prints one JSON object with the CPU, qlora's ISA and the load average.
//
//   build/bench_moe_layer [--model qwen3-30b-a3b|qwen3.5-35b-a3b|gpt-oss-20b] [--seq 512] [--reps 3]
//                         [--runs 1] [--r 8] [--dtype auto|fp32|bf16]
//                         [--threads N] [--no-peer] [--no-profile]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "bench/bench_dtype.h"
#include "bench/machine.h"
#include "bench/random_llama.h"
#include "bench/run_json.h"
#include "bench/step_profile.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/engine/omp_wait_policy.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/models/decoder.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/experts.h"
#include "qlora/modules/lora_linear.h"
#include "qlora/modules/moe.h"
#include "qlora/modules/rope.h"

using nlohmann::json;

// libgomp's short spin, as qlora's programs run (engine/omp_wait_policy.h); the peer inherits it.
QLORA_OMP_WAIT_POLICY_PREINIT;

namespace {

// Qwen/Qwen3-30B-A3B's config.json, its architecture keys: transformers 5.23's Qwen3MoeConfig
// defaults (whose docstring checkpoint is Qwen/Qwen3-30B-A3B-Base: hidden 2048, intermediate 6144,
// 32 heads / 4 KV, 128 experts of moe_intermediate_size 768, top 8, eps 1e-6, vocab 151936) with
// the Hub file's own values where they differ from those defaults: 48 layers, head_dim 128,
// rope_theta 1e6, max_position_embeddings 40960, norm_topk_prob true (the same sizes as
// THUDM/slime's scripts/models/qwen3-30B-A3B.sh: 48 layers, hidden 2048, ffn 6144, moe ffn 768,
// 32 heads, 4 query groups, kv channels 128, 128 experts, top 8, rotary base 1e6). The bench keeps
// one layer and a small vocabulary (the embedding and head are not timed).
constexpr const char* kQwen3MoeConfig = R"({"model_type": "qwen3_moe", "attention_bias": false, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
  "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": null, "use_sliding_window": false, "tie_word_embeddings": false,
  "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
  "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true, "output_router_logits": false,
  "bos_token_id": 151643, "eos_token_id": 151645})";

// The seeds both sides draw the router, the input and the output gradient from.
constexpr uint64_t kRouterSeed = 3000, kInputSeed = 3001, kGradSeed = 3002;
constexpr double kRouterStd = 0.02;  // logits ~N(0, 0.9) on unit-RMS inputs: a spread over experts

struct Args {
  int64_t seq = 512, r = 8;
  double alpha = -1;  // default 2 r
  int reps = 3, runs = 1, threads = 0;
  std::string dtype = "auto", why, model = "qwen3-30b-a3b";
  at::ScalarType compute = at::kFloat;
  bool peer = true, worker = false, profile = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
      return argv[++i];
    };
    if (s == "--seq") a.seq = std::stoll(next());
    else if (s == "--r") a.r = std::stoll(next());
    else if (s == "--alpha") a.alpha = std::stod(next());
    else if (s == "--reps") a.reps = std::stoi(next());
    else if (s == "--runs") a.runs = std::stoi(next());
    else if (s == "--threads") a.threads = std::stoi(next());
    else if (s == "--dtype") a.dtype = next();
    else if (s == "--model") a.model = next();
    else if (s == "--no-peer") a.peer = false;
    else if (s == "--no-profile") a.profile = false;
    else if (s == "--worker") a.worker = true;
    else throw std::invalid_argument("unknown argument " + s);
  }
  if (a.seq < 1 || a.r < 1 || a.reps < 1 || a.runs < 1)
    throw std::invalid_argument("--seq, --r, --reps and --runs must be positive");
  if (a.alpha < 0) a.alpha = 2.0 * static_cast<double>(a.r);
  a.compute = qlora::bench::resolve_bench_dtype(a.dtype, &a.why);
  return a;
}

// The MoE shapes --model takes: Qwen3-30B-A3B's layer as it is (kQwen3MoeConfig), or another
// model's MoE block and attention sizes in a Qwen3-MoE layer (q/k norms, SwiGLU experts, top-k
// renormalised), the sizes from its published config.json: Qwen/Qwen3.5-35B-A3B (text_config:
// hidden 2048, 16 / 2 heads of 256, 256 experts of 512, top 8; its Gated DeltaNet layers and
// shared expert are not in the bench's layer) and openai/gpt-oss-20b (hidden 2880, 64 / 8 heads of
// 64, 32 experts of intermediate_size 2880, top 4; its biases, sinks and clamp are not either).
// bench/moe_model_memory.py composes whole-model memory from these per-layer figures.
struct MoeShape {
  const char* name;
  const char* overrides;  // config.json keys over kQwen3MoeConfig's
};
constexpr MoeShape kMoeShapes[] = {
    {"qwen3-30b-a3b", "{}"},
    {"qwen3.5-35b-a3b", R"({"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
      "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512})"},
    {"gpt-oss-20b", R"({"hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
      "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 2880})"},
};

qlora::models::DecoderConfig moe_config(const std::string& model) {
  for (const MoeShape& s : kMoeShapes) {
    if (model != s.name) continue;
    nlohmann::json j = nlohmann::json::parse(kQwen3MoeConfig);
    j.merge_patch(nlohmann::json::parse(s.overrides));
    j["num_hidden_layers"] = 1;
    j["vocab_size"] = 1024;
    return qlora::models::parse_decoder_config(j.dump(), "bench shape " + model);
  }
  std::string known;
  for (const MoeShape& s : kMoeShapes) known += std::string(known.empty() ? "" : ", ") + s.name;
  throw std::invalid_argument("--model " + model + ": expected one of " + known);
}

// A random frozen NF4 weight [out, in], as random_llama.h's random_nf4_projection draws one.
qlora::Nf4Tensor random_nf4(int64_t out, int64_t in, at::Generator& gen) {
  qlora::Nf4Tensor w = qlora::nf4_empty({out, in}, at::kBFloat16, at::kCPU);
  w.codes.random_(0, 256, gen);
  w.scalers.random_(-128, 128, gen);
  w.factors.fill_(127.0 / 0.02);
  w.mean.fill_(0.03);
  return w;
}

// The layer's router and experts (random_model builds the rest): each expert's own NF4 weights,
// LoRA on all of them as a checkpoint's load gives it (decoder.cpp's experts()).
void add_moe(const qlora::models::DecoderConfig& c, qlora::modules::DecoderLayer& L, int64_t r, double alpha,
             at::ScalarType compute) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const int64_t E = c.moe.num_experts, H = c.hidden_size, I = c.moe.inter;
  std::vector<qlora::Nf4Tensor> gu, down;
  for (int64_t e = 0; e < E; ++e) {
    gu.push_back(random_nf4(2 * I, H, gen));
    down.push_back(random_nf4(H, I, gen));
  }
  L.experts = qlora::modules::experts_nf4(std::move(gu), std::move(down));
  qlora::modules::experts_add_adapters(L.experts, r, qlora::modules::lora_scale(alpha, r, false), gen, at::kCPU);
  L.router = qlora::bench::seeded_randn({E, H}, kRouterSeed, at::kCPU).mul_(kRouterStd).to(compute);
}

int64_t nbytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

// Resident bytes of the layer's frozen weights, by part, and of its adapters.
json weight_bytes(const qlora::modules::DecoderLayer& L) {
  int64_t attn = 0, experts = 0, norms = 0, lora = 0;
  for (const qlora::modules::LoraLinear* p : {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj})
    attn += p->base_nf4.defined() ? p->base_nf4.nbytes() : nbytes(p->base_dense);
  for (size_t e = 0; e < L.experts.gate_up_nf4.size(); ++e)
    experts += L.experts.gate_up_nf4[e].nbytes() + L.experts.down_nf4[e].nbytes();
  for (const at::Tensor* t : {&L.input_layernorm, &L.post_attention_layernorm, &L.q_norm, &L.k_norm})
    norms += nbytes(*t);
  for (const at::Tensor& t : L.trainable()) lora += nbytes(t);
  const int64_t router = nbytes(L.router);
  return {{"weights_bytes", attn + experts + norms + router},
          {"weights_bytes_by_part", {{"experts", experts}, {"router", router}, {"attention", attn + norms}}},
          {"lora_bytes", lora}};
}

json counts_stats(const at::Tensor& counts_in) {
  const at::Tensor c = counts_in.to(at::kDouble).contiguous();
  const double mean = c.mean().item<double>();
  std::vector<int64_t> per(static_cast<size_t>(c.numel()));
  for (int64_t e = 0; e < c.numel(); ++e) per[static_cast<size_t>(e)] = static_cast<int64_t>(c[e].item<double>());
  return {{"per_expert", per}, {"min", static_cast<int64_t>(c.min().item<double>())},
          {"max", static_cast<int64_t>(c.max().item<double>())}, {"mean", mean},
          {"std", c.std(/*unbiased=*/false).item<double>()}, {"max_over_mean", c.max().item<double>() / mean},
          {"experts_used", (c > 0).sum().item<int64_t>()}, {"experts_unused", (c == 0).sum().item<int64_t>()}};
}

using qlora::bench::seconds_since;
using qlora::bench::median;


// Phase seconds and "phase: op" seconds accumulated by StepProfile (its tables are static, so a
// second profile in the same process is the difference of two snapshots).
struct ProfileSnapshot {
  std::map<std::string, double> phases, ops;
};

ProfileSnapshot snapshot(const qlora::bench::StepProfile& p) {
  ProfileSnapshot s{p.phases(), {}};
  for (const auto& [op, sec] : p.top_ops(100000)) s.ops[op] = sec;
  return s;
}

json profile_json(const ProfileSnapshot& before, const ProfileSnapshot& after, double step_s) {
  json seconds = json::object(), share = json::object();
  double tracked = 0;
  for (const auto& [name, s] : after.phases) {
    const double d = s - (before.phases.count(name) ? before.phases.at(name) : 0.0);
    if (d <= 0) continue;
    seconds[name] = d;
    share[name] = d / step_s;
    tracked += d;
  }
  seconds["untracked"] = std::max(0.0, step_s - tracked);
  share["untracked"] = std::max(0.0, step_s - tracked) / step_s;
  std::vector<std::pair<std::string, double>> ops;
  for (const auto& [op, s] : after.ops) ops.emplace_back(op, s - (before.ops.count(op) ? before.ops.at(op) : 0.0));
  std::sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  json top = json::array();
  for (size_t i = 0; i < std::min<size_t>(25, ops.size()); ++i)
    top.push_back({{"op", ops[i].first}, {"seconds", ops[i].second}});
  return {{"profiled_step_s", step_s}, {"seconds", seconds}, {"share", share}, {"top_ops", top}};
}

// Our side, in this (fresh) process.
json worker(const Args& a) {
  namespace M = qlora::modules;
  const qlora::models::DecoderConfig c = moe_config(a.model);
  if (!c.is_moe(0)) throw std::logic_error("the bench layer is not a MoE layer");
  const qlora::models::DecoderModel m = qlora::bench::random_model(
      c, a.r, a.alpha, false,
      [&](int64_t, M::DecoderLayer& L, const qlora::models::Architecture&) { add_moe(c, L, a.r, a.alpha, a.compute); },
      a.compute);
  qlora::io::release_free_cpu_memory();  // as after loading: the build's temporaries go back
  const M::DecoderLayer& layer = m.layers.at(0);
  const M::LayerDims d = m.dims(0);
  const int64_t T = a.seq, H = c.hidden_size;
  const at::Tensor x = qlora::bench::seeded_randn({1, T, H}, kInputSeed, at::kCPU).to(a.compute);
  const at::Tensor dy = qlora::bench::seeded_randn({1, T, H}, kGradSeed, at::kCPU).to(a.compute);
  const at::Tensor positions = at::arange(T, at::TensorOptions().dtype(at::kLong));
  const M::RopeTables rope =
      M::rope_tables(m.inv_freq, positions, m.compute_dtype, M::rope_attention_scaling(c.rope()));
  const std::vector<at::Tensor> trainable = layer.trainable();
  M::Routing routing;
  const M::LayerExtras extras{{}, nullptr, &routing};

  auto layer_step = [&]() {
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor h = x.detach().requires_grad_();
    const at::Tensor y = M::decoder_layer_forward(layer, d, h, rope, /*training=*/true, nullptr, {}, nullptr, &extras);
    torch::autograd::backward({y}, {dy});
    for (const at::Tensor& p : trainable) p.mutable_grad().reset();
    return seconds_since(t0);
  };
  // The MoE block alone (router + experts) on the layer's normalised input, with or without the
  // experts' adapters.
  const at::Tensor x_moe = [&] {
    at::NoGradGuard no_grad;
    return M::layer_norm(d, x, layer.post_attention_layernorm);
  }();
  auto moe_step = [&](bool adapters) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<M::AdaptersDisabled> off;
    if (!adapters) off = std::make_unique<M::AdaptersDisabled>();
    const at::Tensor h = x_moe.detach().requires_grad_();
    const at::Tensor y = M::moe_forward(layer.router, layer.experts, d.moe, h);
    torch::autograd::backward({y}, {dy});
    for (const at::Tensor& p : trainable) p.mutable_grad().reset();
    return seconds_since(t0);
  };

  json out = weight_bytes(layer);
  const int64_t rss0 = qlora::io::proc_status_bytes("VmRSS");
  const bool hwm_reset = qlora::bench::restart_peak_rss();
  const double first = layer_step();
  out["peak_rss_delta_bytes"] = qlora::io::proc_status_bytes("VmHWM") - rss0;
  out["peak_rss_bytes"] = qlora::io::proc_status_bytes("VmHWM");
  out["rss_before_step_bytes"] = rss0;
  out["hwm_reset"] = hwm_reset;
  out["first_step_s"] = first;
  out["tokens_per_expert"] = counts_stats(M::expert_counts(routing, c.moe.num_experts));
  layer_step();
  std::vector<double> t, t_moe, t_moe_base;
  for (int i = 0; i < a.reps; ++i) t.push_back(layer_step());
  moe_step(true);
  for (int i = 0; i < a.reps; ++i) t_moe.push_back(moe_step(true));
  moe_step(false);
  for (int i = 0; i < a.reps; ++i) t_moe_base.push_back(moe_step(false));
  out["impl"] = "qlora modules::decoder_layer_forward (NF4 base, grouped_experts)";
  out["threads"] = at::get_num_threads();
  out["fwd_bwd_s"] = median(t);
  out["times_s"] = t;
  out["moe_block_fwd_bwd_s"] = median(t_moe);
  out["moe_block_no_adapters_fwd_bwd_s"] = median(t_moe_base);
  out["attention_half_fwd_bwd_s"] = median(t) - median(t_moe);  // the layer minus its MoE block
  if (a.profile) {
    qlora::bench::StepProfile prof;
    const ProfileSnapshot s0 = snapshot(prof);
    const double lt = layer_step();
    const ProfileSnapshot s1 = snapshot(prof);
    const double mt = moe_step(true);
    const ProfileSnapshot s2 = snapshot(prof);
    out["profile_layer"] = profile_json(s0, s1, lt);
    out["profile_moe_block"] = profile_json(s1, s2, mt);
  }
  return out;
}

std::string worker_flags(const Args& a) {
  std::ostringstream s;
  s << " --model " << a.model << " --seq " << a.seq << " --r " << a.r << " --alpha " << a.alpha << " --reps " << a.reps
    << " --dtype " << a.dtype
    << " --threads " << a.threads << (a.profile ? "" : " --no-profile");
  return s.str();
}

std::string peer_flags(const Args& a, const qlora::models::DecoderConfig& c) {
  std::ostringstream s;
  s << " --seq " << a.seq << " --hidden " << c.hidden_size << " --heads " << c.num_attention_heads << " --kv-heads "
    << c.num_key_value_heads << " --head-dim " << c.head_dim << " --experts " << c.moe.num_experts << " --top-k "
    << c.moe.top_k << " --inter " << c.moe.inter << " --norm-topk-prob " << (c.moe.norm_topk_prob ? 1 : 0) << " --r "
    << a.r << " --alpha " << a.alpha << " --reps " << a.reps << " --threads " << a.threads << " --router-seed "
    << kRouterSeed << " --input-seed " << kInputSeed << " --grad-seed " << kGradSeed << " --router-std " << kRouterStd
    << " --rope-theta " << c.rope().theta << " --eps " << c.rms_norm_eps;
  return s.str();
}

// One run: both sides, each in its own process, and the ratios.
json measure(const Args& a, const qlora::models::DecoderConfig& c) {
  json r{{"load_average", qlora::bench::load_average()}};
  r["qlora"] = qlora::bench::run_json(qlora::bench::self_exe("bench_moe_layer") + " --worker" + worker_flags(a));
  if (!a.peer) return r;
  r["peer"] = qlora::bench::run_json(std::string(QLORA_PYTHON) + " " + QLORA_SOURCE_DIR + "/bench/moe_peer.py" +
                                     peer_flags(a, c) + " 2>/dev/null");
  r["load_average_after"] = qlora::bench::load_average();
  const json &q = r["qlora"], &p = r["peer"];
  if (q.contains("fwd_bwd_s") && p.contains("fwd_bwd_s")) {
    r["speedup_vs_peer"] = p["fwd_bwd_s"].get<double>() / q["fwd_bwd_s"].get<double>();
    r["peak_rss_delta_ratio"] = q["peak_rss_delta_bytes"].get<double>() / p["peak_rss_delta_bytes"].get<double>();
    r["peak_rss_ratio"] = q["peak_rss_bytes"].get<double>() / p["peak_rss_bytes"].get<double>();
    r["weights_bytes_ratio"] = q["weights_bytes"].get<double>() / p["weights_bytes"].get<double>();
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "bench_moe_layer: " << e.what()
              << "\nusage: bench_moe_layer [--model qwen3-30b-a3b|qwen3.5-35b-a3b|gpt-oss-20b] [--seq 512] [--reps 3] "
                 "[--runs 1] [--r 8] [--alpha 2r] "
                 "[--dtype auto|fp32|bf16] [--threads N] [--no-peer] [--no-profile]\n";
    return 2;
  }
  qlora::io::tune_cpu_memory();  // as the training programs run
  if (a.threads > 0) at::set_num_threads(a.threads);
  if (a.worker) {
    std::cout << worker(a).dump() << std::endl;
    return 0;
  }
  const qlora::models::DecoderConfig c = moe_config(a.model);
  json j{{"bench", "moe_layer_fwd_bwd"},
         {"machine", {{"cpu", qlora::bench::cpu_model()}, {"load_average", qlora::bench::load_average()},
                      {"qlora_isa", qlora::kernels::isa_name(qlora::kernels::active_isa())},
                      {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)}, {"threads", at::get_num_threads()}}},
         {"shape", {{"model", a.model + " (one layer, random weights)"}, {"hidden", c.hidden_size},
                    {"heads", c.num_attention_heads}, {"kv_heads", c.num_key_value_heads}, {"head_dim", c.head_dim},
                    {"experts", c.moe.num_experts}, {"top_k", c.moe.top_k}, {"moe_intermediate", c.moe.inter},
                    {"norm_topk_prob", c.moe.norm_topk_prob}, {"seq", a.seq}, {"batch", 1}, {"tokens", a.seq},
                    {"lora_r", a.r}, {"lora_alpha", a.alpha}, {"compute", a.dtype}, {"why", a.why},
                    {"base", "nf4 (ours) / bf16 (peer)"}, {"router_std", kRouterStd}}},
         {"reps", a.reps},
         {"runs", a.runs}};
  for (const char* v : {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"})  // what both sides inherit
    if (const char* set = std::getenv(v)) j["omp_wait"][v] = set;
  std::vector<double> speedups, ours, theirs;
  for (int i = 0; i < a.runs; ++i) {
    std::cerr << "bench_moe_layer: run " << i + 1 << " of " << a.runs << std::endl;
    json r = measure(a, c);
    if (r.contains("speedup_vs_peer")) {
      speedups.push_back(r["speedup_vs_peer"].get<double>());
      ours.push_back(r["qlora"]["fwd_bwd_s"].get<double>());
      theirs.push_back(r["peer"]["fwd_bwd_s"].get<double>());
    } else if (r["qlora"].contains("fwd_bwd_s")) {
      ours.push_back(r["qlora"]["fwd_bwd_s"].get<double>());
    }
    j["per_run"].push_back(std::move(r));
  }
  // The summary: medians over the runs; memory from the first run (it does not vary).
  const json& first = j["per_run"][0];
  json s;
  if (!ours.empty()) s["qlora_fwd_bwd_s"] = median(ours);
  if (!theirs.empty()) {
    s["peer_fwd_bwd_s"] = median(theirs);
    s["speedup_vs_peer"] = median(speedups);
    s["speedup_per_run"] = speedups;
  }
  for (const char* side : {"qlora", "peer"}) {
    if (!first.contains(side) || !first[side].contains("peak_rss_delta_bytes")) continue;
    const json& f = first[side];
    s[std::string(side) + "_peak_rss_delta_bytes"] = f["peak_rss_delta_bytes"];
    s[std::string(side) + "_peak_rss_bytes"] = f["peak_rss_bytes"];
    s[std::string(side) + "_weights_bytes"] = f["weights_bytes"];
    s[std::string(side) + "_lora_bytes"] = f["lora_bytes"];
    s[std::string(side) + "_tokens_per_expert"] = {{"min", f["tokens_per_expert"]["min"]},
                                                   {"max", f["tokens_per_expert"]["max"]},
                                                   {"mean", f["tokens_per_expert"]["mean"]},
                                                   {"std", f["tokens_per_expert"]["std"]},
                                                   {"max_over_mean", f["tokens_per_expert"]["max_over_mean"]},
                                                   {"experts_unused", f["tokens_per_expert"]["experts_unused"]}};
  }
  if (first.contains("peak_rss_delta_ratio")) {
    s["peak_rss_delta_ratio"] = first["peak_rss_delta_ratio"];
    s["peak_rss_ratio"] = first["peak_rss_ratio"];
    s["weights_bytes_ratio"] = first["weights_bytes_ratio"];
    s["target"] = "speedup_vs_peer >= 2, peak_rss_delta_ratio <= 1";
    s["target_met"] = s["speedup_vs_peer"].get<double>() >= 2.0 && s["peak_rss_delta_ratio"].get<double>() <= 1.0;
  }
  j["summary"] = s;
  j["machine"]["load_average_after"] = qlora::bench::load_average();
  std::cout << j.dump(2) << std::endl;
  return 0;
}
