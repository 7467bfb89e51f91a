#include "qlora/modules/rope.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/where.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "qlora/ops/rope_ops.h"

namespace qlora::modules {

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

namespace {

// The tables of angles freqs [..., d/2]: cos and sin of [freqs, freqs], times scale, cast last.
RopeTables tables_of(const at::Tensor& freqs, at::ScalarType dtype, double scale) {
  const at::Tensor emb = at::cat({freqs, freqs}, -1);  // [..., d]
  if (scale == 1.0) return {emb.cos().to(dtype), emb.sin().to(dtype)};
  return {(emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)};
}

}  // namespace

RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, at::ScalarType dtype,
                       double scale) {
  // [(b,) seq, d/2]
  return tables_of(positions.unsqueeze(-1).to(at::kFloat) * inv_freq.to(positions.device(), at::kFloat), dtype, scale);
}

RopeTables mrope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, const std::vector<int64_t>& sections,
                        at::ScalarType dtype, double scale) {
  if (positions.dim() != 3 || positions.size(0) != 3 || sections.size() < 3)
    throw std::invalid_argument("mrope_tables: positions must be [3, batch, seq] and mrope_section hold 3 sections");
  const int64_t half = inv_freq.size(0);
  // [3, batch, seq, half]
  const at::Tensor freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq.to(positions.device(), at::kFloat);
  at::Tensor mixed = freqs[0].clone();
  for (int64_t axis = 1; axis <= 2; ++axis) {
    const int64_t end = std::min(3 * sections[axis], half);
    if (end <= axis) continue;
    const at::Tensor idx = at::arange(axis, end, 3, positions.options().dtype(at::kLong));
    mixed.index_copy_(-1, idx, freqs[axis].index_select(-1, idx));
  }
  return tables_of(mixed, dtype, scale);  // [batch, seq, head_dim]
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

}  // namespace qlora::modules
