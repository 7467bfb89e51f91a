#include "qlora/ops/gated_delta_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "qlora/ops/gated_delta_chunks.h"

namespace qlora::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kL2Eps = 1e-6;  // transformers' l2norm (and fla's) default

struct Dims {
  int64_t batch, seq, k_heads, v_heads, dk, dv, chunks;
};

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("chunk_gated_delta_rule: " + what);
}

Dims check_dims(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                const at::Tensor& beta, const at::Tensor& state0) {
  if (q.dim() != 4 || v.dim() != 4 || q.sizes() != k.sizes())
    fail("q and k must be [batch, seq, k_heads, dk] and v [batch, seq, v_heads, dv], got q " + c10::str(q.sizes()) + ", k " +
         c10::str(k.sizes()) + ", v " + c10::str(v.sizes()));
  Dims d{q.size(0), q.size(1), q.size(2), v.size(2), q.size(3), v.size(3), 0};
  if (v.size(0) != d.batch || v.size(1) != d.seq) fail("v " + c10::str(v.sizes()) + " must share q's batch and seq");
  if (d.seq == 0 || d.k_heads == 0 || d.v_heads % d.k_heads != 0)
    fail("needs seq >= 1 and v_heads a multiple of k_heads, got q " + c10::str(q.sizes()) + ", v " + c10::str(v.sizes()));
  const std::vector<int64_t> per_token{d.batch, d.seq, d.v_heads};
  if (g.sizes() != per_token || beta.sizes() != per_token)
    fail("g and beta must be [batch, seq, v_heads], got g " + c10::str(g.sizes()) + ", beta " + c10::str(beta.sizes()));
  const std::vector<int64_t> state{d.batch, d.v_heads, d.dk, d.dv};
  if (state0.defined() && state0.numel() != 0 && state0.sizes() != state)
    fail("initial_state must be [batch, v_heads, dk, dv], got " + c10::str(state0.sizes()));
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
    if (!at::isFloatingType(t->scalar_type())) fail("q, k, v, g and beta must be floating point");
  d.chunks = (d.seq + kGatedDeltaChunk - 1) / kGatedDeltaChunk;
  return d;
}

// [batch, seq, heads, n] (any dtype) -> [chunks, batch*heads*rep, C, n] fp32, each head repeated
// rep times (consecutively), zero-padded at the end: one pass over the data.
at::Tensor to_chunks(const at::Tensor& t, const Dims& d, int64_t rep = 1) {
  constexpr int64_t c = kGatedDeltaChunk;
  const int64_t b = d.batch, heads = t.size(2), n = t.size(3), full = d.seq / c, tail = d.seq % c;
  at::Tensor out = at::empty({d.chunks, b, heads, rep, c, n}, t.options().dtype(at::kFloat));
  const at::Tensor to = out.permute({1, 0, 4, 2, 3, 5});                       // [b, chunks, C, heads, rep, n]
  const at::Tensor from = t.unsqueeze(3).expand({b, d.seq, heads, rep, n});  // [b, seq, heads, rep, n]
  if (full) to.narrow(1, 0, full).copy_(from.narrow(1, 0, full * c).view({b, full, c, heads, rep, n}));
  if (tail) {
    to.select(1, full).narrow(1, 0, tail).copy_(from.narrow(1, full * c, tail));
    to.select(1, full).narrow(1, tail, c - tail).zero_();
  }
  return out.view({d.chunks, b * heads * rep, c, n});
}

