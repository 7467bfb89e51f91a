// Causal attention for training on the CPU (modules/blocked_attention.h), forward + backward,
// against ATen's scaled_dot_product_attention (its CPU flash kernel) and against the floor of its
// own GEMMs: their FLOPs (q k^T, p v forward; dO v^T, p^T dO, dS k, dS^T q backward, over the
// causal blocks) at the rate of a large fp32 GEMM measured in the same run. Shape of the 100M bench model by default: 12 heads, head_dim 64, seq 512, batch 1.
// Then the same in bf16 (q, k, v and the gradient bf16): qlora's causal_attention as a bf16 run
// takes it (the fp32 blocked attention on widened inputs), the blocked attention run on the bf16
// tensors themselves (bf16 block GEMMs, ATen's softmax), and ATen's bf16 flash kernel. Prints one
// JSON object, with the kernels' ISA (QLORA_CPU_ISA forces a lower one). Each dtype also times
// packed rows (4 samples per row, block-causal mask) through masked_attention against SDPA.
//
// --tower instead times the vision towers' attention: full (unmasked) attention forward in bf16
// with nothing differentiated, one image of --seq patches (default Qwen3.5-9B's tower on a
// 1024x768 image: 16 heads, head_dim 72, 3072 rows): ops::segment_attention (the AMX kernel where
// the CPU has AMX-BF16) against ATen's SDPA on the same [1, heads, rows, d] tensors, and the floor of
// its two products at the rate of a bf16 GEMM of the tower's shape measured in the same run.
//
//   build/bench_attention [--tower] [--heads H] [--dim D] [--seq S] [--block B] [--reps N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "bench/machine.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/modules/attention.h"
#include "qlora/modules/blocked_attention.h"
#include "qlora/ops/segment_attention_ops.h"

using nlohmann::json;

namespace {

using qlora::bench::median_s;

// Forward + backward of attn(q, k, v) with a fixed upstream gradient.
double fwd_bwd_s(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>& attn,
                 const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& go, int reps) {
  return median_s([&] {
    const at::Tensor qq = q.detach().requires_grad_(), kk = k.detach().requires_grad_(), vv = v.detach().requires_grad_();
    torch::autograd::backward({attn(qq, kk, vv)}, {go});
  }, reps);
}

// The FLOPs of the blocked kernel's six products (q k^T and p v forward; dO v^T, p^T dO, dS k and
// dS^T q backward), each [n, keys] x d for every query block of every head.
double block_gemm_flops(int64_t bh, int64_t seq, int64_t d, int64_t block) {
  double flops = 0;
  for (int64_t i0 = 0; i0 < seq; i0 += block) flops += 6.0 * 2.0 * bh * std::min(block, seq - i0) * std::min(i0 + block, seq) * d;
  return flops;
}

// This machine's fp32 GEMM rate (FLOP/s): a 2048^3 at::mm on the same threads.
double sgemm_flop_rate(int reps) {
  const at::Tensor a = at::randn({2048, 2048}), b = at::randn({2048, 2048});
  at::Tensor c = at::empty({2048, 2048});
  return 2.0 * 2048 * 2048 * 2048 / median_s([&] { at::mm_out(c, a, b); }, reps);
}

// The towers' attention forward (bench's --tower): JSON.
json tower_json(int64_t heads, int64_t dim, int64_t seq, int reps) {
  c10::InferenceMode no_grad;
  const at::Tensor qkv = at::randn({seq, 3, heads, dim}).to(at::kBFloat16);  // one projection's views, as the tower's
  const at::Tensor q = qkv.select(1, 0), k = qkv.select(1, 1), v = qkv.select(1, 2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const double ours = median_s([&] { qlora::ops::segment_attention(q, k, v, {seq}, scale); }, reps);
  const auto heads_first = [](const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };
  const double sdpa = median_s([&] {
    at::scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), {}, 0.0, false, scale);
  }, reps);
  const at::Tensor a = at::randn({seq, 1152}).to(at::kBFloat16), b = at::randn({1152, 4304}).to(at::kBFloat16);
  const double rate = 2.0 * seq * 1152 * 4304 / median_s([&] { at::mm(a, b); }, reps);
  const double flops = 2.0 * 2.0 * heads * seq * seq * dim;
  return {{"bench", "tower_attention"},
          {"machine", {{"cpu", qlora::bench::cpu_model()}, {"threads", at::get_num_threads()},
                       {"isa", qlora::kernels::isa_name(qlora::kernels::active_isa())},
                       {"amx_kernel", qlora::ops::segment_attention_uses_amx(q, k, v)}}},
          {"shape", {{"heads", heads}, {"head_dim", dim}, {"rows", seq}, {"dtype", "bf16"}}},
          {"qlora_fwd_ms", ours * 1e3}, {"sdpa_fwd_ms", sdpa * 1e3}, {"sdpa_over_qlora", sdpa / ours},
          {"bf16_gemm_gflop_s", rate / 1e9}, {"gemm_floor_ms", flops / rate * 1e3}, {"qlora_over_floor", ours * rate / flops}};
}

}  // namespace

