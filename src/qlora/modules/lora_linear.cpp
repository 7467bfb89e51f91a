#include "qlora/modules/lora_linear.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/addcmul.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/modules/nf4_linear.h"
#include "qlora/ops/decode_matmul_ops.h"
#include "qlora/ops/narrow_ops.h"

namespace qlora::modules {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Members = std::vector<const LoraLinear*>;

// The adapters a LoraGroupFunction saved: nothing (bases alone), or x, x @ A^T, n A's and n B's.
int64_t adapters_saved(const variable_list& saved) {
  return saved.empty() ? 0 : (static_cast<int64_t>(saved.size()) - 2) / 2;
}

// Where member i of a group sits: its columns [off, off + out) of the side-by-side output, and its
// adapter's rank columns [roff, roff + r) of x @ [A_0; A_1; ...]^T (r == 0: no adapter).
struct Span {
  int64_t off = 0, out = 0, roff = 0, r = 0;
  double scale = 0.0;
};

std::vector<Span> spans_of(const std::vector<int64_t>& outs, const std::vector<int64_t>& ranks,
                           const std::vector<double>& scales) {
  std::vector<Span> spans(outs.size());
  int64_t off = 0, roff = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    spans[i] = {off, outs[i], roff, ranks[i], scales[i]};
    off += outs[i];
    roff += ranks[i];
  }
  return spans;
}

// The members' biases side by side ([sum of out], zeros for a member without one) in x2's dtype,
// for their stacked GEMM; undefined where no member has one.
at::Tensor group_bias(const Members& m, const std::vector<Span>& spans, const at::TensorOptions& opt) {
  bool any = false;
  for (const LoraLinear* l : m) any = any || l->bias.defined();
  if (!any) return {};
  at::Tensor bias = at::zeros({spans.back().off + spans.back().out}, opt);
  for (size_t i = 0; i < m.size(); ++i)
    if (m[i]->bias.defined()) bias.narrow(0, spans[i].off, spans[i].out).copy_(m[i]->bias);
  return bias;
}

// The members' base outputs side by side, [T, sum of out] in x2's dtype, biases added (inside the
// GEMM where the base is NF4 and the bias in x2's dtype, as nn.Linear's addmm): small NF4
// weights stacked into one GEMM, others by their own (chunked) products into column slices.
at::Tensor group_base(const at::Tensor& x2, const Members& m, const std::vector<Span>& spans) {
  const at::ScalarType dt = x2.scalar_type();
  if (m[0]->base_nf4.defined() && !decode_rows(x2)) {  // a decode step: each member's own kernel call below
    std::vector<const Nf4Tensor*> ws;
    for (const LoraLinear* l : m) ws.push_back(&l->base_nf4);
    const at::Tensor stacked = nf4_stacked(ws, dt);  // [O, in] or undefined
    RECORD_USER_SCOPE("qlora::base_linear");        // a phase of bench_train_step's profile
    if (stacked.defined()) {
      const at::Tensor bias = group_bias(m, spans, x2.options());
      return bias.defined() ? at::addmm(bias, x2, stacked.t()) : at::mm(x2, stacked.t());
    }
  }
  at::Tensor y = at::empty({x2.size(0), spans.back().off + spans.back().out}, x2.options());
  for (size_t i = 0; i < m.size(); ++i) {
    at::Tensor yi = y.narrow(1, spans[i].off, spans[i].out);
    const at::Tensor& b = m[i]->bias;
    const bool fused = m[i]->base_nf4.defined() && b.defined() && b.scalar_type() == dt;
    if (m[i]->base_nf4.defined()) nf4_times_transposed_out(x2, m[i]->base_nf4, yi, fused ? b : at::Tensor());
    else if (!decode_rows(x2) || !ops::decode_matmul_out(x2, m[i]->base_dense, yi))
      at::mm_out(yi, x2, m[i]->base_dense.to(dt).t());
    if (b.defined() && !fused) yi.add_(b);
  }
  return y;
}

