#include "qlora/modules/blocked_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

#include "qlora/ops/softmax_ops.h"

namespace qlora::modules {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The scaled scores of query rows [i0, i0 + n) against keys [k0, i0 + n), into s [h, n, i0 + n - k0]
// (masked entries included). q, k: [h, seq, d] contiguous.
const at::Tensor& scores(const at::Tensor& q, const at::Tensor& k, int64_t i0, int64_t n, int64_t k0, double scale,
                         const at::Tensor& s) {
  at::Tensor out = s;
  at::baddbmm_out(out, s, q.narrow(1, i0, n), k.narrow(1, k0, i0 + n - k0).transpose(1, 2), /*beta=*/0.0,
                  /*alpha=*/scale);
  return s;
}

// The same scores causally masked: only the last n keys (the diagonal block) hold masked entries,
// and `future` [block, block] bool is true above its diagonal.
at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, int64_t i0, int64_t n, int64_t k0, double scale,
                        const at::Tensor& future, at::Tensor s) {
  scores(q, k, i0, n, k0, scale, s);
  s.narrow(2, i0 - k0, n).masked_fill_(future.narrow(0, 0, n).narrow(1, 0, n), -std::numeric_limits<double>::infinity());
  return s;
}

// The diagonal block's mask for blocks of `block` rows.
at::Tensor future_mask(const at::Tensor& q, int64_t block) {
  return at::ones({block, block}, q.options().dtype(at::kBool)).triu_(1);
}

at::Tensor heads_of(const at::Tensor& t, int64_t h0, int64_t h1) { return t.narrow(0, h0, h1 - h0); }

// The positions an explicit mask hides, beyond the causal ones: hidden [mb, seq, seq] bool (true:
// hidden), mb 1 or the batch; undefined without a mask. Flattened head i belongs to batch row
// i / heads. first[b]: the first key any query of block b may see in any batch row (packed rows:
// the start of the block's earliest sample); keys before it are never computed.
struct Hidden {
  at::Tensor hidden;
  int64_t heads = 1;
  std::vector<int64_t> first;
  at::Tensor sinks;  // gpt-oss: each flattened head's sink logit [bh] fp32; undefined: none
  int64_t first_key(int64_t i0, int64_t block) const { return first.empty() ? 0 : first[i0 / block]; }
};

// Per query block of `block` rows, the first key that any row of it may see in any batch row.
// Each query sees itself, so that key is at most the block's first row.
std::vector<int64_t> first_keys(const at::Tensor& allowed, int64_t block) {
  const at::Tensor per_row = allowed.to(at::kByte).argmax(-1).amin(0).contiguous();  // [seq]: first allowed key
  const int64_t seq = per_row.size(0);
  const int64_t* f = per_row.const_data_ptr<int64_t>();
  std::vector<int64_t> out;
  for (int64_t i0 = 0; i0 < seq; i0 += block)
    out.push_back(std::min(i0, *std::min_element(f + i0, f + std::min(seq, i0 + block))));
  return out;
}

// Writes `value` into the entries of query block s [h, n, keys - k0] (flattened heads h0 ..,
// queries i0 .., keys k0 ..) that `m` hides: one masked fill per batch row the heads span.
void fill_hidden(const at::Tensor& s, const Hidden& m, int64_t h0, int64_t i0, int64_t k0, double value) {
  if (!m.hidden.defined()) return;
  const int64_t h = s.size(0), n = s.size(1), width = s.size(2);
  for (int64_t j = 0; j < h;) {
    const int64_t b = (h0 + j) / m.heads, end = std::min(h, (b + 1) * m.heads - h0);
    const at::Tensor block = m.hidden.select(0, m.hidden.size(0) == 1 ? 0 : b).narrow(0, i0, n).narrow(1, k0, width);
    s.narrow(0, j, end - j).masked_fill_(block, value);
    j = end;
  }
}

// Attention sinks (gpt-oss): one more logit per head in each row's softmax, attending to nothing. The
// rows' probabilities p [h, n, keys] (normalised without it) shrink by exp(lse - lse'), lse' =
// logaddexp(lse, sink), and lse [h, n] becomes lse', from which backward recomputes p (its dS = p (dP -
// delta) holds as it is: the sink has no value, so no dP).
void add_sinks(const at::Tensor& p, at::Tensor lse, const at::Tensor& sinks) {
  const at::Tensor with = at::logaddexp(lse, sinks.unsqueeze(1).to(lse.scalar_type()));  // [h, n]
  p.mul_((lse - with).exp_().unsqueeze(-1).to(p.scalar_type()));
  lse.copy_(with);
}

// Query block b's probabilities [h1 - h0, n, keys] of heads [h0, h1): a slice of the kept ones, or
// undefined when they are not kept.
at::Tensor kept_probs(const std::vector<at::Tensor>& probs, size_t b, int64_t h0, int64_t h1) {
  return probs.empty() ? at::Tensor() : heads_of(probs[b], h0, h1);
}

