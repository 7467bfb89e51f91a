#include "qlora/ops/gated_delta_chunks.h"

#include <ATen/ATen.h>

#include <limits>

namespace qlora::ops::gated_delta {

namespace {

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

// E[t, s] = exp(gam_t - gam_s) for s <= t. The entries above the diagonal are masked before exp:
// there gam_t - gam_s >= 0 may overflow, and inf * 0 would poison the products.
at::Tensor pairwise_decay(const at::Tensor& gam) {
  const int64_t c = gam.size(-1);
  const at::Tensor above = at::ones({c, c}, gam.options().dtype(at::kBool)).triu(1);
  return (gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill(above, -std::numeric_limits<float>::infinity()).exp();
}

Terms chunk_terms(const Chunks& x) {
  Terms tm;
  const at::Tensor gam = x.g.cumsum(-1);  // [BH, N, C]
  const at::Tensor gam_end = gam.narrow(-1, gam.size(-1) - 1, 1);
  tm.decay = gam.exp().unsqueeze(-1);
  tm.to_end = (gam_end - gam).exp().unsqueeze(-1);
  tm.chunk_decay = gam_end.exp().unsqueeze(-1);
  tm.e = pairwise_decay(gam);
  const at::Tensor beta = x.beta.unsqueeze(-1);  // [BH, N, C, 1]
  const at::Tensor kt = x.k.transpose(-1, -2);
  tm.kkt = at::matmul(x.k * beta, kt);
  tm.qkt = at::matmul(x.q, kt);
  // unitriangular: the solver reads only the strict lower triangle, which is A.
  const at::Tensor a = (tm.kkt * tm.e).tril(-1);
  const at::Tensor eye = at::eye(a.size(-1), a.options()).expand_as(a);
  tm.t = at::linalg_solve_triangular(a, eye, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
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

Forward chunked_forward(const Chunks& x, const at::Tensor& state0) {
  const Terms tm = chunk_terms(x);
  const int64_t bh = x.k.size(0), n = x.k.size(1), dk = x.k.size(3), dv = x.v.size(3);
  at::Tensor s = state0.defined() ? state0.to(at::kFloat).clone() : at::zeros({bh, dk, dv}, x.v.options());
  at::Tensor starts = at::empty({bh, n, dk, dv}, x.v.options());
  at::Tensor delta = at::empty_like(x.v);  // [BH, N, C, dv]
  // The only sequential part: Delta = U - W S, then S <- exp(gam_C) S + Kd^T Delta.
  for (int64_t i = 0; i < n; ++i) {
    starts.select(1, i).copy_(s);
    const at::Tensor d = at::baddbmm(tm.u.select(1, i), tm.w.select(1, i), s, 1.0, -1.0);  // [BH, C, dv]
    delta.select(1, i).copy_(d);
    s = at::baddbmm(s * tm.chunk_decay.select(1, i), tm.kd.select(1, i).transpose(1, 2), d);
  }
  return {chunk_outputs(tm, starts, delta), starts, s};
}

namespace {

// The gradients of Delta and of the state leaving each chunk, running backwards through the chunks:
// dDelta = P^T dO + Kd dS_end;  dS_start = exp(gam_C) dS_end + Qg^T dO - W^T dDelta.
struct StateGrads {
  at::Tensor d_delta;  // [BH, N, C, dv]
  at::Tensor d_ends;   // [BH, N, dk, dv]
  at::Tensor d_state0;
};

StateGrads backward_scan(const Terms& tm, const at::Tensor& d_out, const at::Tensor& d_final) {
  const at::Tensor from_out = at::matmul((tm.qkt * tm.e).transpose(-1, -2), d_out);  // P^T dO   [BH, N, C, dv]
  const at::Tensor read_out = at::matmul(tm.qg.transpose(-1, -2), d_out);           // Qg^T dO  [BH, N, dk, dv]
  const int64_t bh = d_out.size(0), n = d_out.size(1), dk = tm.kd.size(3), dv = d_out.size(3);
  StateGrads sg;
  sg.d_delta = at::empty_like(d_out);
  sg.d_ends = at::empty({bh, n, dk, dv}, d_out.options());
  at::Tensor ds = d_final.defined() ? d_final.to(at::kFloat).clone() : at::zeros({bh, dk, dv}, d_out.options());
  for (int64_t i = n - 1; i >= 0; --i) {
    sg.d_ends.select(1, i).copy_(ds);
    const at::Tensor dd = at::baddbmm(from_out.select(1, i), tm.kd.select(1, i), ds);
    sg.d_delta.select(1, i).copy_(dd);
    ds = at::baddbmm(ds * tm.chunk_decay.select(1, i) + read_out.select(1, i), tm.w.select(1, i).transpose(1, 2), dd,
                     1.0, -1.0);
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

}  // namespace

Grads chunked_backward(const Chunks& x, const at::Tensor& starts, const at::Tensor& d_out, const at::Tensor& d_final) {
  const Terms tm = chunk_terms(x);
  const at::Tensor delta = tm.u - at::matmul(tm.w, starts);
  const StateGrads sg = backward_scan(tm, d_out, d_final);
  const at::Tensor starts_t = starts.transpose(-1, -2);  // [BH, N, dv, dk]
  const at::Tensor dqg = at::matmul(d_out, starts_t);                      // [BH, N, C, dk]
  const at::Tensor dp = at::matmul(d_out, delta.transpose(-1, -2));       // [BH, N, C, C]
  const at::Tensor dkd = at::matmul(delta, sg.d_ends.transpose(-1, -2));  // [BH, N, C, dk]
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
  const at::Tensor carried = (starts * sg.d_ends).sum({-2, -1});  // <S_start, dS_end> per chunk
  gr.g = reverse_cumsum(gam_grad(x, tm, sv.da, dp, dqg, dkd, sv.dxw, carried));
  gr.state0 = sg.d_state0;
  return gr;
}

}  // namespace qlora::ops::gated_delta
