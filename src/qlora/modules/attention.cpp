#include "qlora/modules/attention.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/max.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tanh.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/StringUtil.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "qlora/modules/blocked_attention.h"
#include "qlora/ops/decode_attention_ops.h"

namespace qlora::modules {

namespace {
// [b, kv_heads, t, d] -> [b, kv_heads * n_rep, t, d], each kv head repeated for its query group.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), kvh = x.size(1), t = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kvh, n_rep, t, d}).reshape({b, kvh * n_rep, t, d});
}

// [seq, total] bool: query i, at position total - seq + i, may see key j (j <= its position and,
// with a window, j > its position - window).
at::Tensor causal_window_mask(int64_t seq, int64_t total, int64_t window, const at::TensorOptions& o) {
  at::Tensor m = at::ones({seq, total}, o.dtype(at::kBool)).tril(total - seq);
  return window > 0 ? m.triu(total - seq - window + 1) : m;
}

// The mask as blocked_causal_attention takes it, [1 or b, seq, seq] bool, when the CPU's blocked
// attention can run this call: q fp32 or bf16 on the CPU, queries and keys at the same positions,
// and a mask shared by the heads that hides every future key (packed rows, sliding windows).
// Undefined (and ok false) otherwise.
at::Tensor blocked_mask(const at::Tensor& q, const at::Tensor& kk, const at::Tensor& mask, bool* ok) {
  const int64_t seq = q.size(2);
  *ok = q.is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && kk.size(2) == seq;
  if (!*ok || !mask.defined()) return {};
  at::Tensor m = mask;
  if (m.dim() == 4 && m.size(1) == 1) m = m.squeeze(1);
  if (m.dim() == 2) m = m.unsqueeze(0);
  *ok = m.dim() == 3 && m.scalar_type() == at::kBool && m.size(1) == seq && m.size(2) == seq &&
        !m.triu(1).any().item<bool>();
  return *ok ? m : at::Tensor();
}

// The scale of q.k: the family's where it sets one (AttentionOptions::scale), else 1 / sqrt(head_dim).
double attention_scale(const at::Tensor& q, const AttentionOptions& opt) {
  return opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// gpt-oss's softmax of scores s [b, heads, seq, total] beside each head's sink [heads], as
// transformers' eager_attention_forward: the sink a last column, the row's max subtracted, softmax in
// s's dtype, the sink's column dropped. Returns [b, heads, seq, total].
at::Tensor sink_softmax(const at::Tensor& s, const at::Tensor& sinks) {
  const at::Tensor sink = sinks.to(s.scalar_type()).view({1, -1, 1, 1}).expand({s.size(0), -1, s.size(2), 1});
  at::Tensor c = at::cat({s, sink}, -1);
  c = c - std::get<0>(c.max(-1, /*keepdim=*/true));
  return at::softmax(c, -1).narrow(-1, 0, s.size(-1));
}

// Scores, optional mask and softmax over expanded K/V (kk, vv [b, heads, total, d]). mask:
// broadcastable to [b, heads, seq, total] bool, or undefined with is_causal (square, top-left).
// Without soft-capping this is the blocked attention or SDPA (with sinks: the blocked attention where
// it applies); else transformers' eager path: scores * scale, then cap * tanh(scores / cap), then the
// mask, then softmax in fp32 (with sinks: sink_softmax).
at::Tensor attend(const at::Tensor& q, const at::Tensor& kk, const at::Tensor& vv, at::Tensor mask, bool is_causal,
                  const AttentionOptions& opt) {
  const double scale = attention_scale(q, opt);
  if (opt.softcap <= 0) {
    // Training's case on the CPU: by query blocks, skipping the masked half (blocked_attention.h),
    // and with packed rows the keys before each block's earliest sample. bf16 runs it in fp32 on
    // widened q, k, v, its output rounded once. bf16 block GEMMs are faster (5.1-5.4 ms against
    // 8.5 ms per ~100M layer at 128-row blocks on a 2-core AMX Xeon, build/bench_attention) but
    // round the scores to bf16 before the softmax, which a GPU's flash kernel does not; ATen's
    // bf16 flash kernel takes 9.9 ms.
    bool blocked = false;
    const at::Tensor allowed = blocked_mask(q, kk, mask, &blocked);
    // gpt-oss's sinks there too (blocked_attention.h).
    if (blocked && (is_causal || allowed.defined())) {
      if (q.scalar_type() == at::kFloat)
        return blocked_causal_attention(q, kk, vv, scale, 64, std::nullopt, allowed, opt.sinks);
      const at::ScalarType f32 = at::kFloat;
      return blocked_causal_attention(q.to(f32), kk.to(f32), vv.to(f32), scale, 64, std::nullopt, allowed, opt.sinks)
          .to(q.scalar_type());
    }
    if (!opt.sinks.defined()) {  // SDPA has no sinks: those take the eager path below
      const std::optional<at::Tensor> m = mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
      return at::scaled_dot_product_attention(q, kk, vv, m, 0.0, is_causal, scale);
    }
  }
  at::Tensor s = at::matmul(q, kk.transpose(2, 3)) * scale;  // [b, heads, seq, total]
  if (opt.softcap > 0) s = at::tanh(s / opt.softcap) * opt.softcap;
  if (is_causal) mask = causal_window_mask(q.size(2), kk.size(2), 0, q.options());
  if (mask.defined()) s = s.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  if (opt.sinks.defined()) return at::matmul(sink_softmax(s, opt.sinks), vv);
  return at::matmul(at::softmax(s, -1, at::kFloat).to(q.scalar_type()), vv);  // [b, heads, seq, d]
}

// A decode step under inference mode (one query per sequence: generation) through
// ops::decode_attention, K/V read in place; undefined where that does not apply. allowed: the
// keys each row may see, [b, total] bool, or undefined for all, narrowed here by the window.
at::Tensor attend_one_query(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor allowed,
                            const AttentionOptions& opt) {
  if (!c10::InferenceMode::is_enabled() || q.size(2) != 1 || opt.sinks.defined()) return {};
  const int64_t total = k.size(2);
  if (opt.window > 0 && opt.window < total) {
    const at::Tensor w = causal_window_mask(1, total, opt.window, q.options());  // [1, total]
    allowed = allowed.defined() ? allowed.logical_and(w) : w;
  }
  return ops::decode_attention(q, k, v, allowed, attention_scale(q, opt), opt.softcap);
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionOptions& opt) {
  const int64_t heads = q.size(1), seq = q.size(2), total = k.size(2);
  if (heads % k.size(1) != 0) throw std::invalid_argument("causal_attention: kv heads must divide query heads");
  if (at::Tensor out = attend_one_query(q, k, v, {}, opt); out.defined()) return out;
  const int64_t n_rep = heads / k.size(1);
  at::Tensor kk = repeat_kv(k, n_rep), vv = repeat_kv(v, n_rep);  // [b, heads, total, d]
  // A window no query can exceed is no window.
  const int64_t window = opt.window > 0 && opt.window < total ? opt.window : 0;
  if (total == seq && window == 0) return attend(q, kk, vv, {}, /*is_causal=*/true, opt);
  if (seq == 1 && window == 0) return attend(q, kk, vv, {}, false, opt);  // one new token sees all
  // SDPA's is_causal aligns the mask top-left; with a cache the queries are the *last* seq
  // positions, so query i may see keys up to (total - seq) + i.
  return attend(q, kk, vv, causal_window_mask(seq, total, window, q.options()), false, opt);
}

at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& attn_mask, const AttentionOptions& opt) {
  const int64_t b = q.size(0), heads = q.size(1), seq = q.size(2), total = k.size(2);
  if (heads % k.size(1) != 0) throw std::invalid_argument("masked_attention: kv heads must divide query heads");
  if (total < seq) throw std::invalid_argument("masked_attention: keys must cover at least the query positions");
  if (attn_mask.scalar_type() != at::kBool || attn_mask.dim() != 3 || attn_mask.size(0) != b ||
      attn_mask.size(1) != seq || attn_mask.size(2) != total) {
    throw std::invalid_argument("masked_attention: attn_mask must be bool [batch, seq, keys] = [" + std::to_string(b) +
                                ", " + std::to_string(seq) + ", " + std::to_string(total) + "], got " +
                                c10::str(attn_mask.sizes()) + " " + c10::toString(attn_mask.scalar_type()));
  }
  if (seq == 1)
    if (at::Tensor out = attend_one_query(q, k, v, attn_mask.squeeze(1), opt); out.defined()) return out;
  const int64_t n_rep = heads / k.size(1);
  at::Tensor kk = repeat_kv(k, n_rep), vv = repeat_kv(v, n_rep);  // [b, heads, total, d]
  // [b, 1, s, total]: one mask per row, shared by all heads. Not is_causal: the mask already holds
  // the causal structure (and SDPA rejects is_causal together with an explicit mask). The window
  // hides only keys too far back (j > position - window), as transformers' sliding_window_overlay:
  // keys ahead that the mask allows (an image's tokens seeing each other) stay.
  at::Tensor mask = attn_mask.unsqueeze(1);
  if (opt.window > 0 && opt.window < total)
    mask = mask.logical_and(at::ones({seq, total}, q.options().dtype(at::kBool)).triu(total - seq - opt.window + 1));
  return attend(q, kk, vv, mask, /*is_causal=*/false, opt);
}

}  // namespace qlora::modules
