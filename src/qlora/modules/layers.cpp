#include "qlora/modules/layers.h"

#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/where.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "qlora/modules/blocked_attention.h"
#include "qlora/modules/gated_delta_net.h"
#include "qlora/ops/decode_attention_ops.h"
#include "qlora/ops/rmsnorm_ops.h"
#include "qlora/ops/rope_ops.h"
#include "qlora/ops/swiglu_ops.h"

namespace qlora::modules {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// RMSNorm with a frozen weight as one autograd node. It keeps x and rstd (not the normed tensor), and
// backward is the analytic gradient, per row, in fp32 (ops/rmsnorm_ops.h: one kernel each way on the
// CPU, where autograd through ATen's chain made ~9 passes over six nodes).
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            int64_t scale) {
    auto [out, rstd] = ops::rms_norm(x, weight, eps, static_cast<RmsScale>(scale));
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const auto scale = static_cast<RmsScale>(ctx->saved_data["scale"].toInt());
    return {ops::rms_norm_backward(grad_outputs[0], saved[0], saved[1], saved[2], scale), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// The node only when it has a gradient to give: without grad mode or a grad-requiring x the plain ops
// record nothing, and a trainable weight (never the case here) keeps autograd's op chain, which
// differentiates both.
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, RmsScale scale) {
  if (!at::GradMode::is_enabled() || !x.requires_grad() || weight.requires_grad()) {
    return ops::rms_norm(x, weight, eps, scale).first;
  }
  return RmsNormFunction::apply(x, weight, eps, static_cast<int64_t>(scale));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x, weight, eps, RmsScale::kWeight);
}

at::Tensor rms_norm_plus_one(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x, weight, eps, RmsScale::kOnePlusWeight);
}

at::Tensor layer_norm(const LayerDims& dims, const at::Tensor& x, const at::Tensor& weight) {
  return rms_norm(x, weight, dims.rms_norm_eps, dims.norm);
}

// Each step is the ATen op transformers' Python expression dispatches to (e.g. `1.0 / t` is
// reciprocal(t) * 1.0, `c / t` is reciprocal(t) * c), in the same order, so the fp32 tables agree
// bit for bit rather than to a tolerance.
at::Tensor rope_inv_freq(int64_t head_dim, double theta,
                         const std::optional<Llama3RopeScaling>& scaling) {
  at::Tensor exponents = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                         head_dim;                                    // [d/2]
  at::Tensor inv_freq = at::reciprocal(at::pow(theta, exponents));   // [d/2] fp32
  if (!scaling) return inv_freq;
  const auto& s = *scaling;
  const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_ctx / s.low_freq_factor;
  const double high_freq_wavelen = old_ctx / s.high_freq_factor;
  at::Tensor wavelen = at::reciprocal(inv_freq) * (2 * M_PI);
  // Long wavelengths (low frequencies) are slowed by `factor`; short ones are kept.
  at::Tensor inv_llama = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  // In between, interpolate linearly in old_ctx / wavelen.
  at::Tensor smooth = (at::reciprocal(wavelen) * s.original_max_position_embeddings - s.low_freq_factor) /
                      (s.high_freq_factor - s.low_freq_factor);
  at::Tensor smoothed = at::rsub(smooth, 1) * inv_llama / s.factor + smooth * inv_llama;
  at::Tensor is_medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return at::where(is_medium, smoothed, inv_llama);
}

