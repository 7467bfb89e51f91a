#include "qlora/ops/gated_delta_chunks.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

namespace qlora::ops::gated_delta {

namespace {

// Chunks per block: each pass works on this many chunks at once (batched matmuls over heads and
// chunks), so its transient [C, C] and [C, d] terms are bounded by the block, not the sequence.
constexpr int64_t kBlockChunks = 4;

// What each chunk computes from its own tokens alone (the header's notation), for all chunks at once:
// the per-token decays and decayed q and k, cheap enough to recompute in backward, and the chunk's
// matrices (Local), which the forward saves.
struct Terms {
  at::Tensor decay;        // exp(gam)            [N, BH, C, 1]
  at::Tensor to_end;       // exp(gam_C - gam)    [N, BH, C, 1]
  at::Tensor chunk_decay;  // exp(gam_C)          [N, BH, 1, 1]
  at::Tensor qg, kd;       // exp(gam)*Q, exp(gam_C - gam)*K
  at::Tensor u, w;         // T (beta*V), T (beta*exp(gam)*K): [N, BH, C, dv], [N, BH, C, dk]
  Local m;
};

// a @ b over matching leading dims, as one bmm on views: at::matmul reshapes a transposed operand
// with a copy (ATen 2.11), while bmm reads either matrix order in place.
at::Tensor bmm4(const at::Tensor& a, const at::Tensor& b) {
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape.back() = b.size(-1);
  return at::bmm(a.flatten(0, -3), b.flatten(0, -3)).view(shape);
}

// a^T @ b for a [..., C, C], with a^T made contiguous first: ATen's CPU bmm runs ~1.6x slower on a
// transposed left operand, and copying a C x C block costs far less than that.
at::Tensor bmm4_lt(const at::Tensor& a, const at::Tensor& b) {
  return bmm4(a.transpose(-1, -2).contiguous(), b);
}

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
          -bmm4(a.select(-2, i).narrow(-1, 0, i).unsqueeze(-2), t.narrow(-2, 0, i).narrow(-1, 0, i)).squeeze(-2));
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
  const at::Tensor t21 = -bmm4(bmm4(t22, a.narrow(-2, h, r).narrow(-1, 0, h)), t11);
  return at::cat({at::cat({t11, at::zeros_like(t21.transpose(-1, -2))}, -1), at::cat({t21, t22}, -1)}, -2);
}

// The terms, with the chunk's matrices taken from saved (backward) or, when it is null, computed
// (forward).
Terms chunk_terms(const Chunks& x, const Local* saved) {
  Terms tm;
  const at::Tensor gam = x.g.cumsum(-1);  // [N, BH, C]
  const at::Tensor gam_end = gam.narrow(-1, gam.size(-1) - 1, 1);
  tm.decay = decay_exp(gam).unsqueeze(-1);
  tm.to_end = decay_exp(gam_end - gam).unsqueeze(-1);
  tm.chunk_decay = decay_exp(gam_end).unsqueeze(-1);
  tm.qg = x.q * tm.decay;
  tm.kd = x.k * tm.to_end;
  const at::Tensor beta = x.beta.unsqueeze(-1);  // [N, BH, C, 1]
  Local& m = tm.m;
  if (saved) {
    m = *saved;
  } else {
    m.e = pairwise_decay(gam);
    const at::Tensor kt = x.k.transpose(-1, -2);
    m.ae = bmm4(x.k * beta, kt).mul_(m.e);
    m.p = bmm4(x.q, kt).mul_(m.e);
    m.t = unit_lower_inverse(m.ae.tril(-1));
  }
  // Recomputed rather than saved: two [C, C] x [C, d] products per chunk cost less than keeping
  // two more [C, d] tensors per chunk between forward and backward.
  tm.u = bmm4(m.t, x.v * beta);
  tm.w = bmm4(m.t, x.k * (beta * tm.decay));
  return tm;
}

// The chunk's output from its entering states and its Delta, all chunks at once.
at::Tensor chunk_outputs(const Terms& tm, const at::Tensor& starts, const at::Tensor& delta) {
  return at::baddbmm(bmm4(tm.qg, starts).flatten(0, 1), tm.m.p.flatten(0, 1), delta.flatten(0, 1)).view_as(delta);
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
  return {x.q.narrow(0, first, count), x.k.narrow(0, first, count), x.v.narrow(0, first, count),
          x.g.narrow(0, first, count), x.beta.narrow(0, first, count)};
}

Saved slice(const Saved& x, int64_t first, int64_t count) {
  const auto part = [&](const at::Tensor& t) { return t.narrow(0, first, count); };
  const Local& m = x.local;
  return {part(x.starts), part(x.delta), {part(m.e), part(m.ae), part(m.p), part(m.t)}};
}