// sum_i g_i @ W_i -> [T, in], g_i [T, out_i] each member's output gradient: the base weights
// dequantized again (none was kept; the small NF4 ones stacked in one buffer), each product
// accumulated into the sum inside its GEMM (no concatenated gradient, no separate adds).
at::Tensor group_base_grad(AutogradContext* ctx, const std::vector<at::Tensor>& g, const std::vector<Span>& spans,
                           int64_t in) {
  const bool nf4 = ctx->saved_data.count("w0.codes") > 0;
  std::vector<Nf4Tensor> ws;
  std::vector<const Nf4Tensor*> ptrs;
  for (size_t i = 0; nf4 && i < spans.size(); ++i) ws.push_back(load_nf4(ctx, "w" + std::to_string(i) + "."));
  for (const Nf4Tensor& w : ws) ptrs.push_back(&w);
  const at::Tensor stacked = nf4 ? nf4_stacked(ptrs, g[0].scalar_type()) : at::Tensor();  // [O, in] or undefined
  RECORD_USER_SCOPE("qlora::base_linear");  // a phase of bench_train_step's profile
  at::Tensor gx = at::empty({g[0].size(0), in}, g[0].options());
  for (size_t i = 0; i < spans.size(); ++i) {
    const double beta = i > 0 ? 1.0 : 0.0;  // 0: gx's fresh contents ignored
    if (stacked.defined()) gx.addmm_(g[i], stacked.narrow(0, spans[i].off, spans[i].out), beta);
    else if (nf4) grad_times_nf4_out(g[i], ws[i], gx, i > 0);
    else gx.addmm_(g[i], ctx->saved_data.at("dense" + std::to_string(i)).toTensor().to(g[i].scalar_type()), beta);
  }
  return gx;
}

// Projections that read one input (q/k/v, gate/up, or a single one) as one autograd node, each
// base(x) + scale * (x @ A^T) @ B^T, for adapters without dropout. Forward: the bases as one GEMM
// (small NF4 weights stacked), x @ [A_0; A_1; ...]^T as one, each update accumulated into its
// member's columns inside its GEMM. Backward: x's gradient summed over the members inside the
// GEMMs back through the bases and one GEMM through the stacked A's (no per-member [T, in] sums),
// the B and A gradients. Saved: x and x @ A^T [T, sum of r]; the bases are dequantized again. The
// adapters compute in x's dtype (bf16: bf16 GEMMs with fp32 accumulation, as under autocast); their
// weights and gradients stay fp32.
// Outputs: one per member, [..., out_i] (views into the side-by-side output).
struct LoraGroupFunction : public torch::autograd::Function<LoraGroupFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList as, at::TensorList bs,
                               const Members* members) {
    RECORD_USER_SCOPE("qlora::lora_linear");  // a phase of bench_train_step's profile
    const Members& m = *members;
    const int64_t in = m[0]->in_features;
    std::vector<int64_t> outs, ranks;
    std::vector<double> scales;
    for (const LoraLinear* l : m) {
      outs.push_back(l->out_features);
      ranks.push_back(l->r);
      scales.push_back(l->scale);
    }
    const std::vector<Span> spans = spans_of(outs, ranks, scales);
    const at::Tensor x2 = x.reshape({-1, in});  // [T, in]
    at::Tensor y = group_base(x2, m, spans);     // [T, O]
    std::vector<at::Tensor> saved;
    if (!as.empty()) {
      // The adapters compute in x's dtype: fp32 through the narrow kernels; bf16 as bf16 GEMMs
      // accumulating in fp32, with bf16 copies of the fp32 A's and B's (r rows each), as autocast
      // does on a GPU. No [T, in] or [T, out] activation is converted.
      const at::ScalarType lt = x.scalar_type();
      const at::Tensor xa = ops::narrow_product(x2, at::cat(as).to(lt).t());  // [T, R]
      for (size_t i = 0, j = 0; i < spans.size(); ++i) {
        const Span& s = spans[i];
        if (s.r > 0) ops::narrow_update_(y.narrow(1, s.off, s.out), xa.narrow(1, s.roff, s.r), bs[j++].to(lt).t(), s.scale);
      }
      saved = {x, xa};
      saved.insert(saved.end(), as.begin(), as.end());
      saved.insert(saved.end(), bs.begin(), bs.end());
    }
    ctx->save_for_backward(saved);
    for (size_t i = 0; i < m.size(); ++i) {
      if (m[i]->base_nf4.defined()) save_nf4(ctx, m[i]->base_nf4, "w" + std::to_string(i) + ".");
      else ctx->saved_data["dense" + std::to_string(i)] = m[i]->base_dense;
    }
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["outs"] = outs;
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["scales"] = scales;
    variable_list result;
    for (const Span& s : spans) {
      std::vector<int64_t> sizes = x.sizes().vec();
      sizes.back() = s.out;
      result.push_back(y.narrow(1, s.off, s.out).view(sizes));
    }
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_USER_SCOPE("qlora::lora_linear");
    const variable_list saved = ctx->get_saved_variables();
    const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const std::vector<Span> spans = spans_of(ctx->saved_data["outs"].toIntVector(),
                                             ctx->saved_data["ranks"].toIntVector(),
                                             ctx->saved_data["scales"].toDoubleVector());
    const int64_t in = x_sizes.back(), tokens = c10::multiply_integers(x_sizes) / in, n = adapters_saved(saved);
    at::TensorOptions opt;  // of the gradients that arrived
    for (const at::Tensor& go : grad_outputs)
      if (go.defined()) opt = go.options();
    std::vector<at::Tensor> parts;  // each member's output gradient [T, out] (zeros where unused)
    for (size_t i = 0; i < spans.size(); ++i) {
      parts.push_back(grad_outputs[i].defined() ? grad_outputs[i].reshape({tokens, spans[i].out})
                                                : at::zeros({tokens, spans[i].out}, opt));
    }
    variable_list result(static_cast<size_t>(2 + 2 * n));  // x, the A's, the B's, the members
    // x may need no gradient (the first layer's input comes from the frozen embedding).
    at::Tensor gx = ctx->needs_input_grad(0) ? group_base_grad(ctx, parts, spans, in) : at::Tensor();  // [T, in]
    if (n > 0) adapter_grads(ctx, saved, parts, spans, gx, result);
    if (gx.defined()) result[0] = gx.view(x_sizes);
    return result;
  }

  // The adapters' gradients into result[1 .. 2n] (A's, then B's), and their part of x's gradient
  // added to gx (when defined). saved: x, x @ A^T, the A's, the B's.
  static void adapter_grads(AutogradContext* ctx, const variable_list& saved, const std::vector<at::Tensor>& g,
                            const std::vector<Span>& spans, at::Tensor& gx, variable_list& result) {
    const int64_t n = adapters_saved(saved);
    const at::Tensor &x = saved[0], &xa = saved[1];
    const at::ScalarType lt = x.scalar_type(), ft = saved[2].scalar_type();  // compute, master weights
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    // g_i @ B_i for each adapter, scaled, side by side [T, R].
    at::Tensor gxa = at::empty_like(xa);
    std::vector<int64_t> roffs;  // adapter j's rows of the stacked A's
    for (size_t i = 0, j = 0; i < spans.size(); ++i) {
      const Span& s = spans[i];
      if (s.r == 0) continue;
      roffs.push_back(s.roff);
      ops::narrow_product_out(gxa.narrow(1, s.roff, s.r), g[i], saved[2 + n + j].to(lt), s.scale);
      if (ctx->needs_input_grad(1 + n + j))
        result[1 + n + j] = ops::narrow_reduction(xa.narrow(1, s.roff, s.r), g[i], s.scale).t().to(ft).contiguous();
      ++j;
    }
    const at::Tensor ga = ops::narrow_reduction(gxa, x2).to(ft);  // [R, in]
    for (int64_t j = 0; j < n; ++j) {
      const at::Tensor& a = saved[2 + j];
      if (ctx->needs_input_grad(1 + j)) result[1 + j] = ga.narrow(0, roffs[j], a.size(0)).clone();
    }
    if (gx.defined()) ops::narrow_update_(gx, gxa, at::cat(at::TensorList(saved).slice(2, n)).to(lt));
  }
};

}  // namespace

