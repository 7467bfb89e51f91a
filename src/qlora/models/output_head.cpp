#include "qlora/models/output_head.h"

#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/core/Reduction.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

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

// The loss of every chunk and, with `grads`, the gradients of their sum wrt h, lora_x and the
// head's adapters (undefined for those that need none).
struct ChunkedLoss {
  at::Tensor loss, h, x, a, b;
};

// Labels to score per chunk of `chunk` rows, on the CPU: [ceil(N / chunk)] int64.
at::Tensor labels_per_chunk(const at::Tensor& labels, int64_t chunk) {
  const int64_t n = labels.size(0), k = (n + chunk - 1) / chunk;
  const at::Tensor valid = at::constant_pad_nd(labels.ne(kIgnoreIndex).to(at::kLong), {0, k * chunk - n});
  return valid.view({k, chunk}).sum(1).cpu();
}

// Rows [s, s + n) of t as a leaf of the chunk's own graph; undefined stays undefined.
at::Tensor chunk_leaf(const at::Tensor& t, int64_t s, int64_t n, bool grad) {
  if (!t.defined()) return t;
  at::Tensor c = t.narrow(0, s, n).detach();
  return grad ? c.requires_grad_(true) : c;
}

ChunkedLoss chunk_loop(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x, const at::Tensor& labels,
                       int64_t chunk, bool grads) {
  const modules::LoraLinear& l = *head.proj;
  ChunkedLoss out;
  modules::LoraLinear leaf = l;  // the adapters as leaves of each chunk's graph, sharing their storage
  OutputHead local = head;
  local.proj = &leaf;
  auto zeros_if = [grads](const at::Tensor& t) { return grads && wants_grad(t) ? at::zeros_like(t) : at::Tensor(); };
  out.h = zeros_if(h);  // rows of unscored tokens keep a zero gradient
  out.x = zeros_if(lora_x);
  if (l.has_lora()) {
    out.a = zeros_if(l.lora_a);
    out.b = zeros_if(l.lora_b);
    leaf.lora_a = l.lora_a.detach().requires_grad_(out.a.defined());
    leaf.lora_b = l.lora_b.detach().requires_grad_(out.b.defined());
  }
  at::AutoGradMode mode(grads);
  out.loss = at::zeros({}, h.options().dtype(at::kFloat));
  const at::Tensor counts = labels_per_chunk(labels, chunk);
  const int64_t* count = counts.const_data_ptr<int64_t>();
  for (int64_t s = 0, c = 0; s < h.size(0); s += chunk, ++c) {
    if (count[c] == 0) continue;  // nothing to score: zero loss, zero gradient
    const int64_t n = std::min(chunk, h.size(0) - s);
    const at::Tensor hc = chunk_leaf(h, s, n, out.h.defined()), xc = chunk_leaf(lora_x, s, n, out.x.defined());
    const at::Tensor loss = at::cross_entropy_loss(output_logits(local, hc, xc), labels.narrow(0, s, n), {},
                                                   at::Reduction::Sum, kIgnoreIndex);  // logits [n, vocab]
    out.loss.add_(loss.detach());
    auto rows = [s, n](const at::Tensor& t) { return t.defined() ? t.narrow(0, s, n) : t; };
    std::vector<at::Tensor> leaves, sums;  // each leaf's gradient adds into its sum
    for (auto [leaf_t, sum] :
         {std::pair{hc, rows(out.h)}, {xc, rows(out.x)}, {leaf.lora_a, out.a}, {leaf.lora_b, out.b}}) {
      if (!sum.defined()) continue;
      leaves.push_back(leaf_t);
      sums.push_back(sum);
    }
    if (leaves.empty()) continue;
    const variable_list g = torch::autograd::grad({loss}, leaves);
    for (size_t i = 0; i < g.size(); ++i) sums[i].add_(g[i]);
  }
  return out;
}

