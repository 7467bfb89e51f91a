// LoRA's narrow products (kernels/narrow_cpu.h) against ATen's GEMM (MKL) on the same operands,
// for the shapes of one layer of the 100M bench model (hidden 768, MLP 2048, rank 8, 512 tokens;
// q/k/v and gate/up as groups: rank 24 and 16). MKL gets each product in its faster operand
// layout. Each case in fp32 and in bf16 (all operands bf16, as in bf16 compute; MKL's bf16 GEMM
// beside it). Prints one JSON object, with the per-layer totals per dtype and the kernels' ISA
// (QLORA_CPU_ISA=avx2 etc. forces a lower one).
//
//   build/bench_narrow [--tokens T] [--reps N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "bench/machine.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/ops/narrow_ops.h"

using nlohmann::json;
namespace ops = qlora::ops;

namespace {

using qlora::bench::median_s;

// kind: "product" u = x [T, k] @ w [k, r]; "reduction" u^T [r, T] @ x [T, k]; "update" y [T, k] += u [T, r] @ v [r, k].
struct Case {
  std::string name, kind;
  int64_t k, r;
};

json run_case(const Case& c, int64_t T, int reps, at::ScalarType dtype) {
  const at::TensorOptions o = at::TensorOptions().dtype(dtype);
  const at::Tensor x = at::randn({T, c.k}, o), u = at::randn({T, c.r}, o), w = at::randn({c.k, c.r}, o);
  const at::Tensor w_t = w.t().contiguous().t(), v = at::randn({c.r, c.k}, o);
  at::Tensor y = at::randn({T, c.k}, o), out = at::empty({T, c.r}, o);
  double ours = 0, mkl = 0;
  if (c.kind == "product") {
    ours = median_s([&] { ops::narrow_product_out(out, x, w); }, reps);
    mkl = std::min(median_s([&] { at::mm_out(out, x, w); }, reps), median_s([&] { at::mm_out(out, x, w_t); }, reps));
  } else if (c.kind == "reduction") {
    ours = median_s([&] { ops::narrow_reduction(u, x); }, reps);
    mkl = median_s([&] { at::mm(u.t(), x); }, reps);
  } else {
    ours = median_s([&] { ops::narrow_update_(y, u, v, 0.5); }, reps);
    mkl = median_s([&] { y.addmm_(u, v, 1.0, 0.5); }, reps);
  }
  return {{"name", c.name}, {"kind", c.kind}, {"dtype", c10::toString(dtype)}, {"tokens", T}, {"k", c.k}, {"r", c.r},
          {"qlora_us", ours * 1e6}, {"mkl_us", mkl * 1e6}, {"speedup", mkl / ours}};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 512;
  int reps = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string s = argv[i];
    if (s == "--tokens") T = std::stoll(argv[i + 1]);
    else if (s == "--reps") reps = std::stoi(argv[i + 1]);
    else {
      std::cerr << "usage: bench_narrow [--tokens T] [--reps N]\n";
      return 2;
    }
  }
  const std::vector<Case> cases = {
      {"x @ A^T, q/k/v", "product", 768, 24},  {"x @ A^T, gate/up", "product", 768, 16},
      {"x @ A^T, o", "product", 768, 8},       {"x @ A^T, down", "product", 2048, 8},
      {"g @ B, out 768 (x5)", "product", 768, 8}, {"g @ B, out 2048 (x2)", "product", 2048, 8},
      {"A grad, q/k/v", "reduction", 768, 24}, {"A grad, gate/up", "reduction", 768, 16},
      {"A grad, o", "reduction", 768, 8},      {"A grad, down", "reduction", 2048, 8},
      {"B grad, out 768 (x5)", "reduction", 768, 8}, {"B grad, out 2048 (x2)", "reduction", 2048, 8},
      {"y += u B^T, out 768 (x5)", "update", 768, 8}, {"y += u B^T, out 2048 (x2)", "update", 2048, 8},
      {"x grad += g A, q/k/v", "update", 768, 24}, {"x grad += g A, gate/up", "update", 768, 16},
      {"x grad += g A, o", "update", 768, 8},  {"x grad += g A, down", "update", 2048, 8}};
  json rows = json::array(), per_layer;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    double ours = 0, mkl = 0;
    for (const Case& c : cases) {
      json j = run_case(c, T, reps, dtype);
      const double times = c.name.find("(x5)") != std::string::npos ? 5 : c.name.find("(x2)") != std::string::npos ? 2 : 1;
      ours += times * j["qlora_us"].get<double>();
      mkl += times * j["mkl_us"].get<double>();
      rows.push_back(j);
    }
    per_layer[dtype == at::kFloat ? "per_layer" : "per_layer_bf16"] = {{"qlora_us", ours}, {"mkl_us", mkl},
                                                                       {"speedup", mkl / ours}};
  }
  const char* isa = qlora::kernels::isa_name(qlora::kernels::active_isa());
  json out = {{"bench", "narrow"},
              {"machine", {{"cpu", qlora::bench::cpu_model()}, {"threads", at::get_num_threads()},
                           {"loadavg", qlora::bench::load_average()}, {"isa", isa}}},
              {"cases", rows}};
  out.update(per_layer);
  std::cout << out.dump(1) << "\n";
}