namespace {

// transformers' YaRN frequencies: the dimension index at which a wavelength turns `rotations`
// times over the original context, the ramp between beta_fast's and beta_slow's, and the blend.
at::Tensor yarn_inv_freq(int64_t head_dim, double theta, const YarnRope& y) {
  const double dim = static_cast<double>(head_dim);
  const double ctx = static_cast<double>(y.original_max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return dim * std::log(ctx / (rotations * 2 * M_PI)) / (2 * std::log(theta));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // as transformers guards the ramp's division
  const at::Tensor pos_freqs =
      at::pow(theta, at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / head_dim);
  const at::Tensor extrapolation = at::reciprocal(pos_freqs), interpolation = at::reciprocal(pos_freqs * y.factor);
  const at::Tensor ramp = ((at::arange(head_dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  const at::Tensor keep = 1 - ramp;  // the share of the extrapolated (unscaled) frequency
  return interpolation * (1 - keep) + extrapolation * keep;
}

}  // namespace

double rope_attention_scaling(const RopeParams& params) { return params.yarn ? params.yarn->attention_factor : 1.0; }

at::Tensor rope_inv_freq(int64_t head_dim, const RopeParams& params) {
  if (params.yarn) return yarn_inv_freq(head_dim, params.theta, *params.yarn);
  at::Tensor inv_freq = rope_inv_freq(head_dim, params.theta, params.llama3);
  if (params.proportional) {
    // transformers: int(factor * head_dim // 2) rotated angles (Python's float floor division).
    const auto angles = static_cast<int64_t>(std::floor(params.proportional->partial_rotary_factor * head_dim / 2));
    inv_freq.narrow(0, angles, head_dim / 2 - angles).zero_();
  }
  // transformers' linear scaling: inv_freq / factor.
  return params.linear_factor == 1.0 ? inv_freq : inv_freq / params.linear_factor;
}

RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, at::ScalarType dtype,
                       double scale) {
  at::Tensor freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq.to(positions.device(), at::kFloat);  // [(b,) seq, d/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);  // [(b,) seq, d]
  if (scale == 1.0) return {emb.cos().to(dtype), emb.sin().to(dtype)};
  return {(emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)};
}

namespace {

// Rotate-half RoPE as one autograd node: x * cos + rotate_half(x) * sin (transformers' expression,
// the same products and sums), and in backward g * cos + rotate_half^T(g * sin).
struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->saved_data["cos"] = cos;  // frozen tables: constants of the graph
    ctx->saved_data["sin"] = sin;
    return ops::rope(x, cos, sin, -1.0, /*heads_inner=*/false);  // contiguous, as attention reads it
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor cos = ctx->saved_data["cos"].toTensor(), sin = ctx->saved_data["sin"].toTensor();
    // Laid out as the projection's [b, s, heads, d] output, whose gradient it becomes: no copy.
    return {ops::rope(grad_outputs[0], cos, sin, 1.0, /*heads_inner=*/true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
  // Partial rotary (Qwen3.5): the tables cover the first dims of each head; the rest pass through.
  const int64_t rot = rope.cos.size(-1), d = x.size(-1);
  if (rot < d) {
    const RopeTables part = rope;
    return at::cat({apply_rope(x.narrow(-1, 0, rot).contiguous(), part), x.narrow(-1, rot, d - rot)}, -1);
  }
  // [seq, d] tables broadcast against the last two dims of x; per-row [b, seq, d] tables need a
  // heads dim inserted to become [b, 1, seq, d].
  if (rope.cos.dim() == 3) return RopeFunction::apply(x, rope.cos.unsqueeze(1), rope.sin.unsqueeze(1));
  return RopeFunction::apply(x, rope.cos, rope.sin);
}

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

// Scores, optional mask and softmax over expanded K/V (kk, vv [b, heads, total, d]). mask:
// broadcastable to [b, heads, seq, total] bool, or undefined with is_causal (square, top-left).
// Without soft-capping this is SDPA; with it, transformers' eager path: scores * scale, then
// cap * tanh(scores / cap), then the mask, then softmax in fp32.
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
    if (blocked && (is_causal || allowed.defined())) {
      if (q.scalar_type() == at::kFloat) return blocked_causal_attention(q, kk, vv, scale, 64, std::nullopt, allowed);
      const at::ScalarType f32 = at::kFloat;
      return blocked_causal_attention(q.to(f32), kk.to(f32), vv.to(f32), scale, 64, std::nullopt, allowed)
          .to(q.scalar_type());
    }
    const std::optional<at::Tensor> m = mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
    return at::scaled_dot_product_attention(q, kk, vv, m, 0.0, is_causal, scale);
  }
  at::Tensor s = at::matmul(q, kk.transpose(2, 3)) * scale;  // [b, heads, seq, total]
  s = at::tanh(s / opt.softcap) * opt.softcap;
  if (is_causal) mask = causal_window_mask(q.size(2), kk.size(2), 0, q.options());
  if (mask.defined()) s = s.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1, at::kFloat).to(q.scalar_type()), vv);  // [b, heads, seq, d]
}

// A decode step under inference mode (one query per sequence: generation) through
// ops::decode_attention, K/V read in place; undefined where that does not apply. allowed: the
// keys each row may see, [b, total] bool, or undefined for all, narrowed here by the window.
at::Tensor attend_one_query(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor allowed,
                            const AttentionOptions& opt) {
  if (!c10::InferenceMode::is_enabled() || q.size(2) != 1) return {};
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
  // the causal structure (and SDPA rejects is_causal together with an explicit mask).
  at::Tensor mask = attn_mask.unsqueeze(1);
  if (opt.window > 0 && opt.window < total)
    mask = mask.logical_and(causal_window_mask(seq, total, opt.window, q.options()));
  return attend(q, kk, vv, mask, /*is_causal=*/false, opt);
}

std::vector<at::Tensor> DecoderLayer::trainable() const {
  std::vector<at::Tensor> out;
  for (const LoraLinear* p : {&q_proj, &k_proj, &v_proj, &qkv_proj, &o_proj, &in_proj_qkv, &in_proj_z, &in_proj_b,
                              &in_proj_a, &out_proj, &gate_proj, &up_proj, &gate_up_proj, &down_proj,
                              &per_layer_input_gate, &per_layer_projection}) {
    if (p->has_lora()) {
      out.push_back(p->lora_a);
      out.push_back(p->lora_b);
      if (p->has_dora()) out.push_back(p->magnitude);
    }
  }
  return out;
}

namespace {

// silu(gate) * up as one autograd node: one pass forward and one backward on the CPU
// (ops/swiglu_ops.h). Saves gate and up (views of their projections' output), not silu(gate).
struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return ops::swiglu(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto [dg, du] = ops::swiglu_backward(grad_outputs[0], saved[0], saved[1]);
    return {dg, du};
  }
};

}  // namespace