// The chunked loss as one autograd node over h, lora_x and the head's adapters; its backward
// scales the gradients chunk_loop computed by the incoming one (the loss is a scalar).
struct ChunkedLossFunction : public torch::autograd::Function<ChunkedLossFunction> {
  // a, b: the head's adapters, inputs so that autograd routes their gradients; chunk_loop reads them from head.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& lora_x,
                            const at::Tensor& /*a*/, const at::Tensor& /*b*/, const at::Tensor& labels,
                            const OutputHead& head, int64_t chunk) {
    // Without an adapter lora_x, a and b are empty placeholders (autograd takes no undefined inputs).
    const at::Tensor x = head.proj->has_lora() ? lora_x : at::Tensor();
    ChunkedLoss r = chunk_loop(head, h, x, labels, chunk, /*grads=*/true);
    for (auto [name, g] : {std::pair{"h", r.h}, {"x", r.x}, {"a", r.a}, {"b", r.b}})
      if (g.defined()) ctx->saved_data[name] = g;
    return r.loss;  // []
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& go = grad_outputs[0];  // [] fp32
    auto scaled = [&](const char* name) {
      if (!ctx->saved_data.count(name)) return at::Tensor();
      const at::Tensor g = ctx->saved_data[name].toTensor();
      return (g * go).to(g.scalar_type());
    };
    return {scaled("h"), scaled("x"), scaled("a"), scaled("b"), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_loss_args(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x, const at::Tensor& labels) {
  const modules::LoraLinear& l = *head.proj;
  if (h.dim() != 2 || h.size(1) != l.in_features)
    throw std::invalid_argument("output loss: hidden states must be [tokens, " + std::to_string(l.in_features) +
                                "], got " + c10::str(h.sizes()));
  if (labels.dim() != 1 || labels.size(0) != h.size(0) || labels.scalar_type() != at::kLong)
    throw std::invalid_argument("output loss: labels must be int64 [" + std::to_string(h.size(0)) + "], got " +
                                c10::str(labels.sizes()));
  if (lora_x.defined() != l.has_lora() || (lora_x.defined() && lora_x.sizes() != h.sizes()))
    throw std::invalid_argument("output loss: the LoRA input must be given exactly when the head has an adapter, "
                                "shaped like the hidden states");
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
  if (l.has_lora()) y = (y + modules::lora_update(l, lora_x)).to(h.scalar_type());
  if (head.softcap != 0.0) y = at::tanh(y / head.softcap) * head.softcap;
  return y.to(at::kFloat);
}

int64_t default_loss_chunk_tokens(int64_t vocab) {
  return std::max<int64_t>(1, kLossChunkBytes / (std::max<int64_t>(vocab, 1) * int64_t{4}));
}

at::Tensor chunked_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                              const at::Tensor& labels, int64_t chunk_tokens) {
  check_loss_args(head, h, lora_x, labels);
  if (chunk_tokens < 1) throw std::invalid_argument("output loss: chunk_tokens must be >= 1");
  const modules::LoraLinear& l = *head.proj;
  const bool grads = at::GradMode::is_enabled() && (wants_grad(h) || wants_grad(lora_x) ||
                                                    (l.has_lora() && (wants_grad(l.lora_a) || wants_grad(l.lora_b))));
  if (!grads) return chunk_loop(head, h, lora_x, labels, chunk_tokens, /*grads=*/false).loss;
  const at::Tensor none = at::empty({0}, h.options());
  return l.has_lora() ? ChunkedLossFunction::apply(h, lora_x, l.lora_a, l.lora_b, labels, head, chunk_tokens)
                      : ChunkedLossFunction::apply(h, none, none, none, labels, head, chunk_tokens);
}

at::Tensor full_token_loss(const OutputHead& head, const at::Tensor& h, const at::Tensor& lora_x,
                           const at::Tensor& labels) {
  check_loss_args(head, h, lora_x, labels);
  return at::cross_entropy_loss(output_logits(head, h, lora_x), labels, {}, at::Reduction::Sum,
                                kIgnoreIndex);  // logits [N, vocab]
}

}  // namespace qlora::models
