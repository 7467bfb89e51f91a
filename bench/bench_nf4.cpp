// NF4 throughput for one Llama-2-7B MLP weight (11008x4096 bf16): qlora's quantize and
// dequantize against memcpy of the same output size and against torchao (the peer, run by
// bench/torchao_peer.py in the same invocation). Prints one JSON object.
//
//   build/bench_nf4 [--device cpu|cuda] [--rows R --cols C] [--reps N] [--no-peer]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "bench/machine.h"
#include "bench/run_json.h"
#include "kernels/cpu_isa.h"
#include "qlora/ops/nf4_ops.h"

#ifdef QLORA_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

using nlohmann::json;

namespace {

struct Args {
  std::string device = "cpu";
  int64_t rows = 11008, cols = 4096;
  int reps = 10;
  bool peer = true;
};

void sync(const std::string& device) {
#ifdef QLORA_WITH_CUDA
  if (device == "cuda") c10::cuda::device_synchronize();
#else
  (void)device;
#endif
}

json timed(const std::function<void()>& fn, int reps, const std::string& device) {
  fn();  // warm-up: page faults, thread pool start
  sync(device);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    sync(device);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return {{"median_s", t[t.size() / 2]}, {"min_s", t.front()}, {"reps", reps}};
}

json run_peer(const Args& a) {
  return qlora::bench::run_json(std::string(QLORA_PYTHON) + " " + QLORA_SOURCE_DIR +
                                "/bench/torchao_peer.py --device " + a.device + " --rows " +
                                std::to_string(a.rows) + " --cols " + std::to_string(a.cols));
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
      return argv[++i];
    };
    if (s == "--device") a.device = next();
    else if (s == "--rows") a.rows = std::stoll(next());
    else if (s == "--cols") a.cols = std::stoll(next());
    else if (s == "--reps") a.reps = std::stoi(next());
    else if (s == "--no-peer") a.peer = false;
    else { std::cerr << "unknown argument " << s << "\n"; return 2; }
  }
  if (a.device == "cuda" && !qlora::ops::cuda_available()) {
    std::cerr << "bench_nf4: --device cuda but no CUDA device\n";
    return 2;
  }
  const at::Device dev = a.device == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  at::manual_seed(0);
  const at::Tensor x = (at::randn({a.rows, a.cols}) * 0.02).to(at::kBFloat16).to(dev);
  const int64_t numel = x.numel();
  qlora::Nf4Tensor q = qlora::ops::nf4_quantize(x, "bench");
  at::Tensor out = at::empty({numel}, x.options());
  at::Tensor src = at::ones({numel}, x.options());

  json r;
  r["dequantize_bf16"] = timed([&] { qlora::ops::nf4_dequantize_out(q, out); }, a.reps, a.device);
  at::Tensor out_f32 = at::empty({numel}, x.options().dtype(at::kFloat));
  r["dequantize_bf16_to_fp32"] =
      timed([&] { qlora::ops::nf4_dequantize_out(q, out_f32); }, a.reps, a.device);
  r["quantize_bf16"] = timed([&] { q = qlora::ops::nf4_quantize(x, "bench"); }, std::max(2, a.reps / 3), a.device);
  const size_t bytes = static_cast<size_t>(numel) * 2;
  if (dev.is_cpu()) {
    r["memcpy"] = timed([&] { std::memcpy(out.data_ptr(), src.data_ptr(), bytes); }, a.reps, a.device);
    r["memcpy_parallel"] = timed(
        [&] {
          at::parallel_for(0, numel, 1 << 20, [&](int64_t b, int64_t e) {
            std::memcpy(static_cast<char*>(out.data_ptr()) + 2 * b,
                        static_cast<const char*>(src.data_ptr()) + 2 * b, 2 * (e - b));
          });
        },
        a.reps, a.device);
  } else {
    r["memcpy"] = timed([&] { out.copy_(src); }, a.reps, a.device);
  }
  auto gbps = [&](const json& t, double nbytes) { return nbytes / t["median_s"].get<double>() / 1e9; };
  json derived;
  derived["dequantize_output_GBps"] = gbps(r["dequantize_bf16"], bytes);
  derived["memcpy_GBps"] = gbps(r["memcpy"], bytes);
  derived["dequantize_vs_memcpy"] =
      r["memcpy"]["median_s"].get<double>() / r["dequantize_bf16"]["median_s"].get<double>();
  json report = {{"benchmark", "nf4"},
                 {"shape", {a.rows, a.cols}},
                 {"dtype", "bfloat16"},
                 {"device", a.device},
                 {"machine",
                  {{"cpu", qlora::bench::cpu_model()},
                   {"cpu_isa", qlora::kernels::isa_name(qlora::kernels::active_isa())},
                   {"hardware_threads", std::thread::hardware_concurrency()},
                   {"aten_threads", at::get_num_threads()}}},
                 {"qlora", r}};
  if (a.peer) {
    const json peer = run_peer(a);
    report["torchao"] = peer;
    if (!peer.contains("error")) {
      derived["dequantize_speedup_vs_torchao"] =
          peer["dequantize"]["median_s"].get<double>() / r["dequantize_bf16"]["median_s"].get<double>();
      derived["quantize_speedup_vs_torchao"] =
          peer["to_nf4"]["median_s"].get<double>() / r["quantize_bf16"]["median_s"].get<double>();
    }
  }
  report["derived"] = derived;
  std::cout << report.dump(2) << std::endl;
  return 0;
}