namespace {
thread_local bool adapters_disabled = false;
}  // namespace

bool LoraLinear::active() const { return r > 0 && !adapters_disabled; }

AdaptersDisabled::AdaptersDisabled() : was_disabled_(adapters_disabled) { adapters_disabled = true; }
AdaptersDisabled::~AdaptersDisabled() { adapters_disabled = was_disabled_; }

LoraLinear lora_linear_dense(at::Tensor weight) {
  if (weight.dim() != 2) throw std::invalid_argument("lora_linear: base weight must be 2-D [out, in]");
  LoraLinear l;
  l.out_features = weight.size(0);
  l.in_features = weight.size(1);
  l.base_dense = weight.detach();
  return l;
}

LoraLinear lora_linear_nf4(Nf4Tensor weight) {
  if (weight.shape.size() != 2) throw std::invalid_argument("lora_linear: NF4 weight must be 2-D [out, in]");
  LoraLinear l;
  l.out_features = weight.shape[0];
  l.in_features = weight.shape[1];
  l.base_nf4 = std::move(weight);
  return l;
}

void lora_linear_set_bias(LoraLinear& layer, at::Tensor bias) {
  if (bias.dim() != 1 || bias.size(0) != layer.out_features) {
    throw std::invalid_argument("lora_linear: bias must be [out] = [" + std::to_string(layer.out_features) + "]");
  }
  layer.bias = bias.detach();
}

