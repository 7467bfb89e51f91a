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

// The scaled scores of query rows [i0, i0 + n) against keys [0, i0 + n), into s [h, n, i0 + n]
// (masked entries included). q, k: [h, seq, d] contiguous.
const at::Tensor& scores(const at::Tensor& q, const at::Tensor& k, int64_t i0, int64_t n, double scale,
                         const at::Tensor& s) {
  at::Tensor out = s;
  at::baddbmm_out(out, s, q.narrow(1, i0, n), k.narrow(1, 0, i0 + n).transpose(1, 2), /*beta=*/0.0, /*alpha=*/scale);
  return s;
}

// The same scores causally masked: only the last n keys (the diagonal block) hold masked entries,
// and `future` [block, block] bool is true above its diagonal.
at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, int64_t i0, int64_t n, double scale,
                        const at::Tensor& future, at::Tensor s) {
  scores(q, k, i0, n, scale, s);
  s.narrow(2, i0, n).masked_fill_(future.narrow(0, 0, n).narrow(1, 0, n), -std::numeric_limits<double>::infinity());
  return s;
}

// The diagonal block's mask for blocks of `block` rows.
at::Tensor future_mask(const at::Tensor& q, int64_t block) {
  return at::ones({block, block}, q.options().dtype(at::kBool)).triu_(1);
}

at::Tensor heads_of(const at::Tensor& t, int64_t h0, int64_t h1) { return t.narrow(0, h0, h1 - h0); }

// Query block b's probabilities [h1 - h0, n, keys] of heads [h0, h1): a slice of the kept ones, or
// undefined when they are not kept.
at::Tensor kept_probs(const std::vector<at::Tensor>& probs, size_t b, int64_t h0, int64_t h1) {
  return probs.empty() ? at::Tensor() : heads_of(probs[b], h0, h1);
}

// Forward over heads [h0, h1) of the flattened [bh, seq, d] tensors: o of those heads, and each
// query block's probabilities into `probs` when it holds them ([bh, n, keys] per block), else the
// rows' log-sum-exp into lse.
void forward_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o, at::Tensor& lse,
                   double scale, int64_t block, const std::vector<at::Tensor>& probs, int64_t h0) {
  const int64_t seq = q.size(1), h = q.size(0);
  for (int64_t i0 = 0; i0 < seq; i0 += block) {
    const int64_t n = std::min(block, seq - i0);
    at::Tensor p = kept_probs(probs, i0 / block, h0, h0 + h);  // [h, n, i0 + n]
    // Kept for backward: no log-sum-exp is needed. Otherwise backward recomputes p from it.
    const bool kept = p.defined();
    if (!kept) p = at::empty({h, n, i0 + n}, q.options());
    ops::causal_softmax_(scores(q, k, i0, n, scale, p), kept ? at::Tensor() : lse.narrow(1, i0, n));
    at::Tensor o_block = o.narrow(1, i0, n);
    at::bmm_out(o_block, p, v.narrow(1, 0, i0 + n));
  }
}

