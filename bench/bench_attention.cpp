// Causal attention for training on the CPU (modules/blocked_attention.h), forward + backward,
// against ATen's scaled_dot_product_attention (its CPU flash kernel) and against the floor of its
// own GEMMs: the same block products (q k^T, p v forward; dO v^T, p^T dO, dS k, dS^T q backward)
// timed alone. Shape of the 100M bench model by default: 12 heads, head_dim 64, seq 512, batch 1.
// Prints one JSON object.
//
//   build/bench_attention [--heads H] [--dim D] [--seq S] [--block B] [--reps N]
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
#include "qlora/modules/blocked_attention.h"

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

// The six block products alone (no softmax, no masking), each head's on one thread, with the
// blocked kernel's buffers: the probabilities kept per query block, the scores' gradient a
// temporary per block.
double gemm_floor_s(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t block, int reps) {
  const int64_t bh = q.size(0) * q.size(1), seq = q.size(2), d = q.size(3);
  const at::Tensor qf = q.reshape({bh, seq, d}), kf = k.reshape({bh, seq, d}), vf = v.reshape({bh, seq, d});
  at::Tensor gq = at::empty_like(qf), gk = at::zeros_like(kf), gv = at::zeros_like(vf), o = at::empty_like(qf);
  std::vector<at::Tensor> p;  // per query block [bh, n, keys]
  for (int64_t i0 = 0; i0 < seq; i0 += block)
    p.push_back(at::empty({bh, std::min(block, seq - i0), std::min(i0 + block, seq)}));
  return median_s([&] {
    at::parallel_for(0, bh, 1, [&](int64_t h0, int64_t h1) {
      auto H = [&](const at::Tensor& t) { return t.narrow(0, h0, h1 - h0); };
      for (int64_t i0 = 0; i0 < seq; i0 += block) {
        const int64_t n = std::min(block, seq - i0), keys = i0 + n;
        const at::Tensor qb = H(qf).narrow(1, i0, n), kb = H(kf).narrow(1, 0, keys), vb = H(vf).narrow(1, 0, keys);
        at::Tensor pb = H(p[i0 / block]), ob = H(o).narrow(1, i0, n), gqb = H(gq).narrow(1, i0, n);
        at::bmm_out(pb, qb, kb.transpose(1, 2));
        at::bmm_out(ob, pb, vb);
        const at::Tensor dsb = at::bmm(ob, vb.transpose(1, 2));
        H(gv).narrow(1, 0, keys).baddbmm_(pb.transpose(1, 2), ob);
        at::bmm_out(gqb, dsb, kb);
        H(gk).narrow(1, 0, keys).baddbmm_(dsb.transpose(1, 2), qb);
      }
    });
  }, reps);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t heads = 12, dim = 64, seq = 512, block = 64;
  int reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string s = argv[i];
    if (s == "--heads") heads = std::stoll(argv[i + 1]);
    else if (s == "--dim") dim = std::stoll(argv[i + 1]);
    else if (s == "--seq") seq = std::stoll(argv[i + 1]);
    else if (s == "--block") block = std::stoll(argv[i + 1]);
    else if (s == "--reps") reps = std::stoi(argv[i + 1]);
    else {
      std::cerr << "usage: bench_attention [--heads H] [--dim D] [--seq S] [--block B] [--reps N]\n";
      return 2;
    }
  }
  at::manual_seed(0);
  const at::Tensor q = at::randn({1, heads, seq, dim}), k = at::randn({1, heads, seq, dim});
  const at::Tensor v = at::randn({1, heads, seq, dim}), go = at::randn({1, heads, seq, dim});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const double ours = fwd_bwd_s([&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return qlora::modules::blocked_causal_attention(a, b, c, scale, block);
  }, q, k, v, go, reps);
  const double sdpa = fwd_bwd_s([&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return at::scaled_dot_product_attention(a, b, c, {}, 0.0, /*is_causal=*/true, scale);
  }, q, k, v, go, reps);
  const double floor = gemm_floor_s(q, k, v, block, reps);
  json j = {{"bench", "attention"},
            {"machine", {{"cpu", qlora::bench::cpu_model()}, {"threads", at::get_num_threads()}}},
            {"shape", {{"batch", 1}, {"heads", heads}, {"head_dim", dim}, {"seq", seq}, {"block", block}}},
            {"qlora_fwd_bwd_ms", ours * 1e3}, {"sdpa_fwd_bwd_ms", sdpa * 1e3}, {"gemm_floor_ms", floor * 1e3},
            {"qlora_over_floor", ours / floor}, {"sdpa_over_qlora", sdpa / ours}};
  std::cout << j.dump(2) << "\n";
}
