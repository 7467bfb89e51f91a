#include "qlora/modules/gated_delta_net.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/conv1d.h>
#include <ATen/ops/full.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softplus.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "qlora/modules/rms_norm.h"
#include "qlora/ops/gated_delta_ops.h"

namespace qlora::modules {
namespace {

// The log decay of a sample's last padding slot: exp of it flushes to 0 in the chunked rule (it
// flushes anything below -80), so the state entering the next sample is zero, and the chunk's other
// slots keep their own decays exactly (the slot is the chunk's last; cumsum only reaches it).
constexpr double kResetLogDecay = -1e4;

// Causal depthwise conv (kernel K, no bias) then SiLU. x: [n, L, C] -> [n, L, C] contiguous.
// window (optional): the K - 1 inputs before x ([n, C, K - 1]; undefined: zeros), replaced by the
// last K - 1 inputs of (window, x).
at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& weight, at::Tensor* window) {
  const int64_t n = x.size(0), c = x.size(2), k = weight.size(2);
  at::Tensor xt = x.transpose(1, 2);  // [n, C, L]
  if (k > 1) {
    const at::Tensor prev = window && window->defined() ? window->to(x.scalar_type())
                                                        : at::zeros({n, c, k - 1}, x.options());
    xt = at::cat({prev, xt}, 2);  // [n, C, K - 1 + L]
    if (window) *window = xt.narrow(2, xt.size(2) - (k - 1), k - 1).contiguous();
  }
  const at::Tensor y = at::conv1d(xt, weight.to(x.scalar_type()), std::optional<at::Tensor>(), at::IntArrayRef{1},
                                  at::IntArrayRef{0}, at::IntArrayRef{1}, /*groups=*/c);  // [n, C, L]
  return at::silu(y).transpose(1, 2).contiguous();
}

// [b, s, ...] -> [1, total, ...] in the layout of `sg` (zeros in the padding slots).
at::Tensor lay_out(const at::Tensor& t, const Segments& sg) {
  at::Tensor flat = t.flatten(0, 1);  // [b * s, ...]
  std::vector<int64_t> zero_shape = flat.sizes().vec();
  zero_shape[0] = 1;
  flat = at::cat({flat, at::zeros(zero_shape, flat.options())}, 0);
  return flat.index_select(0, sg.gather).unsqueeze(0);
}

// One token of the rule from `state` (the definition, transformers' recurrent form), for generation.
// q, k [n, 1, Hk, dk], v [n, 1, Hv, dv], g and beta [n, 1, Hv], state [n, Hv, dk, dv] fp32.
std::pair<at::Tensor, at::Tensor> recurrent_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta,
                                                 const at::Tensor& state) {
  const int64_t rep = v.size(2) / k.size(2), dk = k.size(3);
  const auto f32 = [](const at::Tensor& t) { return t.select(1, 0).to(at::kFloat); };  // [n, H, ...]
  at::Tensor qq = f32(q).repeat_interleave(rep, 1), kk = f32(k).repeat_interleave(rep, 1);
  qq = qq * at::rsqrt((qq * qq).sum(-1, true) + 1e-6) / std::sqrt(static_cast<double>(dk));
  kk = kk * at::rsqrt((kk * kk).sum(-1, true) + 1e-6);
  at::Tensor s = state * f32(g).exp().unsqueeze(-1).unsqueeze(-1);  // [n, Hv, dk, dv]
  const at::Tensor kv = (s * kk.unsqueeze(-1)).sum(-2);                 // [n, Hv, dv]
  const at::Tensor delta = (f32(v) - kv) * f32(beta).unsqueeze(-1);
  s = s + kk.unsqueeze(-1) * delta.unsqueeze(-2);
  const at::Tensor o = (s * qq.unsqueeze(-1)).sum(-2);  // [n, Hv, dv]
  return {o.unsqueeze(1).to(q.scalar_type()), s};
}

}  // namespace