// Backward over heads [h0, h1): the gradients of q, k and v of those heads.
void backward_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                    const at::Tensor& go, const at::Tensor& delta, at::Tensor& gq, at::Tensor& gk, at::Tensor& gv,
                    double scale, int64_t block, const std::vector<at::Tensor>& probs, int64_t h0) {
  const int64_t seq = q.size(1), h = q.size(0);
  const at::Tensor future = probs.empty() ? future_mask(q, block) : at::Tensor();  // for recomputed p
  for (int64_t i0 = 0; i0 < seq; i0 += block) {
    const int64_t n = std::min(block, seq - i0), keys = i0 + n;
    // p = softmax of the block's rows: kept from forward, or recomputed from their log-sum-exp.
    at::Tensor p = kept_probs(probs, i0 / block, h0, h0 + h);
    if (!p.defined())
      p = block_scores(q, k, i0, n, scale, future, at::empty({h, n, keys}, q.options()))
              .sub_(lse.narrow(1, i0, n).unsqueeze(-1))
              .exp_();
    const at::Tensor go_b = go.narrow(1, i0, n), q_b = q.narrow(1, i0, n);
    gv.narrow(1, 0, keys).baddbmm_(p.transpose(1, 2), go_b);
    // dS = p * (dO v^T - delta), the scores' gradient.
    at::Tensor ds = at::bmm(go_b, v.narrow(1, 0, keys).transpose(1, 2));  // [h, n, keys]
    ops::softmax_backward_(ds, p, delta.narrow(1, i0, n));
    at::Tensor gq_b = gq.narrow(1, i0, n);
    at::baddbmm_out(gq_b, gq_b, ds, k.narrow(1, 0, keys), /*beta=*/0.0, /*alpha=*/scale);
    gk.narrow(1, 0, keys).baddbmm_(ds.transpose(1, 2), q_b, /*beta=*/1.0, /*alpha=*/scale);
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
                            double scale, int64_t block, bool keep_probs) {
    RECORD_USER_SCOPE("qlora::attention");  // a phase of bench_train_step's profile
    const int64_t bh = q.size(0), seq = q.size(1);
    at::Tensor o = at::empty_like(q), lse = at::empty({bh, seq}, q.options());  // [bh, seq, d], [bh, seq]
    std::vector<at::Tensor> probs;  // per query block [bh, n, keys], when kept
    for (int64_t i0 = 0; keep_probs && i0 < seq; i0 += block)
      probs.push_back(at::empty({bh, std::min(block, seq - i0), std::min(i0 + block, seq)}, q.options()));
    over_heads(bh, [&](int64_t h0, int64_t h1) {
      at::Tensor oh = heads_of(o, h0, h1), lh = heads_of(lse, h0, h1);
      forward_heads(heads_of(q, h0, h1), heads_of(k, h0, h1), heads_of(v, h0, h1), oh, lh, scale, block, probs, h0);
    });
    ctx->save_for_backward({q, k, v, o, lse});
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
    const at::Tensor go = grad_outputs[0].contiguous();  // [bh, seq, d]
    const at::Tensor delta = (go * o).sum(-1, /*keepdim=*/true);  // [bh, seq, 1]: rowsum(dO * O)
    at::Tensor gq = at::empty_like(q), gk = at::zeros_like(k), gv = at::zeros_like(v);
    over_heads(q.size(0), [&](int64_t h0, int64_t h1) {
      at::Tensor gqh = heads_of(gq, h0, h1), gkh = heads_of(gk, h0, h1), gvh = heads_of(gv, h0, h1);
      backward_heads(heads_of(q, h0, h1), heads_of(k, h0, h1), heads_of(v, h0, h1), heads_of(lse, h0, h1),
                     heads_of(go, h0, h1), heads_of(delta, h0, h1), gqh, gkh, gvh, scale, block, probs, h0);
    });
    return {gq, gk, gv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor blocked_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                    int64_t block, std::optional<bool> keep_probs) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes())
    throw std::invalid_argument("blocked_causal_attention: q, k and v must all be [b, heads, seq, d]");
  if (block < 1) throw std::invalid_argument("blocked_causal_attention: block must be >= 1");
  const int64_t b = q.size(0), h = q.size(1), seq = q.size(2), d = q.size(3);
  auto flat = [&](const at::Tensor& t) { return t.reshape({b * h, seq, d}).contiguous(); };
  // The probabilities (~seq^2 / 2 per head) are kept when they are no larger than q, k, v and o
  // (4 seq d per head), i.e. seq <= 8 d; longer sequences recompute them in backward.
  const bool keep = keep_probs.value_or(seq <= 8 * d);
  return BlockedCausalAttention::apply(flat(q), flat(k), flat(v), scale, block, keep).view({b, h, seq, d});
}

}  // namespace qlora::modules