int main(int argc, char** argv) {
  qlora::io::tune_cpu_memory();  // as the training programs run: freed buffers reused by size
  int64_t heads = 0, dim = 0, seq = 0, block = 64;  // 0: the mode's default
  int reps = 20;
  bool tower = false;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const bool valued = i + 1 < argc;
    if (s == "--tower") tower = true;
    else if (s == "--heads" && valued) heads = std::stoll(argv[++i]);
    else if (s == "--dim" && valued) dim = std::stoll(argv[++i]);
    else if (s == "--seq" && valued) seq = std::stoll(argv[++i]);
    else if (s == "--block" && valued) block = std::stoll(argv[++i]);
    else if (s == "--reps" && valued) reps = std::stoi(argv[++i]);
    else {
      std::cerr << "usage: bench_attention [--tower] [--heads H] [--dim D] [--seq S] [--block B] [--reps N]\n";
      return 2;
    }
  }
  if (tower) {
    std::cout << tower_json(heads ? heads : 16, dim ? dim : 72, seq ? seq : 3072, reps).dump(2) << "\n";
    return 0;
  }
  heads = heads ? heads : 12, dim = dim ? dim : 64, seq = seq ? seq : 512;
  at::manual_seed(0);
  const at::Tensor q = at::randn({1, heads, seq, dim}), k = at::randn({1, heads, seq, dim});
  const at::Tensor v = at::randn({1, heads, seq, dim}), go = at::randn({1, heads, seq, dim});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  // The blocked attention as called (fp32 in training; bf16 tensors: bf16 block GEMMs) and SDPA's causal kernel.
  auto blocked = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return qlora::modules::blocked_causal_attention(a, b, c, scale, block);
  };
  auto sdpa_causal = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return at::scaled_dot_product_attention(a, b, c, {}, 0.0, /*is_causal=*/true, scale);
  };
  const double ours = fwd_bwd_s(blocked, q, k, v, go, reps), sdpa = fwd_bwd_s(sdpa_causal, q, k, v, go, reps);
  const at::Tensor qb = q.to(at::kBFloat16), kb = k.to(at::kBFloat16), vb = v.to(at::kBFloat16), gob = go.to(at::kBFloat16);
  const double ours_bf16 = fwd_bwd_s([&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return qlora::modules::causal_attention(a, b, c, qlora::modules::AttentionOptions{scale});
  }, qb, kb, vb, gob, reps);
  const double gemms_bf16 = fwd_bwd_s(blocked, qb, kb, vb, gob, reps);
  const double sdpa_bf16 = fwd_bwd_s(sdpa_causal, qb, kb, vb, gob, reps);
  // Packed rows: 4 samples of seq / 4 tokens, each attending causally within itself (the mask
  // masked_attention gets in training with data.packing), against SDPA under the same mask.
  at::Tensor packed = at::zeros({1, seq, seq}, at::kBool);
  for (int64_t a = 0, n = std::max<int64_t>(1, seq / 4); a < seq; a += n)
    packed[0].narrow(0, a, std::min(n, seq - a)).narrow(1, a, std::min(n, seq - a)).fill_(true);
  packed.logical_and_(at::ones({seq, seq}, at::kBool).tril());
  auto packed_ms = [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv, const at::Tensor& g) {
    const double ours_p = fwd_bwd_s([&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
      return qlora::modules::masked_attention(a, b, c, packed, qlora::modules::AttentionOptions{scale});
    }, qq, kk, vv, g, reps);
    const double sdpa_p = fwd_bwd_s([&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
      return at::scaled_dot_product_attention(a, b, c, packed.unsqueeze(1), 0.0, false, scale);
    }, qq, kk, vv, g, reps);
    return json{{"samples", 4}, {"qlora_fwd_bwd_ms", ours_p * 1e3}, {"sdpa_fwd_bwd_ms", sdpa_p * 1e3},
                {"sdpa_over_qlora", sdpa_p / ours_p}};
  };
  const json packed_fp32 = packed_ms(q, k, v, go), packed_bf16 = packed_ms(qb, kb, vb, gob);
  const double flops = block_gemm_flops(heads, seq, dim, block), rate = sgemm_flop_rate(std::max(3, reps / 4));
  const double floor = flops / rate;  // the products at the rate of a large GEMM
  json j = {{"bench", "attention"},
            {"machine", {{"cpu", qlora::bench::cpu_model()}, {"threads", at::get_num_threads()},
                         {"isa", qlora::kernels::isa_name(qlora::kernels::active_isa())}}},
            {"shape", {{"batch", 1}, {"heads", heads}, {"head_dim", dim}, {"seq", seq}, {"block", block}}},
            {"qlora_fwd_bwd_ms", ours * 1e3}, {"sdpa_fwd_bwd_ms", sdpa * 1e3}, {"block_gemm_gflop", flops / 1e9},
            {"sgemm_2048_gflop_s", rate / 1e9}, {"gemm_floor_ms", floor * 1e3},
            {"qlora_over_floor", ours / floor}, {"sdpa_over_qlora", sdpa / ours}, {"packed", packed_fp32},
            {"bf16", {{"qlora_fwd_bwd_ms", ours_bf16 * 1e3}, {"blocked_bf16_gemms_fwd_bwd_ms", gemms_bf16 * 1e3},
                      {"sdpa_fwd_bwd_ms", sdpa_bf16 * 1e3},
                      {"sdpa_over_qlora", sdpa_bf16 / ours_bf16}, {"packed", packed_bf16}}}};
  std::cout << j.dump(2) << "\n";
}