void lora_linear_add_adapter(LoraLinear& layer, int64_t r, double alpha, double dropout,
                             at::Generator gen, at::Device device) {
  if (r <= 0) throw std::invalid_argument("lora: rank r must be positive, got " + std::to_string(r));
  if (!(dropout >= 0.0 && dropout < 1.0)) {
    throw std::invalid_argument("lora: dropout must be in [0, 1), got " + std::to_string(dropout));
  }
  // kaiming_uniform_(a=sqrt(5)) with fan_in = in: gain = sqrt(2 / (1 + 5)), bound =
  // gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(layer.in_features));
  at::Tensor a = at::empty({r, layer.in_features}, at::TensorOptions().dtype(at::kFloat));
  a.uniform_(-bound, bound, gen);  // drawn on CPU so the values do not depend on the device
  layer.lora_a = a.to(device).set_requires_grad(true);
  layer.lora_b = at::zeros({layer.out_features, r}, at::TensorOptions().dtype(at::kFloat).device(device))
                     .set_requires_grad(true);
  layer.r = r;
  layer.scale = alpha / static_cast<double>(r);
  layer.dropout = dropout;
}

double lora_scale(double alpha, int64_t r, bool rslora) {
  return alpha / (rslora ? std::sqrt(static_cast<double>(r)) : static_cast<double>(r));
}

void lora_linear_add_dora(LoraLinear& layer) {
  if (!layer.has_lora()) throw std::invalid_argument("lora_linear_add_dora: the projection has no adapter");
  const at::NoGradGuard no_grad;
  const at::Tensor sq = layer.base_nf4.defined() ? nf4_row_sq_norms(layer.base_nf4)
                                                 : layer.base_dense.to(at::kFloat).square().sum(1);  // [out]
  layer.base_sq_norms = sq.to(layer.lora_a.device());
  layer.magnitude = dora_weight_norm(layer).clone().set_requires_grad(true);
}

at::Tensor dora_weight_norm(const LoraLinear& l) {
  const at::NoGradGuard no_grad;
  const at::Tensor a = l.lora_a.detach(), b = l.lora_b.detach();  // [r, in], [out, r] fp32
  // ||W_i + s (B A)_i||^2 = ||W_i||^2 + 2 s <W_i, (B A)_i> + s^2 ||(B A)_i||^2, where
  // <W_i, (B A)_i> = sum_k B_ik (A W^T)_ki and ||(B A)_i||^2 = (B (A A^T) B^T)_ii.
  const at::Tensor aw = l.base_nf4.defined() ? nf4_times_transposed(a, l.base_nf4)
                                             : at::mm(a, l.base_dense.to(at::kFloat).t());  // [r, out]
  const at::Tensor cross = (b * aw.t()).sum(1);                                   // [out]
  const at::Tensor ba_sq = (at::mm(b, at::mm(a, a.t())) * b).sum(1);               // [out]
  return (l.base_sq_norms + cross * (2.0 * l.scale) + ba_sq * (l.scale * l.scale)).clamp_min(0).sqrt();
}

namespace {

// magnitude / ||W + s B A|| per row, [out] fp32: d/d magnitude flows, the norm is a constant.
at::Tensor dora_row_scale(const LoraLinear& l) { return l.magnitude / dora_weight_norm(l); }

// An adapted output y = x W^T + bias + update rescaled as DoRA's: (y - bias) ⊙ g + bias.
at::Tensor dora_rescaled(const LoraLinear& l, const at::Tensor& y) {
  const at::Tensor g = dora_row_scale(l).to(y.scalar_type());  // [out]
  if (!l.bias.defined()) return y * g;
  return at::addcmul(l.bias - l.bias * g, y, g);
}

}  // namespace

at::Tensor lora_linear_base(const LoraLinear& layer, const at::Tensor& x) {
  if (!layer.base_nf4.defined()) {
    // A decode step (nf4_linear.h's decode_rows): W read in place, not packed by BLAS.
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    if (decode_rows(x2)) {
      std::vector<int64_t> sizes = x.sizes().vec();
      sizes.back() = layer.base_dense.size(0);
      at::Tensor y = at::empty(sizes, x.options()), y2 = y.view({-1, sizes.back()});
      if (ops::decode_matmul_out(x2, layer.base_dense, y2))
        return layer.bias.defined() ? y + layer.bias : y;
    }
    return at::linear(x, layer.base_dense, layer.bias);  // [..., out]
  }
  // A bias in x's dtype goes into the GEMM (as nn.Linear's addmm); another dtype is added after.
  if (!layer.bias.defined() || layer.bias.scalar_type() == x.scalar_type())
    return nf4_linear(x, layer.base_nf4, layer.bias);
  return nf4_linear(x, layer.base_nf4) + layer.bias;
}