// One block's share of the forward scan: writes its saved tensors and returns its outputs and
// leaving state.
at::Tensor forward_block(const Chunks& xb, at::Tensor& s, const Saved& saved) {
  const Terms tm = chunk_terms(xb, nullptr);
  const Local &m = tm.m, &keep = saved.local;
  for (const auto& [to, from] : {std::pair{keep.e, m.e}, {keep.ae, m.ae}, {keep.p, m.p}, {keep.t, m.t}})
    to.copy_(from);
  const at::Tensor &starts = saved.starts, &delta = saved.delta;
  // The only sequential part: Delta = U - W S, then S <- exp(gam_C) S + Kd^T Delta.
  for (int64_t i = 0; i < xb.v.size(0); ++i) {
    starts.select(0, i).copy_(s);
    at::Tensor d = delta.select(0, i);  // [BH, C, dv]
    at::baddbmm_out(d, tm.u.select(0, i), tm.w.select(0, i), s, 1.0, -1.0);
    s.mul_(tm.chunk_decay.select(0, i)).baddbmm_(tm.kd.select(0, i).transpose(1, 2), d);
  }
  return chunk_outputs(tm, starts, delta);
}

}  // namespace

Forward chunked_forward(const Chunks& x, const at::Tensor& state0) {
  const int64_t n = x.k.size(0), bh = x.k.size(1), dk = x.k.size(3), dv = x.v.size(3);
  at::Tensor s = state0.defined() ? state0.to(at::kFloat).clone() : at::zeros({bh, dk, dv}, x.v.options());
  const int64_t c = x.k.size(2);
  const auto square = [&] { return at::empty({n, bh, c, c}, x.v.options()); };
  Forward f{at::empty_like(x.v),
            {at::empty({n, bh, dk, dv}, x.v.options()), at::empty_like(x.v),
             {square(), square(), square(), square()}},
            at::Tensor()};
  for (int64_t first = 0; first < n; first += kBlockChunks) {
    const int64_t count = std::min(kBlockChunks, n - first);
    f.out.narrow(0, first, count).copy_(forward_block(slice(x, first, count), s, slice(f.saved, first, count)));
  }
  f.final = s;
  return f;
}

