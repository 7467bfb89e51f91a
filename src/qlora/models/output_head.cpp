#include "qlora/models/output_head.h"

#include <ATen/ATen.h>

#include <ATen/core/Reduction.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/ops/nf4_ops.h"
#include "qlora/ops/softmax_ops.h"

namespace qlora::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kIgnoreIndex = -100;  // data::kIgnoreIndex, as batching writes the labels

// y = x @ W^T for a frozen W [out, in] stored narrower than x (bf16 under fp32 compute), widening
// `chunk` rows of W at a time in forward and backward: neither a widened W nor widened chunks are
// kept (autograd through narrow + to + linear would save every widened chunk, i.e. the whole
// widened W). With out <= chunk this is exactly at::linear(x, W.to(x's dtype)) and its backward.
struct WidenedLinearFunction : public torch::autograd::Function<WidenedLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, int64_t chunk) {
    ctx->saved_data["w"] = w;  // frozen constant: no saved variable, no copy
    ctx->saved_data["chunk"] = chunk;
    const int64_t out = w.size(0);
    if (out <= chunk) return at::linear(x, w.to(x.scalar_type()));  // [..., out]
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out;
    at::Tensor y = at::empty(sizes, x.options());  // [..., out]
    for (int64_t r0 = 0; r0 < out; r0 += chunk) {
      const int64_t n = std::min(chunk, out - r0);
      y.narrow(-1, r0, n).copy_(at::linear(x, w.narrow(0, r0, n).to(x.scalar_type())));  // [..., n]
    }
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& gy = grad_outputs[0];  // [..., out]
    const at::Tensor w = ctx->saved_data["w"].toTensor();
    const int64_t chunk = ctx->saved_data["chunk"].toInt(), out = w.size(0);
    at::Tensor gx;  // [..., in]
    if (out <= chunk) {
      gx = at::matmul(gy, w.to(gy.scalar_type()));
    } else {
      for (int64_t r0 = 0; r0 < out; r0 += chunk) {
        const int64_t n = std::min(chunk, out - r0);
        at::Tensor part = at::matmul(gy.narrow(-1, r0, n), w.narrow(0, r0, n).to(gy.scalar_type()));
        gx = gx.defined() ? gx.add_(part) : part;
      }
    }
    return {gx, at::Tensor(), at::Tensor()};
  }
};

bool wants_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

// The head's weight as blocks of vocab rows in a chosen dtype: a dense base narrowed and converted
// block by block (a bf16 head is never widened whole); an NF4 base dequantized once.
struct HeadRows {
  at::Tensor w;  // [vocab, hidden]: base_dense, or the dequantized NF4 base
  HeadRows(const modules::LoraLinear& l, at::ScalarType dt)
      : w(l.base_dense.defined() ? l.base_dense : ops::nf4_dequantize(l.base_nf4, dt)) {}
  at::Tensor block(int64_t r0, int64_t n, at::ScalarType dt) const { return w.narrow(0, r0, n).to(dt); }  // [n, hidden]
  at::Tensor rows(const at::Tensor& ids, at::ScalarType dt) const { return w.index_select(0, ids).to(dt); }
};

// What one chunk of scored tokens needs: hidden states, the LoRA path's x @ A^T, labels (all scored).
struct ChunkRows {
  at::Tensor h;   // [T, hidden] compute dtype
  at::Tensor xa;  // [T, r] fp32 (lora_x @ A^T, unscaled), undefined without an adapter
  at::Tensor labels;  // [T] int64 in [0, vocab)
};

// Logits of vocab rows [r0, r0 + n) as output_logits computes those columns: [T, n] fp32.
at::Tensor block_logits(const OutputHead& head, const ChunkRows& c, const at::Tensor& w, int64_t r0, int64_t n) {
  const modules::LoraLinear& l = *head.proj;
  at::Tensor y = at::linear(c.h, w, l.bias.defined() ? l.bias.narrow(0, r0, n) : at::Tensor());  // [T, n]
  if (l.active()) y = (y + at::linear(c.xa, l.lora_b.detach().narrow(0, r0, n)) * l.scale).to(c.h.scalar_type());
  if (head.softcap != 0.0) y = at::tanh(y / head.softcap) * head.softcap;
  return head.temperature != 1.0 ? y.to(at::kFloat) / head.temperature : y.to(at::kFloat);
}