// The inverse of to_chunks (without the repeat), padding dropped: [chunks, batch*heads, C, n] ->
// [batch, seq, heads, n] in dtype, contiguous.
at::Tensor from_chunks(const at::Tensor& t, const Dims& d, at::ScalarType dtype) {
  const int64_t n = t.size(3);
  const at::Tensor src = t.view({d.chunks, d.batch, -1, kGatedDeltaChunk, n})
                             .permute({1, 0, 3, 2, 4})
                             .reshape({d.batch, d.chunks * kGatedDeltaChunk, -1, n});  // a view when batch is 1
  return src.narrow(1, 0, d.seq).to(dtype, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
}

// q or k as the recurrence reads it: fp32, L2-normalised if asked, times scale.
at::Tensor qk_used(const at::Tensor& x, bool l2, double scale) {
  at::Tensor h = x.to(at::kFloat);
  if (l2) h = h * at::rsqrt(h.square().sum(-1, /*keepdim=*/true) + kL2Eps);
  return scale == 1.0 ? h : h * scale;
}

// The gradient of x from that of qk_used(x) (chunked, per value head), summed over the value heads
// sharing x's key head. Through y = x r with r = (|x|^2 + eps)^-1/2: dx = r (dy - y (y . dy)).
at::Tensor qk_grad(const at::Tensor& dy_chunks, const at::Tensor& x, bool l2, double scale, const Dims& d) {
  const int64_t rep = d.v_heads / d.k_heads;
  const at::Tensor summed =
      rep == 1 ? dy_chunks
               : dy_chunks.view({d.chunks, d.batch * d.k_heads, rep, kGatedDeltaChunk, d.dk}).sum(2);
  at::Tensor dy = from_chunks(summed, d, at::kFloat);
  if (scale != 1.0) dy.mul_(scale);
  if (!l2) return dy.to(x.scalar_type());
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor r = at::rsqrt(h.square().sum(-1, /*keepdim=*/true) + kL2Eps);
  const at::Tensor y = h * r;
  return (r * (dy - y * (y * dy).sum(-1, /*keepdim=*/true))).to(x.scalar_type());
}

gated_delta::Chunks prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, bool l2, const Dims& d) {
  const int64_t rep = d.v_heads / d.k_heads;
  gated_delta::Chunks x;
  x.q = to_chunks(qk_used(q, l2, 1.0 / std::sqrt(static_cast<double>(d.dk))), d, rep);
  x.k = to_chunks(qk_used(k, l2, 1.0), d, rep);
  x.v = to_chunks(v, d);
  x.g = to_chunks(g.unsqueeze(-1), d).squeeze(-1);
  x.beta = to_chunks(beta.unsqueeze(-1), d).squeeze(-1);
  return x;
}

// The state as the chunks take it; undefined (zeros) for an undefined or empty one (the node's
// stand-in for "no initial state": an autograd node's inputs must all be defined).
at::Tensor flat_state(const at::Tensor& s, const Dims& d) {
  return s.defined() && s.numel() != 0 ? s.to(at::kFloat).reshape({d.batch * d.v_heads, d.dk, d.dv}) : at::Tensor();
}

struct GatedDeltaFunction : public torch::autograd::Function<GatedDeltaFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state0, bool l2) {
    const Dims d = check_dims(q, k, v, g, beta, state0);
    const gated_delta::Forward f = gated_delta::chunked_forward(prepare(q, k, v, g, beta, l2, d), flat_state(state0, d));
    variable_list keep{q, k, v, g, beta, state0};
    for (const at::Tensor& t : f.saved.list()) keep.push_back(t);
    ctx->save_for_backward(keep);
    ctx->saved_data["l2"] = l2;
    return {from_chunks(f.out, d, q.scalar_type()), f.final.view({d.batch, d.v_heads, d.dk, d.dv})};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &g = s[3], &beta = s[4], &state0 = s[5];
    const bool l2 = ctx->saved_data["l2"].toBool();
    const Dims d = check_dims(q, k, v, g, beta, state0);
    const at::Tensor d_out = grads[0].defined()
                                 ? to_chunks(grads[0], d)
                                 : at::zeros({d.chunks, d.batch * d.v_heads, kGatedDeltaChunk, d.dv}, s[6].options());
    const gated_delta::Grads gr =
        gated_delta::chunked_backward(prepare(q, k, v, g, beta, l2, d), gated_delta::Saved::of(s, 6), d_out,
                                       flat_state(grads[1], d));
    const double scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
    const at::Tensor d_state0 =
        state0.numel() != 0 ? gr.state0.view({d.batch, d.v_heads, d.dk, d.dv}).to(state0.scalar_type()) : at::Tensor();
    return {qk_grad(gr.q, q, l2, scale, d),
            qk_grad(gr.k, k, l2, 1.0, d),
            from_chunks(gr.v, d, v.scalar_type()),
            from_chunks(gr.g.unsqueeze(-1), d, g.scalar_type()).squeeze(-1),
            from_chunks(gr.beta.unsqueeze(-1), d, beta.scalar_type()).squeeze(-1),
            d_state0,
            at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& g, const at::Tensor& beta,
                                                         const at::Tensor& initial_state, bool output_final_state,
                                                         bool use_qk_l2norm) {
  const at::Tensor state0 = initial_state.defined() ? initial_state : at::empty({0}, v.options().dtype(at::kFloat));
  const variable_list r = GatedDeltaFunction::apply(q, k, v, g, beta, state0, use_qk_l2norm);
  return {r[0], output_final_state ? r[1] : at::Tensor()};
}

}  // namespace qlora::ops