at::Tensor gated_mlp(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x, bool training) {
  at::Tensor gate, up;  // [b, s, inter]
  if (layer.gate_up_proj.out_features > 0) {
    const at::Tensor gu = lora_linear_forward(layer.gate_up_proj, x, training);  // [b, s, 2 * inter]
    const int64_t inter = gu.size(-1) / 2;
    gate = gu.narrow(-1, 0, inter);
    up = gu.narrow(-1, inter, inter);
  } else {
    const std::vector<at::Tensor> gu = lora_linear_group_forward({&layer.gate_proj, &layer.up_proj}, x, training);
    gate = gu[0];
    up = gu[1];
  }
  const at::Tensor act = dims.activation == MlpActivation::kSilu ? SwiGluFunction::apply(gate, up)
                                                                 : at::gelu(gate, "tanh") * up;
  return lora_linear_forward(layer.down_proj, act, training);  // [b, s, hidden]
}

namespace {

// q [b, s, heads, d], k and v [b, s, kv_heads, d], from q/k/v_proj or Phi-3's qkv_proj. A KV-shared
// layer projects q only (k, v undefined); without v_proj (Gemma 4's attention_k_eq_v) v is k's
// projection.
std::array<at::Tensor, 3> project_qkv(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x,
                                      bool training) {
  const int64_t b = x.size(0), s = x.size(1), d = dims.head_dim;
  const int64_t nq = dims.num_heads * d, nkv = dims.num_kv_heads * d;
  at::Tensor q, k, v;
  if (layer.qkv_proj.out_features > 0) {
    const at::Tensor qkv = lora_linear_forward(layer.qkv_proj, x, training);  // [b, s, nq + 2 nkv]
    q = qkv.narrow(-1, 0, nq);
    k = qkv.narrow(-1, nq, nkv);
    v = qkv.narrow(-1, nq + nkv, nkv);
  } else if (layer.kv_shared()) {
    q = lora_linear_forward(layer.q_proj, x, training);
  } else {
    std::vector<const LoraLinear*> projs = {&layer.q_proj, &layer.k_proj};
    if (layer.v_proj.out_features > 0) projs.push_back(&layer.v_proj);
    const std::vector<at::Tensor> qkv = lora_linear_group_forward(projs, x, training);
    q = qkv[0];
    k = qkv[1];
    v = qkv.size() > 2 ? qkv[2] : k;
  }
  const int64_t qd = dims.output_gate ? 2 * d : d;  // Qwen3.5: each head's query, then its gate
  if (!k.defined()) return {q.view({b, s, dims.num_heads, qd}), k, v};
  return {q.view({b, s, dims.num_heads, qd}), k.view({b, s, dims.num_kv_heads, d}), v.view({b, s, dims.num_kv_heads, d})};
}

}  // namespace

void reserve_kv(LayerCache& c, int64_t capacity) {
  if (!c.k.defined() || capacity <= c.k.size(2)) return;
  const auto room = [&](const at::Tensor& t) {
    at::Tensor r = at::empty({t.size(0), t.size(1), capacity, t.size(3)}, t.options());
    r.narrow(2, 0, t.size(2)).copy_(t);
    return r;
  };
  c.k_room = room(c.k);
  c.v_room = room(c.v);
  c.k = c.k_room.narrow(2, 0, c.k.size(2));
  c.v = c.v_room.narrow(2, 0, c.v.size(2));
}