// Where each token's label falls in vocab rows [r0, r0 + n): whether it does ([T, 1] bool) and its
// column there (clamped into the block, so usable by gather/scatter either way, [T, 1]).
struct LabelColumn {
  at::Tensor in_block, column;
};
LabelColumn label_column(const at::Tensor& labels, int64_t r0, int64_t n) {
  const at::Tensor lb = labels.unsqueeze(1);  // [T, 1]
  return {(lb >= r0).logical_and_(lb < r0 + n), (lb - r0).clamp_(0, n - 1)};
}

// d softcap(y) / dy from the logits z (with a cap): 1 - (c / cap)^2, c = z · temperature the capped value.
at::Tensor softcap_slope(const OutputHead& head, const at::Tensor& z) {
  return 1.0 - ((head.temperature != 1.0 ? z * head.temperature : z) / head.softcap).square();
}

// One chunk's per-token losses and the gradients of their sum wrt h (dh [T, hidden] fp32) and wrt
// xa (dxa [T, r] fp32, before the adapter's scale): one pass over the vocabulary in blocks of
// head.widen_rows rows, keeping a running max m, a running sum s of exp(z - m) and, for the
// gradients, running sums of exp(z - m) @ W and exp(z - m) @ B, all rescaled when m grows (the
// online log-sum-exp of flash attention). At the end p = exp(z - lse) = exp(z - m) / s, so
// dh = (sum_v exp(z_v - m) W_v) / s - W_label, with no [T, vocab] tensor ever formed.
struct ChunkScore {
  at::Tensor loss, lse, dh, dxa, entropy;  // entropy: where head.entropy is set
};

ChunkScore score_chunk(const OutputHead& head, const HeadRows& rows, const ChunkRows& c, bool dh, bool dxa) {
  const modules::LoraLinear& l = *head.proj;
  const int64_t T = c.h.size(0), V = l.out_features, block = std::max<int64_t>(1, head.widen_rows);
  const at::TensorOptions f32 = c.h.options().dtype(at::kFloat);
  at::Tensor m = at::full({T, 1}, -std::numeric_limits<float>::infinity(), f32), s = at::zeros({T, 1}, f32);
  at::Tensor zl = at::zeros({T}, f32);  // the label's logit
  at::Tensor acc_h = dh ? at::zeros({T, l.in_features}, f32) : at::Tensor();
  at::Tensor acc_xa = dxa ? at::zeros({T, l.r}, f32) : at::Tensor();
  // For the entropy lse - sum_v p_v z_v: the running sum of exp(z - m) z, rescaled with s.
  at::Tensor acc_pz = head.entropy ? at::zeros({T, 1}, f32) : at::Tensor();
  for (int64_t r0 = 0; r0 < V; r0 += block) {
    const int64_t n = std::min(block, V - r0);
    const at::Tensor w = rows.block(r0, n, c.h.scalar_type());  // [n, hidden]
    const at::Tensor z = block_logits(head, c, w, r0, n);  // [T, n]
    const LabelColumn lc = label_column(c.labels, r0, n);
    zl.add_(at::where(lc.in_block, z.gather(1, lc.column), 0.0).squeeze(1));
    // p = exp(z - m) with m the new running max, in z's place unless the softcap's slope needs z.
    at::Tensor p = head.softcap != 0.0 || head.entropy ? at::empty_like(z) : z;  // [T, n]
    const at::Tensor rescale = ops::online_softmax_(z, p, m, s);  // [T, 1], 0 on the first block
    if (head.entropy) acc_pz.mul_(rescale).add_((p * z).sum(1, /*keepdim=*/true));
    if (!dh && !dxa) continue;
    if (head.softcap != 0.0) p.mul_(softcap_slope(head, z));
    if (head.temperature != 1.0) p.mul_(1.0 / head.temperature);
    // dh: fp32 GEMMs into the running sum; a bf16 head as a bf16 GEMM (fp32 accumulation) whose
    // block sum is added in fp32, never widening the block of W.
    if (dh && w.scalar_type() == at::kFloat) acc_h.mul_(rescale).addmm_(p, w);
    else if (dh) acc_h.mul_(rescale).add_(at::mm(p.to(w.scalar_type()), w));
    if (dxa) acc_xa.mul_(rescale).addmm_(p, l.lora_b.detach().narrow(0, r0, n));
  }
  ChunkScore r;
  r.lse = (m + s.log()).squeeze(1);  // [T]
  r.loss = r.lse - zl;
  if (head.entropy) r.entropy = r.lse - (acc_pz / s).squeeze(1);
  if (!dh && !dxa) return r;
  at::Tensor label_slope = head.softcap != 0.0 ? softcap_slope(head, zl).unsqueeze(1) : at::ones({1, 1}, f32);
  if (head.temperature != 1.0) label_slope = label_slope / head.temperature;
  if (dh) r.dh = acc_h.div_(s).sub_(rows.rows(c.labels, at::kFloat).mul_(label_slope));
  if (dxa) r.dxa = acc_xa.div_(s).sub_(l.lora_b.detach().index_select(0, c.labels).mul(label_slope));
  return r;
}