namespace {

// The gradients of Delta and of the state leaving each chunk, running backwards through the chunks:
// dDelta = P^T dO + Kd dS_end;  dS_start = exp(gam_C) dS_end + Qg^T dO - W^T dDelta. Only those two
// products run chunk by chunk; Qg^T dO before the pass and what reads dS_end (Kd's gradient
// Delta dS_end^T and <S_start, dS_end>) after it are batched over the block's chunks.
struct StateGrads {
  at::Tensor d_delta;  // [N, BH, C, dv]
  at::Tensor dkd;      // [N, BH, C, dk]
  at::Tensor carried;  // <S_start, dS_end> [N, BH]
  at::Tensor d_state0;
};

StateGrads backward_scan(const Terms& tm, const at::Tensor& starts, const at::Tensor& delta, const at::Tensor& d_out,
                         at::Tensor ds) {
  const at::Tensor from_out = bmm4_lt(tm.m.p, d_out);  // P^T dO   [N, BH, C, dv]
  const int64_t n = d_out.size(0);
  StateGrads sg;
  sg.d_delta = at::empty_like(d_out);
  const at::Tensor read = bmm4_lt(tm.qg, d_out);      // Qg^T dO  [N, BH, dk, dv]
  const at::Tensor ends = at::empty_like(starts);     // dS_end of each chunk
  for (int64_t i = n - 1; i >= 0; --i) {  // only what needs the previous dS_end runs in order
    ends.select(0, i).copy_(ds);
    at::Tensor dd = sg.d_delta.select(0, i);
    at::baddbmm_out(dd, from_out.select(0, i), tm.kd.select(0, i), ds);
    ds.mul_(tm.chunk_decay.select(0, i)).add_(read.select(0, i)).baddbmm_(tm.w.select(0, i).transpose(1, 2), dd, 1.0, -1.0);
  }
  sg.dkd = bmm4(delta, ends.transpose(-1, -2));
  sg.carried = (starts * ends).sum({-2, -1});
  sg.d_state0 = ds;
  return sg;
}

// Through U = T X_u and W = T X_w with T = (I + A)^-1: dX = T^T dY and dA = -strict_lower(sum dX Y^T).
struct SolveGrads {
  at::Tensor dxu, dxw, da;
};

SolveGrads solve_grads(const Terms& tm, const at::Tensor& du, const at::Tensor& dw) {
  const at::Tensor tt = tm.m.t.transpose(-1, -2).contiguous();  // see bmm4_lt
  SolveGrads sv;
  sv.dxu = bmm4(tt, du);
  sv.dxw = bmm4(tt, dw);
  sv.da = -at::baddbmm(bmm4(sv.dxu, tm.u.transpose(-1, -2)).flatten(0, 1), sv.dxw.flatten(0, 1),
                       tm.w.transpose(-1, -2).flatten(0, 1))
               .view_as(tm.m.t)
               .tril(-1);
  return sv;
}

// The gradient of gam from everything that reads it: E (through A and P), exp(gam) (Qg, X_w),
// exp(gam_C - gam) (Kd) and exp(gam_C) (the carried state).
at::Tensor gam_grad(const Chunks& x, const Terms& tm, const at::Tensor& da, const at::Tensor& dp, const at::Tensor& dqg,
                    const at::Tensor& dkd, const at::Tensor& dxw, const at::Tensor& carried) {
  const at::Tensor ge = da * tm.m.ae + dp * tm.m.p;  // dL/dE .* E: dE[t,s] feeds gam_t (+) and gam_s (-)
  const at::Tensor decay = tm.decay.squeeze(-1);
  const at::Tensor to_end = tm.to_end.squeeze(-1) * row_dot(dkd, x.k);  // [N, BH, C]
  at::Tensor dgam = ge.sum(-1) - ge.sum(-2) + decay * (row_dot(dqg, x.q) + x.beta * row_dot(dxw, x.k)) - to_end;
  const int64_t last = dgam.size(-1) - 1;
  dgam.select(-1, last).add_(to_end.sum(-1) + tm.chunk_decay.squeeze(-1).squeeze(-1) * carried);
  return dgam;
}

// One block's gradients, the block's state gradient ds carried in (the gradient of the state leaving
// its last chunk) and out (of the state entering its first).
Grads backward_block(const Chunks& x, const Saved& saved, const at::Tensor& d_out, at::Tensor& ds) {
  const Terms tm = chunk_terms(x, &saved.local);
  const at::Tensor &starts = saved.starts, &delta = saved.delta;
  const StateGrads sg = backward_scan(tm, starts, delta, d_out, ds);
  ds = sg.d_state0;
  const at::Tensor starts_t = starts.transpose(-1, -2);  // [n, BH, dv, dk]
  const at::Tensor dqg = bmm4(d_out, starts_t);                 // [n, BH, C, dk]
  const at::Tensor dp = bmm4(d_out, delta.transpose(-1, -2));  // [n, BH, C, C]
  const at::Tensor& dkd = sg.dkd;
  const SolveGrads sv = solve_grads(tm, sg.d_delta, -bmm4(sg.d_delta, starts_t));
  const at::Tensor db = sv.da * tm.m.e, dpe = dp * tm.m.e;  // through (beta*K) K^T and Q K^T
  const at::Tensor beta = x.beta.unsqueeze(-1);
  const at::Tensor dkb = bmm4(db, x.k);  // d(beta*K)
  Grads gr;
  gr.q = bmm4(dpe, x.k) + tm.decay * dqg;
  gr.k = bmm4_lt(db, x.k * beta) + bmm4_lt(dpe, x.q) + beta * dkb +
         tm.to_end * dkd + (beta * tm.decay) * sv.dxw;
  gr.v = beta * sv.dxu;
  gr.beta = row_dot(dkb, x.k) + row_dot(sv.dxu, x.v) + tm.decay.squeeze(-1) * row_dot(sv.dxw, x.k);
  gr.g = reverse_cumsum(gam_grad(x, tm, sv.da, dp, dqg, dkd, sv.dxw, sg.carried));
  return gr;
}

}  // namespace

Grads chunked_backward(const Chunks& x, const Saved& saved, const at::Tensor& d_out, const at::Tensor& d_final) {
  const int64_t n = x.k.size(0), bh = x.k.size(1), dk = x.k.size(3), dv = x.v.size(3);
  Grads gr{at::empty_like(x.q), at::empty_like(x.k), at::empty_like(x.v), at::empty_like(x.g), at::empty_like(x.beta),
           at::Tensor()};
  at::Tensor ds = d_final.defined() ? d_final.to(at::kFloat).clone() : at::zeros({bh, dk, dv}, x.v.options());
  for (int64_t end = n; end > 0; end -= kBlockChunks) {
    const int64_t first = std::max<int64_t>(0, end - kBlockChunks), count = end - first;
    const Grads b = backward_block(slice(x, first, count), slice(saved, first, count), d_out.narrow(0, first, count), ds);
    using Pair = std::pair<at::Tensor, at::Tensor>;
    for (const auto& [all, part] : {Pair{gr.q, b.q}, Pair{gr.k, b.k}, Pair{gr.v, b.v}, Pair{gr.g, b.g}, Pair{gr.beta, b.beta}})
      all.narrow(0, first, count).copy_(part);
  }
  gr.state0 = ds;
  return gr;
}

}  // namespace qlora::ops::gated_delta