Segments segments_from_positions(const at::Tensor& positions, int64_t conv_kernel) {
  const at::Tensor pos = positions.to(at::kCPU).contiguous();
  const int64_t b = pos.size(0), s = pos.size(1), chunk = ops::kGatedDeltaChunk;
  const auto acc = pos.accessor<int64_t, 2>();
  std::vector<int64_t> gather, scatter(static_cast<size_t>(b * s));
  std::vector<int64_t> resets;
  const auto close = [&](int64_t len) {  // pads the sample just laid out
    const int64_t padded = (len + std::max<int64_t>(conv_kernel - 1, 1) + chunk - 1) / chunk * chunk;
    gather.insert(gather.end(), static_cast<size_t>(padded - len), b * s);
    resets.push_back(static_cast<int64_t>(gather.size()) - 1);
  };
  for (int64_t r = 0; r < b; ++r) {
    int64_t len = 0;
    for (int64_t t = 0; t < s; ++t) {
      if (t > 0 && acc[r][t] == 0) {
        close(len);
        len = 0;
      }
      scatter[static_cast<size_t>(r * s + t)] = static_cast<int64_t>(gather.size());
      gather.push_back(r * s + t);
      ++len;
    }
    close(len);
  }
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  Segments sg;
  sg.gather = at::tensor(gather, i64).to(positions.device());
  sg.scatter = at::tensor(scatter, i64).to(positions.device());
  at::Tensor reset = at::zeros({static_cast<int64_t>(gather.size())}, at::TensorOptions().dtype(at::kBool));
  reset.index_fill_(0, at::tensor(resets, i64), true);
  sg.reset = reset.to(positions.device());
  return sg;
}

at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, double eps) {
  const at::Tensor y = rms_norm(o, weight, eps);  // weight * normed, as HF's RMSNorm orders it
  return (y.to(at::kFloat) * at::silu(z.to(at::kFloat))).to(o.scalar_type());
}

at::Tensor gated_delta_net_forward(const DecoderLayer& layer, const LayerDims& dims, const at::Tensor& x,
                                   bool training, LayerCache* cache, const Segments* segments) {
  if (cache && segments) throw std::invalid_argument("gated_delta_net_forward: packed rows cannot use a cache");
  const GatedDeltaDims& gd = dims.gated_delta;
  const int64_t b = x.size(0), s = x.size(1);
  const std::vector<at::Tensor> p = lora_linear_group_forward(
      {&layer.in_proj_qkv, &layer.in_proj_z, &layer.in_proj_b, &layer.in_proj_a}, x, training);
  at::Tensor qkv = p[0];                   // [b, s, conv channels]
  at::Tensor beta = at::sigmoid(p[2]);     // [b, s, Hv]
  // fp32 whatever the compute dtype (transformers: A_log.float(), a.float() + dt_bias).
  at::Tensor g = -layer.A_log.to(at::kFloat).exp() * at::softplus(p[3].to(at::kFloat) + layer.dt_bias);
  if (segments) {
    qkv = lay_out(qkv, *segments);  // [1, total, ...]
    beta = lay_out(beta, *segments);
    g = lay_out(g, *segments).masked_fill(segments->reset.view({1, -1, 1}), kResetLogDecay);
  }
  const int64_t n = qkv.size(0), len = qkv.size(1);
  const at::Tensor mixed = causal_conv_silu(qkv, layer.conv1d, cache ? &cache->conv : nullptr);  // [n, L, C]
  const int64_t kd = gd.key_dim(), vd = gd.value_dim();
  const at::Tensor q = mixed.narrow(-1, 0, kd).view({n, len, gd.num_key_heads, gd.key_head_dim});
  const at::Tensor k = mixed.narrow(-1, kd, kd).view({n, len, gd.num_key_heads, gd.key_head_dim});
  const at::Tensor v = mixed.narrow(-1, 2 * kd, vd).view({n, len, gd.num_value_heads, gd.value_head_dim});
  at::Tensor o;  // [n, L, Hv, dv]
  if (cache && cache->state.defined() && len == 1) {
    std::tie(o, cache->state) = recurrent_step(q, k, v, g, beta, cache->state);
  } else {
    at::Tensor final_state;
    std::tie(o, final_state) = ops::chunk_gated_delta_rule(q, k, v, g, beta, cache ? cache->state : at::Tensor(),
                                                           cache != nullptr, /*use_qk_l2norm=*/true);
    if (cache) cache->state = final_state;
  }
  if (segments) o = o.squeeze(0).index_select(0, segments->scatter);  // [b * s, Hv, dv]
  o = o.reshape({b, s, gd.num_value_heads, gd.value_head_dim});
  const at::Tensor z = p[1].view({b, s, gd.num_value_heads, gd.value_head_dim});
  const at::Tensor normed = gated_rms_norm(o, z, layer.linear_norm, dims.rms_norm_eps).reshape({b, s, vd});
  return lora_linear_forward(layer.out_proj, normed, training);  // [b, s, hidden]
}

}  // namespace qlora::modules