// The gradient of the chunk's summed loss wrt B [vocab, r], before the adapter's scale: a second
// pass over the vocabulary, since p = exp(z - lse) needs the final lse (sum_t (p_t - onehot_t) xa_t).
void add_lora_b_grad(const OutputHead& head, const HeadRows& rows, const ChunkRows& c, const at::Tensor& lse,
                     at::Tensor& db) {
  const modules::LoraLinear& l = *head.proj;
  const int64_t V = l.out_features, block = std::max<int64_t>(1, head.widen_rows);
  for (int64_t r0 = 0; r0 < V; r0 += block) {
    const int64_t n = std::min(block, V - r0);
    const at::Tensor z = block_logits(head, c, rows.block(r0, n, c.h.scalar_type()), r0, n);  // [T, n]
    at::Tensor g = (z - lse.unsqueeze(1)).exp_();  // [T, n]
    const LabelColumn lc = label_column(c.labels, r0, n);
    g.scatter_add_(1, lc.column, at::where(lc.in_block, -1.0, 0.0).to(at::kFloat));
    if (head.softcap != 0.0) g.mul_(softcap_slope(head, z));
    if (head.temperature != 1.0) g.mul_(1.0 / head.temperature);
    db.narrow(0, r0, n).addmm_(g.t(), c.xa);
  }
}

// The loss summed over scored tokens (labels != ignore_index) per segment ([G] fp32: segment
// seg[t] of each token; one segment without `seg`) and, with `grads`, the gradients of each
// segment's sum: wrt h and lora_x per token (a token belongs to one segment), wrt the head's
// adapters per segment ([G, r, in], [G, vocab, r]); undefined for those that need none. Tokens
// without a label are dropped first: their rows cost nothing and get a zero gradient.
struct ChunkedLoss {
  at::Tensor loss, h, x, a, b;
};

ChunkedLoss chunked_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                         const at::Tensor& labels, const at::Tensor& seg, int64_t segments, int64_t chunk, bool grads) {
  RECORD_USER_SCOPE("qlora::output_loss");  // a phase of bench_train_step's profile
  const modules::LoraLinear& l = *head.proj;
  at::NoGradGuard no_grad;
  ChunkedLoss out;
  out.loss = at::zeros({segments}, h.options().dtype(at::kFloat));
  const bool lora = l.active();
  const bool want_x = grads && wants_grad(lora_x), want_a = grads && lora && wants_grad(l.lora_a);
  const bool want_b = grads && lora && wants_grad(l.lora_b), want_h = grads && wants_grad(h);
  if (want_h) out.h = at::zeros_like(h);
  if (want_x) out.x = at::zeros_like(lora_x);
  if (want_a) out.a = at::zeros({segments, l.r, l.in_features}, l.lora_a.options());
  if (want_b) out.b = at::zeros({segments, l.out_features, l.r}, l.lora_b.options());
  const at::Tensor scored = labels.ne(kIgnoreIndex).nonzero().squeeze(1);  // [S] row indices
  const int64_t S = scored.size(0);
  if (head.entropy) *head.entropy = at::zeros({h.size(0)}, h.options().dtype(at::kFloat));
  if (S == 0) return out;
  const HeadRows rows(l, h.scalar_type());
  for (int64_t s0 = 0; s0 < S; s0 += chunk) {
    const at::Tensor idx = scored.narrow(0, s0, std::min(chunk, S - s0));
    const at::Tensor cs = segments > 1 ? seg.index_select(0, idx) : at::Tensor();  // [T] segments
    ChunkRows c{h.detach().index_select(0, idx), at::Tensor(), labels.index_select(0, idx)};
    const at::Tensor xc = lora ? lora_x.detach().index_select(0, idx) : at::Tensor();  // [T, hidden] fp32
    if (lora) c.xa = at::linear(xc, l.lora_a.detach());  // [T, r]
    const ChunkScore r = score_chunk(head, rows, c, want_h, want_x || want_a);
    if (head.entropy) head.entropy->index_copy_(0, idx, r.entropy);
    if (segments == 1) out.loss.add_(r.loss.sum());  // the order of sums the scalar loss always had
    else out.loss.index_add_(0, cs, r.loss);
    if (want_h) out.h.index_copy_(0, idx, r.dh.to(h.scalar_type()));
    const at::Tensor dxa = want_x || want_a ? r.dxa.mul_(l.scale) : at::Tensor();  // [T, r]
    if (want_x) out.x.index_copy_(0, idx, at::matmul(dxa, l.lora_a.detach()));
    for (int64_t g = 0; (want_a || want_b) && g < segments; ++g) {
      const at::Tensor mine = segments == 1 ? at::Tensor() : cs.eq(g).nonzero().squeeze(1);  // this segment's rows
      if (mine.defined() && mine.numel() == 0) continue;
      auto part = [&](const at::Tensor& t) { return mine.defined() ? t.index_select(0, mine) : t; };
      if (want_a) out.a[g].addmm_(part(dxa).t(), part(xc));
      if (want_b) {
        const ChunkRows cg{part(c.h), part(c.xa), part(c.labels)};
        at::Tensor bg = out.b[g];
        add_lora_b_grad(head, rows, cg, part(r.lse), bg);
      }
    }
  }
  if (want_b) out.b.mul_(l.scale);
  return out;
}

