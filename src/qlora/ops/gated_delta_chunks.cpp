#include "qlora/ops/gated_delta_chunks.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace qlora::ops::gated_delta {

namespace {

// Chunks per block: each pass works on this many chunks at once (batched matmuls over heads and
// chunks), so its transient [C, C] and [C, d] terms are bounded by the block, not the sequence.
constexpr int64_t kBlockChunks = 4;

// What each chunk computes from its own tokens alone (the header's notation), for all chunks at once.
struct Terms {
  at::Tensor decay;        // exp(gam)            [BH, N, C, 1]
  at::Tensor to_end;       // exp(gam_C - gam)    [BH, N, C, 1]
  at::Tensor chunk_decay;  // exp(gam_C)          [BH, N, 1, 1]
  at::Tensor e;            // E                   [BH, N, C, C], 0 above the diagonal
  at::Tensor kkt, qkt;     // (beta*K) K^T, Q K^T [BH, N, C, C]
  at::Tensor t;            // (I + A)^-1          [BH, N, C, C], unit lower triangular
  at::Tensor u, w;         // T (beta*V), T (beta*exp(gam)*K): [BH, N, C, dv], [BH, N, C, dk]
  at::Tensor qg, kd;       // exp(gam)*Q, exp(gam_C - gam)*K
};

// exp(x) with the results below 2^-115 (x < -80) flushed to 0: left alone they are fp32 denormals
// (below 2^-126 near x = -87) in E and the decays, whose products run ~3x slower on x86 without
// changing any result by more than 2^-115 of the terms they are added to.
at::Tensor decay_exp(const at::Tensor& x) {
  return x.masked_fill(x < -80.0, -std::numeric_limits<float>::infinity()).exp();
}

// E[t, s] = exp(gam_t - gam_s) for s <= t. The entries above the diagonal are masked before exp:
// there gam_t - gam_s >= 0 may overflow, and inf * 0 would poison the products.
at::Tensor pairwise_decay(const at::Tensor& gam) {
  const int64_t c = gam.size(-1);
  const at::Tensor above = at::ones({c, c}, gam.options().dtype(at::kBool)).triu(1);
  return decay_exp((gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill(above, -std::numeric_limits<float>::infinity()));
}

// (I + a)^-1 for strictly lower triangular a [..., n, n], by forward substitution row by row on
// blocks of 8 and, above that, by halves: [[T11, 0], [-T22 a21 T11, T22]]. Stable as substitution
// is (no power series), and ~80x faster here than ATen's batched linalg_solve_triangular, which
// calls one small LAPACK solve per matrix.
at::Tensor unit_lower_inverse(const at::Tensor& a) {
  const int64_t n = a.size(-1);
  if (n <= 8) {
    at::Tensor t = at::eye(n, a.options()).expand_as(a).contiguous();
    for (int64_t i = 1; i < n; ++i)  // row i: -a[i, :i] T[:i, :i]
      t.select(-2, i).narrow(-1, 0, i).copy_(
          -at::matmul(a.select(-2, i).narrow(-1, 0, i).unsqueeze(-2), t.narrow(-2, 0, i).narrow(-1, 0, i)).squeeze(-2));
    return t;
  }
  const int64_t h = n / 2, r = n - h;
  const at::Tensor a11 = a.narrow(-2, 0, h).narrow(-1, 0, h), a22 = a.narrow(-2, h, r).narrow(-1, h, r);
  at::Tensor t11, t22;
  if (h == r) {  // both halves in one call: 7 substitution steps over all blocks of 8, not 7 per block
    const at::Tensor both = unit_lower_inverse(at::stack({a11, a22}));
    t11 = both[0], t22 = both[1];
  } else {
    t11 = unit_lower_inverse(a11), t22 = unit_lower_inverse(a22);
  }
  const at::Tensor t21 = -at::matmul(at::matmul(t22, a.narrow(-2, h, r).narrow(-1, 0, h)), t11);
  return at::cat({at::cat({t11, at::zeros_like(t21.transpose(-1, -2))}, -1), at::cat({t21, t22}, -1)}, -2);
}

Terms chunk_terms(const Chunks& x) {
  Terms tm;
  const at::Tensor gam = x.g.cumsum(-1);  // [BH, N, C]
  const at::Tensor gam_end = gam.narrow(-1, gam.size(-1) - 1, 1);
  tm.decay = decay_exp(gam).unsqueeze(-1);
  tm.to_end = decay_exp(gam_end - gam).unsqueeze(-1);
  tm.chunk_decay = decay_exp(gam_end).unsqueeze(-1);
  tm.e = pairwise_decay(gam);
  const at::Tensor beta = x.beta.unsqueeze(-1);  // [BH, N, C, 1]
  const at::Tensor kt = x.k.transpose(-1, -2);
  tm.kkt = at::matmul(x.k * beta, kt);
  tm.qkt = at::matmul(x.q, kt);
  tm.t = unit_lower_inverse((tm.kkt * tm.e).tril(-1));
  tm.u = at::matmul(tm.t, x.v * beta);
  tm.w = at::matmul(tm.t, x.k * (beta * tm.decay));
  tm.qg = x.q * tm.decay;
  tm.kd = x.k * tm.to_end;
  return tm;
}

// The chunk's output from its entering states and its Delta, all chunks at once.
at::Tensor chunk_outputs(const Terms& tm, const at::Tensor& starts, const at::Tensor& delta) {
  return at::matmul(tm.qg, starts) + at::matmul(tm.qkt * tm.e, delta);
}

// sum over s >= t of x[..., s], along the last dim.
at::Tensor reverse_cumsum(const at::Tensor& x) {
  return x.sum(-1, /*keepdim=*/true) - x.cumsum(-1) + x;
}

at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b) {
  return (a * b).sum(-1);
}

}  // namespace