// Forward over heads [h0, h1) of the flattened [bh, seq, d] tensors: o of those heads, and each
// query block's probabilities into `probs` when it holds them ([bh, n, keys - k0] per block), else
// the rows' log-sum-exp into lse.
void forward_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o, at::Tensor& lse,
                   double scale, int64_t block, const std::vector<at::Tensor>& probs, int64_t h0, const Hidden& m) {
  const int64_t seq = q.size(1), h = q.size(0);
  for (int64_t i0 = 0; i0 < seq; i0 += block) {
    const int64_t n = std::min(block, seq - i0), k0 = m.first_key(i0, block);
    at::Tensor p = kept_probs(probs, i0 / block, h0, h0 + h);  // [h, n, i0 + n - k0]
    // Kept for backward: no log-sum-exp is needed. Otherwise backward recomputes p from it.
    const bool kept = p.defined();
    if (!kept) p = at::empty({h, n, i0 + n - k0}, q.options());
    scores(q, k, i0, n, k0, scale, p);
    fill_hidden(p, m, h0, i0, k0, -std::numeric_limits<double>::infinity());
    ops::causal_softmax_(p, kept && !m.sinks.defined() ? at::Tensor() : lse.narrow(1, i0, n));
    if (m.sinks.defined()) add_sinks(p, lse.narrow(1, i0, n), heads_of(m.sinks, h0, h0 + h));
    fill_hidden(p, m, h0, i0, k0, 0.0);  // exactly 0 (the kernel's exp(-inf) is ~1e-38)
    at::Tensor o_block = o.narrow(1, i0, n);
    at::bmm_out(o_block, p, v.narrow(1, k0, i0 + n - k0));
  }
}

// Backward over heads [h0, h1): the gradients of q, k and v of those heads.
void backward_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                    const at::Tensor& go, const at::Tensor& delta, at::Tensor& gq, at::Tensor& gk, at::Tensor& gv,
                    double scale, int64_t block, const std::vector<at::Tensor>& probs, int64_t h0, const Hidden& m) {
  const int64_t seq = q.size(1), h = q.size(0);
  const at::Tensor future = probs.empty() ? future_mask(q, block) : at::Tensor();  // for recomputed p
  for (int64_t i0 = 0; i0 < seq; i0 += block) {
    const int64_t n = std::min(block, seq - i0), k0 = m.first_key(i0, block), width = i0 + n - k0;
    // p = softmax of the block's rows: kept from forward, or recomputed from their log-sum-exp.
    at::Tensor p = kept_probs(probs, i0 / block, h0, h0 + h);
    if (!p.defined()) {
      p = block_scores(q, k, i0, n, k0, scale, future, at::empty({h, n, width}, q.options()));
      fill_hidden(p, m, h0, i0, k0, -std::numeric_limits<double>::infinity());
      p.sub_(lse.narrow(1, i0, n).unsqueeze(-1)).exp_();
    }
    const at::Tensor go_b = go.narrow(1, i0, n), q_b = q.narrow(1, i0, n);
    gv.narrow(1, k0, width).baddbmm_(p.transpose(1, 2), go_b);
    // dS = p * (dO v^T - delta), the scores' gradient.
    at::Tensor ds = at::bmm(go_b, v.narrow(1, k0, width).transpose(1, 2));  // [h, n, width]
    ops::softmax_backward_(ds, p, delta.narrow(1, i0, n));
    at::Tensor gq_b = gq.narrow(1, i0, n);
    at::baddbmm_out(gq_b, gq_b, ds, k.narrow(1, k0, width), /*beta=*/0.0, /*alpha=*/scale);
    gk.narrow(1, k0, width).baddbmm_(ds.transpose(1, 2), q_b, /*beta=*/1.0, /*alpha=*/scale);
  }
}

// Runs fn(h0, h1) over ranges of heads on the intra-op threads: heads are independent, and one
// thread per range of heads (its GEMMs single-threaded) beats threading each small GEMM.
// Grad and inference mode are thread-local: the worker threads take the caller's (the autograd
// function runs without grad; generation in inference mode).
template <typename Fn>
void over_heads(int64_t heads, Fn fn) {
  const at::ThreadLocalState caller;
  at::parallel_for(0, heads, 1, [&fn, &caller](int64_t h0, int64_t h1) {
    const at::ThreadLocalStateGuard same(caller);
    fn(h0, h1);
  });
}