// The chunked loss as one autograd node over h, lora_x and the head's adapters; its backward
// scales the gradients chunked_loss computed in forward by the incoming one: per token by its
// segment's, summed over segments for the adapters.
struct ChunkedLossFunction : public torch::autograd::Function<ChunkedLossFunction> {
  // a, b: the head's adapters, inputs so that autograd routes their gradients; chunked_loss reads them from head.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& lora_x,
                            const at::Tensor& /*a*/, const at::Tensor& /*b*/, const at::Tensor& labels,
                            const at::Tensor& seg, int64_t segments, const OutputHead& head, int64_t chunk) {
    // Without an adapter lora_x, a and b are empty placeholders (autograd takes no undefined inputs).
    const at::Tensor x = head.proj->active() ? lora_x : at::Tensor();
    const at::Tensor segs = seg.numel() > 0 ? seg : at::Tensor();
    ChunkedLoss r = chunked_loss(head, h, x, labels, segs, segments, chunk, /*grads=*/true);
    for (auto [name, g] : {std::pair{"h", r.h}, {"x", r.x}, {"a", r.a}, {"b", r.b}})
      if (g.defined()) ctx->saved_data[name] = g;
    if (segs.defined()) ctx->saved_data["seg"] = segs;
    return r.loss;  // [segments]
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& go = grad_outputs[0];  // [segments] fp32
    const at::Tensor per_token = ctx->saved_data.count("seg") ? go.index_select(0, ctx->saved_data["seg"].toTensor())
                                                              : go.expand({1});  // [N] or [1]
    auto scaled = [&](const char* name) {
      if (!ctx->saved_data.count(name)) return at::Tensor();
      const at::Tensor g = ctx->saved_data[name].toTensor();
      if (g.dim() == 3) return (g * go.view({-1, 1, 1})).sum(0).to(g.scalar_type());  // adapters [G, ...]
      return (g * per_token.unsqueeze(1)).to(g.scalar_type());
    };
    return {scaled("h"), scaled("x"), scaled("a"), scaled("b"), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// The whole-logits paths' entropies (OutputHead::entropy), where asked for: [N], 0 where unscored.
void record_entropy(const OutputHead& head, const at::Tensor& logits, const at::Tensor& labels) {
  if (!head.entropy) return;
  at::NoGradGuard no_grad;
  const at::Tensor logp = at::log_softmax(logits.detach(), -1);
  *head.entropy = -(logp.exp() * logp).sum(-1).masked_fill(labels.eq(kIgnoreIndex), 0.0);
}

void check_loss_args(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x, const at::Tensor& labels) {
  const modules::LoraLinear& l = *head.proj;
  if (h.dim() != 2 || h.size(1) != l.in_features)
    throw std::invalid_argument("output loss: hidden states must be [tokens, " + std::to_string(l.in_features) +
                                "], got " + c10::str(h.sizes()));
  if (labels.dim() != 1 || labels.size(0) != h.size(0) || labels.scalar_type() != at::kLong)
    throw std::invalid_argument("output loss: labels must be int64 [" + std::to_string(h.size(0)) + "], got " +
                                c10::str(labels.sizes()));
  const at::Tensor scored = labels.masked_select(labels.ne(kIgnoreIndex));
  if (scored.numel() > 0 && (scored.min().item<int64_t>() < 0 || scored.max().item<int64_t>() >= l.out_features))
    throw std::invalid_argument("output loss: a label is outside [0, " + std::to_string(l.out_features) +
                                ") and is not the ignore index -100");
  if (lora_x.defined() != l.active() || (lora_x.defined() && lora_x.sizes() != h.sizes()))
    throw std::invalid_argument("output loss: the LoRA input must be given exactly when the head has an adapter, "
                                "shaped like the hidden states");
}

void check_segments(const at::Tensor& labels, const at::Tensor& segments, int64_t num_segments) {
  if (num_segments < 1) throw std::invalid_argument("output loss: the number of segments must be >= 1");
  if (!segments.defined()) return;
  if (segments.dim() != 1 || segments.size(0) != labels.size(0) || segments.scalar_type() != at::kLong)
    throw std::invalid_argument("output loss: segments must be int64 [" + std::to_string(labels.size(0)) + "], got " +
                                c10::str(segments.sizes()));
  if (segments.numel() > 0 && (segments.min().item<int64_t>() < 0 || segments.max().item<int64_t>() >= num_segments))
    throw std::invalid_argument("output loss: a segment index is outside [0, " + std::to_string(num_segments) + ")");
}

}  // namespace

at::Tensor output_logits(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x) {
  const modules::LoraLinear& l = *head.proj;
  at::Tensor y;  // [..., vocab] in h's dtype
  if (l.base_dense.defined() && l.base_dense.scalar_type() != h.scalar_type()) {
    y = WidenedLinearFunction::apply(h, l.base_dense, std::max<int64_t>(1, head.widen_rows));
    if (l.bias.defined()) y = y + l.bias;
  } else {
    y = modules::lora_linear_base(l, h);
  }
  // As lora_linear_forward: the fp32 update added to the base output, the sum cast back.
  if (l.active()) y = (y + modules::lora_update(l, lora_x)).to(h.scalar_type());
  if (head.softcap != 0.0) y = at::tanh(y / head.softcap) * head.softcap;
  return head.temperature != 1.0 ? y.to(at::kFloat) / head.temperature : y.to(at::kFloat);
}

int64_t default_loss_chunk_tokens(int64_t block_rows) {
  return std::max<int64_t>(1, kLossChunkBytes / (std::max<int64_t>(block_rows, 1) * int64_t{4}));
}

at::Tensor chunked_segment_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                                const at::Tensor& labels, const at::Tensor& segments, int64_t num_segments,
                                int64_t chunk_tokens) {
  check_loss_args(head, h, lora_x, labels);
  check_segments(labels, segments, num_segments);
  if (chunk_tokens < 1) throw std::invalid_argument("output loss: chunk_tokens must be >= 1");
  const modules::LoraLinear& l = *head.proj;
  const bool grads = at::GradMode::is_enabled() && (wants_grad(h) || wants_grad(lora_x) ||
                                                    (l.active() && (wants_grad(l.lora_a) || wants_grad(l.lora_b))));
  if (!grads) return chunked_loss(head, h, lora_x, labels, segments, num_segments, chunk_tokens, /*grads=*/false).loss;
  const at::Tensor none = at::empty({0}, h.options());
  const at::Tensor seg = segments.defined() ? segments : at::empty({0}, labels.options());
  return l.active() ? ChunkedLossFunction::apply(h, lora_x, l.lora_a, l.lora_b, labels, seg, num_segments, head, chunk_tokens)
                      : ChunkedLossFunction::apply(h, none, none, none, labels, seg, num_segments, head, chunk_tokens);
}

