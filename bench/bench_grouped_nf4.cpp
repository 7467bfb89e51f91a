// The experts' frozen products (ops/grouped_matmul_ops.h: one call, each expert's NF4 tiles decoded
// inside the product) against the per-expert path they replace on the same operands (the floor a
// kernel must beat: each expert's NF4 weight dequantized by nf4_linear's chunks, then ATen's GEMM,
// oneDNN/MKL), for one MoE layer of Qwen3-30B-A3B (128 experts, hidden 2048, expert width 768, top 8
// of 512 tokens: ~32 rows an expert): gate_up [1536, 2048] and down [2048, 768], forward (x W^T) and
// transposed (x's gradient, g W). fp32 and bf16 operands. Prints one JSON object, the CPU and the
// kernel's ISA named (QLORA_CPU_ISA=avx2 etc. forces a lower one).
//
//   build/bench_grouped_nf4 [--tokens T] [--reps N] [--experts E] [--top-k K]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <iostream>
#include <string>
#include <vector>

#include "bench/machine.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/modules/nf4_linear.h"
#include "qlora/ops/grouped_matmul_ops.h"
#include "qlora/ops/nf4_ops.h"

using nlohmann::json;

namespace {

struct Shape {
  int64_t tokens = 512, experts = 128, top_k = 8, hidden = 2048, inter = 768;
  int reps = 5;
};

// One projection's weights [N, K] (one NF4 tensor per expert) and the routed rows per expert.
json run_case(const std::string& name, int64_t N, int64_t K, bool transposed, const std::vector<int64_t>& counts,
              at::ScalarType dtype, int reps) {
  std::vector<qlora::Nf4Tensor> w;
  std::vector<const qlora::Nf4Tensor*> ptrs;
  for (size_t e = 0; e < counts.size(); ++e) w.push_back(qlora::ops::nf4_quantize(at::randn({N, K}).mul_(0.02).to(dtype)));
  for (const auto& q : w) ptrs.push_back(&q);
  int64_t S = 0;
  for (int64_t c : counts) S += c;
  const int64_t in = transposed ? N : K, out = transposed ? K : N;
  const at::Tensor x = at::randn({S, in}).to(dtype);
  at::Tensor y = at::empty({S, out}, x.options());
  const double ours = qlora::bench::median_s([&] { qlora::ops::grouped_nf4_matmul_out(x, counts, ptrs, transposed, y); }, reps, 1);
  const double floor = qlora::bench::median_s(
      [&] {
        for (size_t e = 0, off = 0; e < counts.size(); off += counts[e], ++e) {
          if (counts[e] == 0) continue;
          at::Tensor ye = y.narrow(0, off, counts[e]);
          const at::Tensor xe = x.narrow(0, off, counts[e]);
          if (transposed) qlora::modules::grad_times_nf4_out(xe, w[e], ye, false);
          else qlora::modules::nf4_times_transposed_out(xe, w[e], ye);
        }
      },
      reps, 1);
  const double flops = 2.0 * S * N * K;
  return {{"name", name},          {"dtype", c10::toString(dtype)}, {"rows", S},
          {"qlora_ms", ours * 1e3}, {"floor_ms", floor * 1e3},      {"speedup_vs_floor", floor / ours},
          {"qlora_gflops", flops / ours / 1e9}, {"floor_gflops", flops / floor / 1e9}};
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tokens") s.tokens = std::stoll(argv[i + 1]);
    else if (a == "--reps") s.reps = std::stoi(argv[i + 1]);
    else if (a == "--experts") s.experts = std::stoll(argv[i + 1]);
    else if (a == "--top-k") s.top_k = std::stoll(argv[i + 1]);
    else {
      std::cerr << "usage: bench_grouped_nf4 [--tokens T] [--reps N] [--experts E] [--top-k K]\n";
      return 2;
    }
  }
  at::manual_seed(0);
  // A uniform router's routing: each token's top k of random logits.
  const at::Tensor index = std::get<1>(at::randn({s.tokens, s.experts}).topk(s.top_k, 1));
  const at::Tensor c = at::bincount(index.reshape(-1), {}, s.experts).contiguous();
  const std::vector<int64_t> counts(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + s.experts);
  json rows = json::array();
  double ours = 0, floor = 0;
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat})
    for (bool transposed : {false, true}) {
      for (const auto& [name, N, K] : {std::tuple<std::string, int64_t, int64_t>{"gate_up", 2 * s.inter, s.hidden},
                                       {"down", s.hidden, s.inter}}) {
        json j = run_case(name + (transposed ? " (x grad)" : ""), N, K, transposed, counts, dtype, s.reps);
        if (dtype == at::kBFloat16) ours += j["qlora_ms"].get<double>(), floor += j["floor_ms"].get<double>();
        rows.push_back(j);
      }
    }
  json out = {{"bench", "grouped_nf4"},
              {"machine", {{"cpu", qlora::bench::cpu_model()}, {"threads", at::get_num_threads()},
                           {"load_average", qlora::bench::load_average()},
                           {"isa", qlora::kernels::isa_name(qlora::kernels::active_isa())}}},
              {"shape", {{"tokens", s.tokens}, {"experts", s.experts}, {"top_k", s.top_k}, {"hidden", s.hidden},
                         {"inter", s.inter}}},
              {"cases", rows},
              {"bf16_layer", {{"qlora_ms", ours}, {"floor_ms", floor}, {"speedup_vs_floor", floor / ours}}}};
  std::cout << out.dump(1) << "\n";
}
