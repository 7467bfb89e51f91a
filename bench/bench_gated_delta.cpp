// The gated delta rule (ops/gated_delta_ops.h) forward + backward against transformers'
// torch_chunk_gated_delta_rule with autograd through it (bench/gated_delta_peer.py), at a
// Qwen3.5-9B linear-attention layer's shape (configuration_qwen3_5.py: 16 key heads and 32 value
// heads of dim 128), batch 1, for each --seq. Each side runs in a fresh process per shape (this
// program starts itself with --worker): the first step's peak RSS over the RSS before it is the
// step's memory, then the median of --reps timed steps after one warm-up. Prints one JSON object
// with the CPU (lscpu's model name), qlora's ISA and torch's, and the ratios.
//
//   build/bench_gated_delta [--seqs 512,2048] [--dtype bf16|fp32] [--reps 3] [--threads N] [--no-peer]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <iostream>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "bench/machine.h"
#include "bench/run_json.h"
#include "kernels/cpu_isa.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/ops/gated_delta_ops.h"

using nlohmann::json;

namespace {

struct Args {
  std::vector<int64_t> seqs{512, 2048};
  int64_t batch = 1, k_heads = 16, v_heads = 32, dk = 128, dv = 128;
  std::string dtype = "bf16";
  int reps = 3, threads = 0;
  bool peer = true, worker = false;
};

struct Inputs {
  at::Tensor q, k, v, g, beta, d_out;
};

// As gated_delta_peer.py draws them: q, k, v, beta and d_out in the bench dtype, g in fp32 from
// Qwen3_5GatedDeltaNet's A_log init (A uniform in [0.01, 16]) and dt_bias = 1.
Inputs make_inputs(const Args& a, int64_t seq) {
  at::manual_seed(0);
  const at::ScalarType dt = a.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const at::Tensor a_log = at::empty({a.v_heads}).uniform_(0.01, 16).log();
  Inputs in;
  in.q = at::randn({a.batch, seq, a.k_heads, a.dk}).to(dt);
  in.k = at::randn({a.batch, seq, a.k_heads, a.dk}).to(dt);
  in.v = at::randn({a.batch, seq, a.v_heads, a.dv}).to(dt);
  in.g = -a_log.exp() * at::softplus(at::randn({a.batch, seq, a.v_heads}) + 1.0);
  in.beta = at::sigmoid(at::randn({a.batch, seq, a.v_heads})).to(dt);
  in.d_out = at::randn({a.batch, seq, a.v_heads, a.dv}).to(dt);
  return in;
}

double step_s(const Inputs& in) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> l;
  for (const at::Tensor& t : {in.q, in.k, in.v, in.g, in.beta}) l.push_back(t.detach().requires_grad_());
  const auto [out, fin] = qlora::ops::chunk_gated_delta_rule(l[0], l[1], l[2], l[3], l[4], {}, false, true);
  torch::autograd::backward({out}, {in.d_out});
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One shape in this (fresh) process: memory from the first step, then the timed ones.
json worker(const Args& a) {
  const Inputs in = make_inputs(a, a.seqs.at(0));
  const int64_t rss0 = qlora::io::proc_status_bytes("VmRSS");
  const double first = step_s(in);
  const int64_t peak = qlora::io::proc_status_bytes("VmHWM") - rss0;
  step_s(in);
  std::vector<double> t;
  for (int i = 0; i < a.reps; ++i) t.push_back(step_s(in));
  std::sort(t.begin(), t.end());
  return {{"impl", "qlora ops::chunk_gated_delta_rule"}, {"threads", at::get_num_threads()}, {"first_step_s", first},
          {"fwd_bwd_s", t.empty() ? first : t[t.size() / 2]}, {"peak_rss_delta_bytes", peak}};
}

std::string shape_flags(const Args& a, int64_t seq) {
  std::ostringstream s;
  s << " --seq " << seq << " --batch " << a.batch << " --k-heads " << a.k_heads << " --v-heads " << a.v_heads
    << " --dk " << a.dk << " --dv " << a.dv << " --dtype " << a.dtype << " --reps " << a.reps << " --threads "
    << a.threads;
  return s.str();
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, n) : "bench_gated_delta";
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
      return argv[++i];
    };
    if (s == "--seqs" || s == "--seq") {
      a.seqs.clear();
      std::stringstream list(next());
      for (std::string x; std::getline(list, x, ',');) a.seqs.push_back(std::stoll(x));
    } else if (s == "--batch") a.batch = std::stoll(next());
    else if (s == "--k-heads") a.k_heads = std::stoll(next());
    else if (s == "--v-heads") a.v_heads = std::stoll(next());
    else if (s == "--dk") a.dk = std::stoll(next());
    else if (s == "--dv") a.dv = std::stoll(next());
    else if (s == "--dtype") a.dtype = next();
    else if (s == "--reps") a.reps = std::stoi(next());
    else if (s == "--threads") a.threads = std::stoi(next());
    else if (s == "--no-peer") a.peer = false;
    else if (s == "--worker") a.worker = true;
    else throw std::invalid_argument("unknown argument " + s);
  }
  if (a.dtype != "bf16" && a.dtype != "fp32") throw std::invalid_argument("--dtype is bf16 or fp32");
  return a;
}

// One shape: both sides, each in its own process, and the ratios.
json measure(const Args& a, int64_t seq) {
  json r{{"seq", seq}};
  r["qlora"] = qlora::bench::run_json(self_exe() + " --worker" + shape_flags(a, seq));
  if (!a.peer) return r;
  r["peer"] = qlora::bench::run_json(std::string(QLORA_PYTHON) + " " + QLORA_SOURCE_DIR + "/bench/gated_delta_peer.py" +
                                     shape_flags(a, seq) + " 2>/dev/null");
  if (r["qlora"].contains("fwd_bwd_s") && r["peer"].contains("fwd_bwd_s")) {
    r["speedup"] = r["peer"]["fwd_bwd_s"].get<double>() / r["qlora"]["fwd_bwd_s"].get<double>();
    r["memory_ratio"] = double(r["peer"]["peak_rss_delta_bytes"].get<int64_t>()) /
                        double(std::max<int64_t>(1, r["qlora"]["peak_rss_delta_bytes"].get<int64_t>()));
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "bench_gated_delta: " << e.what()
              << "\nusage: bench_gated_delta [--seqs 512,2048] [--dtype bf16|fp32] [--reps 3] [--threads N] [--no-peer]\n";
    return 2;
  }
  qlora::io::tune_cpu_memory();  // as the training programs run: freed buffers reused by size
  if (a.threads > 0) at::set_num_threads(a.threads);
  if (a.worker) {
    std::cout << worker(a).dump() << std::endl;
    return 0;
  }
  json j{{"bench", "gated_delta_fwd_bwd"},
         {"machine", {{"cpu", qlora::bench::cpu_model()}, {"load_average", qlora::bench::load_average()},
                      {"qlora_isa", qlora::kernels::isa_name(qlora::kernels::active_isa())}}},
         {"shape", {{"batch", a.batch}, {"k_heads", a.k_heads}, {"v_heads", a.v_heads}, {"dk", a.dk}, {"dv", a.dv},
                    {"dtype", a.dtype}, {"chunk", qlora::ops::kGatedDeltaChunk}}},
         {"reps", a.reps}};
  for (int64_t seq : a.seqs) j["runs"].push_back(measure(a, seq));
  j["machine"]["load_average_after"] = qlora::bench::load_average();
  std::cout << j.dump(2) << std::endl;
  return 0;
}