at::Tensor chunked_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                              const at::Tensor& labels, int64_t chunk_tokens) {
  return chunked_segment_loss(head, h, lora_x, labels, at::Tensor(), 1, chunk_tokens).squeeze(0);
}

at::Tensor full_segment_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                             const at::Tensor& labels, const at::Tensor& segments, int64_t num_segments) {
  check_loss_args(head, h, lora_x, labels);
  check_segments(labels, segments, num_segments);
  const at::Tensor logits = output_logits(head, h, lora_x);  // [N, vocab]
  record_entropy(head, logits, labels);
  const at::Tensor per_token = at::cross_entropy_loss(logits, labels, {}, at::Reduction::None,
                                                      kIgnoreIndex);  // [N], 0 where ignored
  if (!segments.defined()) return per_token.sum().unsqueeze(0);
  return at::zeros({num_segments}, per_token.options()).index_add(0, segments, per_token);
}

at::Tensor full_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                           const at::Tensor& labels) {
  check_loss_args(head, h, lora_x, labels);
  const at::Tensor logits = output_logits(head, h, lora_x);  // [N, vocab]
  record_entropy(head, logits, labels);
  return at::cross_entropy_loss(logits, labels, {}, at::Reduction::Sum, kIgnoreIndex);
}

}  // namespace qlora::models