namespace {

// The chunks [first, first + count) of x: what one block of the passes below works on.
Chunks slice(const Chunks& x, int64_t first, int64_t count) {
  return {x.q.narrow(1, first, count), x.k.narrow(1, first, count), x.v.narrow(1, first, count),
          x.g.narrow(1, first, count), x.beta.narrow(1, first, count)};
}

// One block's share of the forward scan: writes its starts and returns its outputs and leaving state.
at::Tensor forward_block(const Chunks& xb, at::Tensor& s, at::Tensor starts) {
  const Terms tm = chunk_terms(xb);
  at::Tensor delta = at::empty_like(xb.v);  // [BH, n, C, dv]
  // The only sequential part: Delta = U - W S, then S <- exp(gam_C) S + Kd^T Delta.
  for (int64_t i = 0; i < xb.v.size(1); ++i) {
    starts.select(1, i).copy_(s);
    const at::Tensor d = at::baddbmm(tm.u.select(1, i), tm.w.select(1, i), s, 1.0, -1.0);  // [BH, C, dv]
    delta.select(1, i).copy_(d);
    s = at::baddbmm(s * tm.chunk_decay.select(1, i), tm.kd.select(1, i).transpose(1, 2), d);
  }
  return chunk_outputs(tm, starts, delta);
}

}  // namespace

Forward chunked_forward(const Chunks& x, const at::Tensor& state0) {
  const int64_t bh = x.k.size(0), n = x.k.size(1), dk = x.k.size(3), dv = x.v.size(3);
  at::Tensor s = state0.defined() ? state0.to(at::kFloat).clone() : at::zeros({bh, dk, dv}, x.v.options());
  Forward f{at::empty_like(x.v), at::empty({bh, n, dk, dv}, x.v.options()), at::Tensor()};
  for (int64_t first = 0; first < n; first += kBlockChunks) {
    const int64_t count = std::min(kBlockChunks, n - first);
    f.out.narrow(1, first, count).copy_(forward_block(slice(x, first, count), s, f.starts.narrow(1, first, count)));
  }
  f.final = s;
  return f;
}