namespace {

// k, v [b, kv_heads, s, d] appended to the layer's cache; returns what attention reads: all of it.
std::pair<at::Tensor, at::Tensor> extend_cache(LayerCache* cache, const at::Tensor& k, const at::Tensor& v) {
  if (!cache) return {k, v};
  if (cache->k.defined()) {
    const int64_t past = cache->k.size(2), s = k.size(2);
    if (cache->k_room.defined() && past + s <= cache->k_room.size(2)) {  // in place, no copy of the past
      cache->k_room.narrow(2, past, s).copy_(k);
      cache->v_room.narrow(2, past, s).copy_(v);
      cache->k = cache->k_room.narrow(2, 0, past + s);
      cache->v = cache->v_room.narrow(2, 0, past + s);
    } else {
      cache->k = at::cat({cache->k, k}, 2);  // [b, kv_heads, past + s, d]
      cache->v = at::cat({cache->v, v}, 2);
      cache->k_room = cache->v_room = at::Tensor();
    }
  } else {
    cache->k = k;
    cache->v = v;
  }
  return {cache->k, cache->v};
}

// The attention mixer over the layer's normed input x [b, s, hidden]: returns o_proj's output.
at::Tensor attention_mixer(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x,
                           const RopeTables& rope, bool training, LayerCache* cache, const at::Tensor& attn_mask,
                           const LayerExtras* extras) {
  const int64_t b = x.size(0), s = x.size(1);
  auto [q, k, v] = project_qkv(layer, dims, x, training);  // [b, s, heads, d]
  at::Tensor gate;                                           // Qwen3.5: [b, s, heads * d]
  if (dims.output_gate) {  // q: [b, s, heads, 2d], each head's query and then its gate
    gate = q.narrow(-1, dims.head_dim, dims.head_dim).reshape({b, s, dims.num_heads * dims.head_dim});
    q = q.narrow(-1, 0, dims.head_dim).contiguous();
  }
  // Before RoPE: per head (Qwen3, Gemma 3: a [head_dim] weight) or over all heads at once (OLMo).
  const auto qk_norm = [&](const at::Tensor& t, const at::Tensor& w) {
    return w.size(0) == t.size(-1) ? layer_norm(dims, t, w) : layer_norm(dims, t.flatten(2), w).view(t.sizes());
  };
  if (layer.q_norm.defined()) q = qk_norm(q, layer.q_norm);
  q = q.transpose(1, 2);  // [b, heads, s, d]
  if (dims.rope) q = apply_rope(q, rope);
  if (layer.kv_shared()) {  // Gemma 4: an earlier layer's K/V, cache included
    if (!extras || !extras->kv || !extras->kv->k.defined())
      throw std::logic_error("decoder_layer_forward: a KV-shared layer needs its source layer's keys and values");
    k = extras->kv->k;
    v = extras->kv->v;
  } else {
    if (layer.k_norm.defined()) k = qk_norm(k, layer.k_norm);
    // Gemma 4: values normed per head without a weight (a unit weight: times 1 is exact).
    if (dims.v_norm) v = layer_norm(dims, v, at::ones({v.size(-1)}, v.options()));
    k = k.transpose(1, 2);  // [b, kv_heads, s, d]
    if (dims.rope) k = apply_rope(k, rope);
    std::tie(k, v) = extend_cache(cache, k, v.transpose(1, 2));
    if (extras && extras->kv) *extras->kv = {k, v};
  }
  const AttentionOptions& ao = dims.attention;
  at::Tensor attn = (attn_mask.defined() ? masked_attention(q, k, v, attn_mask, ao) : causal_attention(q, k, v, ao))
                        .transpose(1, 2)
                        .reshape({b, s, dims.num_heads * dims.head_dim});  // [b, s, heads * d]
  if (gate.defined()) attn = attn * at::sigmoid(gate);
  return lora_linear_forward(layer.o_proj, attn, training);  // [b, s, hidden]
}

// Gemma 4's per-layer input branch over the layer's output h [b, s, hidden]: what it adds to h.
at::Tensor per_layer_branch(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& h,
                            const LayerExtras* extras, bool training) {
  if (!extras || !extras->per_layer_input.defined())
    throw std::logic_error("decoder_layer_forward: a layer with per_layer_input_gate needs its per-layer input");
  const at::Tensor g = lora_linear_forward(layer.per_layer_input_gate, h, training);  // [b, s, per-layer dim]
  const at::Tensor act = dims.activation == MlpActivation::kSilu ? at::silu(g) : at::gelu(g, "tanh");
  const at::Tensor p = lora_linear_forward(layer.per_layer_projection, act * extras->per_layer_input, training);
  return layer_norm(dims, p, layer.post_per_layer_input_norm);  // [b, s, hidden]
}

}  // namespace