struct BlockedCausalAttention : public torch::autograd::Function<BlockedCausalAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, int64_t block, bool keep_probs, const Hidden& m) {
    // The sinks (frozen, not an input) only change the probabilities and their log-sum-exp, which
    // backward reads as forward left them.
    RECORD_USER_SCOPE("qlora::attention");  // a phase of bench_train_step's profile
    const int64_t bh = q.size(0), seq = q.size(1);
    at::Tensor o = at::empty_like(q), lse = at::empty({bh, seq}, q.options());  // [bh, seq, d], [bh, seq]
    std::vector<at::Tensor> probs;  // per query block [bh, n, keys], when kept
    for (int64_t i0 = 0; keep_probs && i0 < seq; i0 += block)
      probs.push_back(at::empty({bh, std::min(block, seq - i0), std::min(i0 + block, seq) - m.first_key(i0, block)},
                                q.options()));
    over_heads(bh, [&](int64_t h0, int64_t h1) {
      at::Tensor oh = heads_of(o, h0, h1), lh = heads_of(lse, h0, h1);
      forward_heads(heads_of(q, h0, h1), heads_of(k, h0, h1), heads_of(v, h0, h1), oh, lh, scale, block, probs, h0, m);
    });
    ctx->save_for_backward({q, k, v, o, lse});
    if (m.hidden.defined()) {  // a mask, not differentiated
      ctx->saved_data["hidden"] = m.hidden;
      ctx->saved_data["first"] = m.first;
    }
    ctx->saved_data["heads"] = m.heads;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["block"] = block;
    ctx->saved_data["probs"] = at::TensorList(probs);  // intermediates, not inputs: no version checks needed
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_USER_SCOPE("qlora::attention");
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &o = s[3], &lse = s[4];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t block = ctx->saved_data["block"].toInt();
    const std::vector<at::Tensor> probs = ctx->saved_data["probs"].toTensorVector();
    const auto hidden = ctx->saved_data.find("hidden");
    Hidden m{at::Tensor(), ctx->saved_data["heads"].toInt(), {}, at::Tensor()};
    if (hidden != ctx->saved_data.end()) {
      m.hidden = hidden->second.toTensor();
      m.first = ctx->saved_data["first"].toIntVector();
    }
    const at::Tensor go = grad_outputs[0].contiguous();  // [bh, seq, d]
    const at::Tensor delta = (go * o).sum(-1, /*keepdim=*/true);  // [bh, seq, 1]: rowsum(dO * O)
    at::Tensor gq = at::empty_like(q), gk = at::zeros_like(k), gv = at::zeros_like(v);
    over_heads(q.size(0), [&](int64_t h0, int64_t h1) {
      at::Tensor gqh = heads_of(gq, h0, h1), gkh = heads_of(gk, h0, h1), gvh = heads_of(gv, h0, h1);
      backward_heads(heads_of(q, h0, h1), heads_of(k, h0, h1), heads_of(v, h0, h1), heads_of(lse, h0, h1),
                     heads_of(go, h0, h1), heads_of(delta, h0, h1), gqh, gkh, gvh, scale, block, probs, h0, m);
    });
    return {gq, gk, gv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor blocked_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                    int64_t block, std::optional<bool> keep_probs, const at::Tensor& allowed,
                                    const at::Tensor& sinks) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes())
    throw std::invalid_argument("blocked_causal_attention: q, k and v must all be [b, heads, seq, d]");
  if (block < 1) throw std::invalid_argument("blocked_causal_attention: block must be >= 1");
  const int64_t b = q.size(0), h = q.size(1), seq = q.size(2), d = q.size(3);
  if (allowed.defined() && (allowed.scalar_type() != at::kBool || allowed.dim() != 3 ||
                            (allowed.size(0) != 1 && allowed.size(0) != b) || allowed.size(1) != seq ||
                            allowed.size(2) != seq))
    throw std::invalid_argument("blocked_causal_attention: allowed must be bool [1 or batch, seq, seq]");
  const at::Tensor hidden = allowed.defined() ? allowed.logical_not() : at::Tensor();
  auto flat = [&](const at::Tensor& t) { return t.reshape({b * h, seq, d}).contiguous(); };
  // The probabilities (~seq^2 / 2 per head) are kept when they are no larger than q, k, v and o
  // (4 seq d per head), i.e. seq <= 8 d; longer sequences recompute them in backward.
  const bool keep = keep_probs.value_or(seq <= 8 * d);
  const std::vector<int64_t> first = allowed.defined() ? first_keys(allowed, block) : std::vector<int64_t>{};
  if (sinks.defined() && (sinks.dim() != 1 || sinks.size(0) != h))
    throw std::invalid_argument("blocked_causal_attention: sinks must be [heads]");
  // Flattened head i is head i % h of its batch row.
  const at::Tensor flat_sinks = sinks.defined() ? sinks.to(q.device(), at::kFloat).repeat({b}) : at::Tensor();
  return BlockedCausalAttention::apply(flat(q), flat(k), flat(v), scale, block, keep,
                                       Hidden{hidden, h, first, flat_sinks})
      .view({b, h, seq, d});
}

}  // namespace qlora::modules