namespace {

// The gradients of Delta and of the state leaving each chunk, running backwards through the chunks:
// dDelta = P^T dO + Kd dS_end;  dS_start = exp(gam_C) dS_end + Qg^T dO - W^T dDelta. What needs
// dS_end itself (Kd's gradient Delta dS_end^T and <S_start, dS_end>) is taken in the same pass, so
// no state-sized tensor per chunk is kept beyond the saved starts.
struct StateGrads {
  at::Tensor d_delta;  // [BH, N, C, dv]
  at::Tensor dkd;      // [BH, N, C, dk]
  at::Tensor carried;  // <S_start, dS_end> [BH, N]
  at::Tensor d_state0;
};

StateGrads backward_scan(const Terms& tm, const at::Tensor& starts, const at::Tensor& delta, const at::Tensor& d_out,
                         at::Tensor ds) {
  const at::Tensor from_out = at::matmul((tm.qkt * tm.e).transpose(-1, -2), d_out);  // P^T dO   [BH, N, C, dv]
  const int64_t bh = d_out.size(0), n = d_out.size(1);
  StateGrads sg;
  sg.d_delta = at::empty_like(d_out);
  sg.dkd = at::empty_like(tm.kd);
  sg.carried = at::empty({bh, n}, d_out.options());
  for (int64_t i = n - 1; i >= 0; --i) {
    sg.dkd.select(1, i).copy_(at::bmm(delta.select(1, i), ds.transpose(1, 2)));
    sg.carried.select(1, i).copy_((starts.select(1, i) * ds).sum({1, 2}));
    const at::Tensor dd = at::baddbmm(from_out.select(1, i), tm.kd.select(1, i), ds);
    sg.d_delta.select(1, i).copy_(dd);
    const at::Tensor read = at::bmm(tm.qg.select(1, i).transpose(1, 2), d_out.select(1, i));  // Qg^T dO
    ds = at::baddbmm(ds * tm.chunk_decay.select(1, i) + read, tm.w.select(1, i).transpose(1, 2), dd, 1.0, -1.0);
  }
  sg.d_state0 = ds;
  return sg;
}

// Through U = T X_u and W = T X_w with T = (I + A)^-1: dX = T^T dY and dA = -strict_lower(sum dX Y^T).
struct SolveGrads {
  at::Tensor dxu, dxw, da;
};

SolveGrads solve_grads(const Terms& tm, const at::Tensor& du, const at::Tensor& dw) {
  const at::Tensor tt = tm.t.transpose(-1, -2);
  SolveGrads sv;
  sv.dxu = at::matmul(tt, du);
  sv.dxw = at::matmul(tt, dw);
  sv.da = -(at::matmul(sv.dxu, tm.u.transpose(-1, -2)) + at::matmul(sv.dxw, tm.w.transpose(-1, -2))).tril(-1);
  return sv;
}

// The gradient of gam from everything that reads it: E (through A and P), exp(gam) (Qg, X_w),
// exp(gam_C - gam) (Kd) and exp(gam_C) (the carried state).
at::Tensor gam_grad(const Chunks& x, const Terms& tm, const at::Tensor& da, const at::Tensor& dp, const at::Tensor& dqg,
                    const at::Tensor& dkd, const at::Tensor& dxw, const at::Tensor& carried) {
  const at::Tensor ge = (da * tm.kkt + dp * tm.qkt) * tm.e;  // dL/dE .* E: dE[t,s] feeds gam_t (+) and gam_s (-)
  const at::Tensor decay = tm.decay.squeeze(-1);
  const at::Tensor to_end = tm.to_end.squeeze(-1) * row_dot(dkd, x.k);  // [BH, N, C]
  at::Tensor dgam = ge.sum(-1) - ge.sum(-2) + decay * (row_dot(dqg, x.q) + x.beta * row_dot(dxw, x.k)) - to_end;
  const int64_t last = dgam.size(-1) - 1;
  dgam.select(-1, last).add_(to_end.sum(-1) + tm.chunk_decay.squeeze(-1).squeeze(-1) * carried);
  return dgam;
}

// One block's gradients, the block's state gradient ds carried in (the gradient of the state leaving
// its last chunk) and out (of the state entering its first).
Grads backward_block(const Chunks& x, const at::Tensor& starts, const at::Tensor& d_out, at::Tensor& ds) {
  const Terms tm = chunk_terms(x);
  const at::Tensor delta = tm.u - at::matmul(tm.w, starts);
  const StateGrads sg = backward_scan(tm, starts, delta, d_out, ds);
  ds = sg.d_state0;
  const at::Tensor starts_t = starts.transpose(-1, -2);  // [BH, n, dv, dk]
  const at::Tensor dqg = at::matmul(d_out, starts_t);                 // [BH, n, C, dk]
  const at::Tensor dp = at::matmul(d_out, delta.transpose(-1, -2));  // [BH, n, C, C]
  const at::Tensor& dkd = sg.dkd;
  const SolveGrads sv = solve_grads(tm, sg.d_delta, -at::matmul(sg.d_delta, starts_t));
  const at::Tensor db = sv.da * tm.e, dpe = dp * tm.e;  // through kkt and qkt
  const at::Tensor beta = x.beta.unsqueeze(-1);
  const at::Tensor dkb = at::matmul(db, x.k);  // d(beta*K)
  Grads gr;
  gr.q = at::matmul(dpe, x.k) + tm.decay * dqg;
  gr.k = at::matmul(db.transpose(-1, -2), x.k * beta) + at::matmul(dpe.transpose(-1, -2), x.q) + beta * dkb +
         tm.to_end * dkd + (beta * tm.decay) * sv.dxw;
  gr.v = beta * sv.dxu;
  gr.beta = row_dot(dkb, x.k) + row_dot(sv.dxu, x.v) + tm.decay.squeeze(-1) * row_dot(sv.dxw, x.k);
  gr.g = reverse_cumsum(gam_grad(x, tm, sv.da, dp, dqg, dkd, sv.dxw, sg.carried));
  return gr;
}

}  // namespace

Grads chunked_backward(const Chunks& x, const at::Tensor& starts, const at::Tensor& d_out, const at::Tensor& d_final) {
  const int64_t bh = x.k.size(0), n = x.k.size(1), dk = x.k.size(3), dv = x.v.size(3);
  Grads gr{at::empty_like(x.q), at::empty_like(x.k), at::empty_like(x.v), at::empty_like(x.g), at::empty_like(x.beta),
           at::Tensor()};
  at::Tensor ds = d_final.defined() ? d_final.to(at::kFloat).clone() : at::zeros({bh, dk, dv}, x.v.options());
  for (int64_t end = n; end > 0; end -= kBlockChunks) {
    const int64_t first = std::max<int64_t>(0, end - kBlockChunks), count = end - first;
    const Grads b = backward_block(slice(x, first, count), starts.narrow(1, first, count),
                                   d_out.narrow(1, first, count), ds);
    using Pair = std::pair<at::Tensor, at::Tensor>;
    for (const auto& [all, part] : {Pair{gr.q, b.q}, Pair{gr.k, b.k}, Pair{gr.v, b.v}, Pair{gr.g, b.g}, Pair{gr.beta, b.beta}})
      all.narrow(1, first, count).copy_(part);
  }
  gr.state0 = ds;
  return gr;
}

}  // namespace qlora::ops::gated_delta