at::Tensor decoder_layer_forward(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& h,
                                 const RopeTables& rope, bool training, LayerCache* cache,
                                 const at::Tensor& attn_mask, const Segments* segments, const LayerExtras* extras) {
  // OLMo 2/3 normalise no layer input: their norms close each branch instead.
  const bool post_norms_only = !layer.input_layernorm.defined();
  at::Tensor x = post_norms_only ? h : layer_norm(dims, h, layer.input_layernorm);  // [b, s, hidden]
  at::Tensor out = layer.is_linear() ? gated_delta_net_forward(layer, dims, x, training, cache, segments)
                                     : attention_mixer(layer, dims, x, rope, training, cache, attn_mask, extras);
  // Gemma's sandwich: post_attention_layernorm closes the attention branch, pre_feedforward opens
  // the MLP's. OLMo's closes it and the MLP's input is not normalised. Llama's
  // post_attention_layernorm is the MLP's input norm.
  const bool sandwich = layer.pre_feedforward_layernorm.defined();
  if (sandwich || post_norms_only) out = layer_norm(dims, out, layer.post_attention_layernorm);
  const at::Tensor hidden = h + out;
  if (sandwich) x = layer_norm(dims, hidden, layer.pre_feedforward_layernorm);
  else x = post_norms_only ? hidden : layer_norm(dims, hidden, layer.post_attention_layernorm);
  at::Tensor mlp = gated_mlp(layer, dims, x, training);
  if (layer.post_feedforward_layernorm.defined()) mlp = layer_norm(dims, mlp, layer.post_feedforward_layernorm);
  at::Tensor out_h = hidden + mlp;
  if (layer.per_layer_input_gate.out_features > 0) out_h = out_h + per_layer_branch(layer, dims, out_h, extras, training);
  return layer.layer_scalar.defined() ? out_h * layer.layer_scalar : out_h;
}

namespace {

struct Recompute : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> fn;
  std::vector<at::Tensor> params;  // the leaves fn reads that want gradients (same as the inputs)
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // Runs under no-grad (custom functions' forward always does), so none of fn's activations
  // are kept: only h (saved) and the RNG state.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, at::TensorList params,
                            const c10::intrusive_ptr<Recompute>& recompute) {
    ctx->save_for_backward({h});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(recompute);
    ctx->saved_data["n_params"] = static_cast<int64_t>(params.size());
    at::Generator gen = at::globalContext().defaultGenerator(h.device());
    ctx->saved_data["rng"] = gen.get_state();
    return recompute->fn(h);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor h = ctx->get_saved_variables()[0];
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["fn"].toCapsule());
    const int64_t n_params = ctx->saved_data["n_params"].toInt();
    // Gradients must reach the very leaf tensors fn reads during the replay, so we differentiate
    // with respect to those (kept in the closure), not the forward's input copies.
    at::Tensor h_in = h.detach().requires_grad_(h.requires_grad());
    at::Generator gen = at::globalContext().defaultGenerator(h.device());
    at::Tensor rng_now = gen.get_state();
    gen.set_state(ctx->saved_data["rng"].toTensor());  // replay the forward's dropout masks
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = recompute->fn(h_in);
    }
    gen.set_state(rng_now);
    variable_list inputs;
    std::vector<int64_t> where;  // index in the result of each entry of inputs
    if (h_in.requires_grad()) {
      inputs.push_back(h_in);
      where.push_back(0);
    }
    const std::vector<at::Tensor>& targets = recompute->params;
    for (int64_t i = 0; i < n_params; ++i) {
      if (targets[i].requires_grad()) {
        inputs.push_back(targets[i]);
        where.push_back(1 + i);
      }
    }
    variable_list result(static_cast<size_t>(n_params + 2));
    if (!inputs.empty() && out.requires_grad()) {
      variable_list grads = torch::autograd::grad({out}, inputs, {grad_outputs[0]}, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < grads.size(); ++j) result[where[j]] = grads[j];
    }
    return result;
  }
};

}  // namespace

at::Tensor checkpointed(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& h,
                        const std::vector<at::Tensor>& params) {
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->fn = fn;
  recompute->params = params;
  return CheckpointFunction::apply(h, at::TensorList(params), recompute);
}

}  // namespace qlora::modules