namespace {

// Whether the members can run as one LoraGroupFunction: one kind of base over one in_features,
// and no adapter drawing dropout (that path keeps separate nodes).
bool groupable(const std::vector<const LoraLinear*>& m, bool training) {
  for (const LoraLinear* l : m) {
    if (l->in_features != m[0]->in_features || l->base_nf4.defined() != m[0]->base_nf4.defined()) return false;
    if (l->active() && training && l->dropout > 0.0) return false;
  }
  return true;
}

}  // namespace

std::vector<at::Tensor> lora_linear_group_forward(const std::vector<const LoraLinear*>& members,
                                                  const at::Tensor& x, bool training) {
  if (members.empty()) throw std::invalid_argument("lora_linear_group_forward: no projections");
  bool any_lora = false;
  for (const LoraLinear* l : members) any_lora = any_lora || l->active();
  if (!groupable(members, training) || (members.size() == 1 && !any_lora)) {
    std::vector<at::Tensor> ys;
    for (const LoraLinear* l : members) ys.push_back(l->active() ? lora_linear_forward(*l, x, training)
                                                                     : lora_linear_base(*l, x));
    return ys;
  }
  std::vector<at::Tensor> as, bs;
  for (const LoraLinear* l : members) {
    if (!l->active()) continue;
    as.push_back(l->lora_a);
    bs.push_back(l->lora_b);
  }
  std::vector<at::Tensor> ys = LoraGroupFunction::apply(x, at::TensorList(as), at::TensorList(bs), &members);
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i]->active() && members[i]->has_dora()) ys[i] = dora_rescaled(*members[i], ys[i]);
  return ys;
}

at::Tensor lora_linear_forward(const LoraLinear& layer, const at::Tensor& x, bool training) {
  if (layer.active() && !(training && layer.dropout > 0.0)) return lora_linear_group_forward({&layer}, x, training)[0];
  at::Tensor y = lora_linear_base(layer, x);  // [..., out]
  if (!layer.active()) return y;
  if (!layer.has_dora()) return (y + lora_delta(layer, x, training)).to(x.scalar_type());
  // DoRA with dropout, as peft: the dropped-out input also goes through the base, so that
  // y = x W^T + bias + (g - 1) ⊙ x_d W^T + g ⊙ scale·x_d A^T B^T.
  const at::Tensor xd = lora_input(layer, x, training);  // [..., in] fp32
  const at::Tensor g = dora_row_scale(layer);           // [out] fp32
  const at::Tensor based = layer.base_nf4.defined() ? nf4_linear(xd.to(x.scalar_type()), layer.base_nf4)
                                                    : at::linear(xd.to(x.scalar_type()), layer.base_dense);
  return (y + (g - 1.0) * based + g * lora_update(layer, xd)).to(x.scalar_type());
}

at::Tensor lora_input(const LoraLinear& layer, const at::Tensor& x, bool training) {
  at::Tensor h = x.to(layer.lora_a.scalar_type());  // [..., in] fp32, as peft's _cast_input_dtype
  if (training && layer.dropout > 0.0) h = at::dropout(h, layer.dropout, /*train=*/true);
  return h;
}

at::Tensor lora_update(const LoraLinear& layer, const at::Tensor& lora_x) {
  return at::linear(at::linear(lora_x, layer.lora_a), layer.lora_b) * layer.scale;  // [..., out] fp32
}

at::Tensor lora_delta(const LoraLinear& layer, const at::Tensor& x, bool training) {
  return lora_update(layer, lora_input(layer, x, training));
}

at::Tensor lora_merged_weight(const LoraLinear& layer, const at::Tensor& base) {
  const at::Tensor delta =
      at::matmul(layer.lora_b.detach().to(at::kFloat), layer.lora_a.detach().to(at::kFloat));  // [out, in]
  at::Tensor w = base.to(delta.device()).add(delta, layer.scale);
  // DoRA, as peft merges it: the merged rows scaled to magnitude / ||W + delta||.
  if (layer.has_dora()) w.mul_((layer.magnitude.detach().to(at::kFloat) / w.norm(2, {1})).unsqueeze(1));
  return w;
}

}  // namespace qlora::modules
