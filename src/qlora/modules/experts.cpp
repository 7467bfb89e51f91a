// The routed experts of a Mixture-of-Experts layer (experts.h), as one autograd node.
//
// Design. The T*k (token, slot) pairs are sorted by expert (a stable sort, so each expert's rows
// come in token order and every run sums the same way), and each expert that received rows runs
// as a plain gated MLP on its gathered rows: its gate_up product into its slice of one [S, 2*inter]
// buffer (S = T*k, grouped order), act(gate) * up (SwiGLU, gelu-tanh: ExpertActivation), its down
// product into its slice of [S, hidden]. The frozen products of all experts are one call
// (frozen_products): NF4 weights through ops/grouped_matmul_ops.h, whose kernel decodes each
// expert's NF4 tiles into cache inside the product (no dequantized copy of a weight is ever
// written); a weight it does not take (a shape or layout off its tiles, another device, dense
// experts) goes expert by expert through nf4_linear's chunks or BLAS. Each expert's adapter is
// then added in x's dtype through the narrow kernels (ops/narrow_ops.h). The routing weights and
// the sum over the k slots follow transformers' grouped_mm_experts_forward to the rounding.
// Backward walks the experts again: the down product's gradient is formed from the unweighted
// output gradient, so the routing weight's gradient <g_t, y_tj> is the dot of it with the
// activations (no extra GEMM, no saved y), and only then are the rows scaled by their weights.
// Experts without rows are skipped (never decoded), so the cost follows the tokens, not E. What is
// alike for every expert is done once for all rows, not expert by expert (a few small ops each,
// 128 experts a layer): the gathers of x's and the output gradient's rows, the activations and
// their gradients, the adapters' cast to x's dtype, the routing weights' gradient, and x's
// gradient, summed per token after the experts in the order index_add_ expert after expert would
// sum it (the same roundings).
#include "qlora/modules/experts.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "qlora/modules/lora_linear.h"
#include "qlora/modules/nf4_linear.h"
#include "qlora/ops/decode_matmul_ops.h"
#include "qlora/ops/grouped_matmul_ops.h"
#include "qlora/ops/narrow_ops.h"
#include "qlora/ops/swiglu_ops.h"

namespace qlora::modules {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The T*k slots grouped by expert: slot s = t * k + j is at position p of the grouped order where
// perm[p] = s; expert e's slots are positions [offsets[e], offsets[e] + counts[e]), in increasing s.
struct ExpertSlots {
  at::Tensor perm;  // [S] int64, on index's device
  std::vector<int64_t> counts, offsets;
  int64_t k = 1;

  // The token of every row, grouped order, [S] int64: expert e's are rows [offsets[e], offsets[e] + counts[e]).
  at::Tensor rows() const { return at::div(perm, k, "floor"); }
  // Calls f(e, offset, count) for every expert with rows, in increasing e.
  template <class Fn> void for_used(Fn&& f) const {
    for (size_t e = 0; e < counts.size(); ++e)
      if (counts[e] > 0) f(static_cast<int64_t>(e), offsets[e], counts[e]);
  }
  // The first expert with rows (0 where none has any).
  size_t first_used() const {
    const auto it = std::find_if(counts.begin(), counts.end(), [](int64_t c) { return c > 0; });
    return it == counts.end() ? 0 : static_cast<size_t>(it - counts.begin());
  }
};

ExpertSlots slots_from(at::Tensor perm, std::vector<int64_t> counts, int64_t k) {
  ExpertSlots s{std::move(perm), std::move(counts), {}, k};
  int64_t off = 0;
  for (int64_t c : s.counts) {
    s.offsets.push_back(off);
    off += c;
  }
  return s;
}

ExpertSlots group_slots(const at::Tensor& index, int64_t num_experts) {
  const at::Tensor flat = index.reshape(-1);
  at::Tensor perm = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor counts = at::bincount(flat, {}, num_experts).to(at::kCPU).to(at::kLong).contiguous();
  const int64_t* c = counts.data_ptr<int64_t>();
  return slots_from(std::move(perm), std::vector<int64_t>(c, c + num_experts), index.size(1));
}

// One expert's frozen weight of one projection: NF4, or dense in the compute dtype.
struct ExpertWeight {
  Nf4Tensor nf4;
  at::Tensor dense;
};

// Expert e's adapter of one projection: A [r, in], B [out, r] (fp32), and in backward the slices of
// the stacked gradients its gradients go to; all undefined without adapters.
struct ExpertAdapter {
  at::Tensor a, b, grad_a, grad_b;
  double scale = 0.0;
};

// One projection's adapters for every expert in the compute dtype, converted once per pass rather
// than expert by expert: A [r * E, in] as it stands, B [E, out, r] (expert e's B contiguous, as
// B_e.to(dtype) gives it). Undefined where the adapters already have that dtype (the experts then
// take views of them, which the products read in place).
struct CastAdapters {
  at::Tensor a, b;
};

CastAdapters cast_adapters(at::TensorList adapters, size_t first, int64_t num_experts, at::ScalarType dtype) {
  if (adapters.empty() || adapters[first].scalar_type() == dtype) return {};
  const at::Tensor& b = adapters[first + 1];
  const int64_t out = b.size(0), r = b.size(1) / num_experts;
  at::Tensor b_cast = at::empty({num_experts, out, r}, b.options().dtype(dtype));
  b_cast.copy_(b.view({out, r, num_experts}).permute({2, 0, 1}));
  return {adapters[first].to(dtype), b_cast};
}

ExpertAdapter adapter_of(at::TensorList adapters, size_t first, int64_t num_experts, int64_t e, double scale,
                         const CastAdapters& cast = {}) {
  if (adapters.empty()) return {};
  if (cast.a.defined()) return {expert_lora_a(cast.a, num_experts, e), cast.b.select(0, e), {}, {}, scale};
  return {expert_lora_a(adapters[first], num_experts, e), expert_lora_b(adapters[first + 1], num_experts, e), {}, {},
          scale};
}

// One projection's frozen products for every expert with rows, [S, ...] in grouped order: y = x2
// @ W_e^T (transposed: x2 @ W_e) on expert e's rows. NF4 weights in one grouped call where the
// kernel takes them (ops/grouped_matmul_ops.h: tiles decoded inside the product), else expert by
// expert: NF4 dequantized just in time by nf4_linear's chunks, or the dense weight, through BLAS.
// ws: every expert's weight (undefined where the expert has no rows).
void frozen_products(const std::vector<ExpertWeight>& ws, const ExpertSlots& slots, const at::Tensor& x2,
                     bool transposed, at::Tensor y) {
  if (ws[slots.first_used()].nf4.defined()) {
    std::vector<const Nf4Tensor*> nf4(ws.size());
    for (size_t e = 0; e < ws.size(); ++e) nf4[e] = &ws[e].nf4;
    if (ops::grouped_nf4_matmul_out(x2, slots.counts, nf4, transposed, y)) return;
  }
  const at::ScalarType lt = x2.scalar_type();
  for (size_t e = 0; e < ws.size(); ++e) {
    const int64_t off = slots.offsets[e], n = slots.counts[e];
    if (n == 0) continue;
    const ExpertWeight& w = ws[e];
    const at::Tensor xe = x2.narrow(0, off, n);
    at::Tensor ye = y.narrow(0, off, n);
    if (transposed && w.nf4.defined()) grad_times_nf4_out(xe, w.nf4, ye, /*accumulate=*/false);
    else if (transposed) at::mm_out(ye, xe, w.dense.to(lt));
    else if (w.nf4.defined()) nf4_times_transposed_out(xe, w.nf4, ye);
    else if (!decode_rows(xe) || !ops::decode_matmul_out(xe, w.dense, ye)) at::mm_out(ye, xe, w.dense.to(lt).t());
  }
}

// Adds an expert's adapter to its frozen product y [n, out]: scale * (x2 @ A^T) @ B^T, whose x2 @ A^T
// is written to xa [n, r] (kept for backward). Nothing without an adapter.
void add_adapter(const at::Tensor& x2, const ExpertAdapter& ad, at::Tensor y, at::Tensor xa) {
  if (!ad.a.defined()) return;
  const at::ScalarType lt = x2.scalar_type();
  ops::narrow_product_out(xa, x2, ad.a.to(lt).t());
  ops::narrow_update_(y, xa, ad.b.to(lt).t(), ad.scale);
}

// Back through add_adapter for the output gradient g [n, out]: gx [n, in] (holding g's product with
// the frozen weight, when defined) += scale * (g @ B) @ A, and the adapter's gradients for the
// output gradient g * rw (rw [n, 1] the rows' routing weights, undefined: 1) into ad.grad_a /
// ad.grad_b. x2: the projection's input rows, xa: x2 @ A^T as forward kept it, times rw in g's
// dtype where rw is defined ((xa * rw).to(g's dtype), formed for all experts at once by the caller).
void adapter_backward(const at::Tensor& g, const at::Tensor& x2, const at::Tensor& xa, const ExpertAdapter& ad,
                      const at::Tensor& rw, at::Tensor gx) {
  if (!ad.a.defined()) return;
  const at::ScalarType lt = g.scalar_type();
  const at::Tensor gxa = ops::narrow_product(g, ad.b.to(lt), ad.scale);  // [n, r]
  if (gx.defined()) ops::narrow_update_(gx, gxa, ad.a.to(lt));
  if (ad.grad_b.defined()) {
    ad.grad_b.copy_(ops::narrow_reduction(xa, g, ad.scale).t());  // [out, r]
  }
  if (ad.grad_a.defined()) ad.grad_a.copy_(ops::narrow_reduction(rw.defined() ? (gxa * rw).to(lt) : gxa, x2));
}

// The experts' activation (experts.h, ExpertActivation) and its constants, as forward saves them.
struct Activation {
  ExpertActivation kind = ExpertActivation::kSwiglu;
  double alpha = 0.0, limit = 0.0;
};

Activation activation_of(const Experts& ex) { return {ex.activation, ex.alpha, ex.limit}; }

void save_activation(AutogradContext* ctx, const Activation& a) {
  ctx->saved_data["act"] = static_cast<int64_t>(a.kind);
  ctx->saved_data["alpha"] = a.alpha;
  ctx->saved_data["limit"] = a.limit;
}

Activation load_activation(AutogradContext* ctx) {
  return {static_cast<ExpertActivation>(ctx->saved_data["act"].toInt()), ctx->saved_data["alpha"].toDouble(),
          ctx->saved_data["limit"].toDouble()};
}

// act(gate, up) [n, inter] in their dtype. SwiGLU through ops/swiglu_ops.h; gelu-tanh as
// transformers' GELUTanh then the product, each rounded to the operands' dtype (Gemma 4's experts).
at::Tensor activate(const Activation& a, const at::Tensor& gate, const at::Tensor& up) {
  switch (a.kind) {
    case ExpertActivation::kSwiglu: break;
    case ExpertActivation::kGeluTanh: return at::gelu(gate, "tanh") * up;
    case ExpertActivation::kClampedSwiglu: {  // GptOssExperts._apply_gate, op for op
      const at::Tensor g = gate.clamp_max(a.limit), u = up.clamp(-a.limit, a.limit);
      return (u + 1) * (g * at::sigmoid(g * a.alpha));
    }
  }
  return ops::swiglu(gate, up);
}

// Back through activate for its output gradient: (d gate, d up) in gate's dtype. The clamped form in
// fp32, rounded once: clamp passes the gradient where its input is within its bounds, ends included
// (as torch's clamp backward), and d/dg of g * sigmoid(alpha g) is s + alpha g s (1 - s).
std::pair<at::Tensor, at::Tensor> activate_backward(const Activation& a, const at::Tensor& grad, const at::Tensor& gate,
                                                    const at::Tensor& up) {
  switch (a.kind) {
    case ExpertActivation::kSwiglu: break;
    case ExpertActivation::kGeluTanh:  // as autograd forms them from the forward's ops
      return {at::gelu_backward(grad * up, gate, "tanh"), grad * at::gelu(gate, "tanh")};
    case ExpertActivation::kClampedSwiglu: {
      const at::Tensor d = grad.to(at::kFloat), gf = gate.to(at::kFloat), uf = up.to(at::kFloat);
      const at::Tensor g = gf.clamp_max(a.limit), s = at::sigmoid(g * a.alpha);
      const at::Tensor dup = (d * (g * s)).masked_fill(uf.abs() > a.limit, 0.0);
      const at::Tensor dgate = (d * (uf.clamp(-a.limit, a.limit) + 1) * (s + a.alpha * g * s * (1 - s)))
                                   .masked_fill(gf > a.limit, 0.0);
      return {dgate.to(gate.scalar_type()), dup.to(gate.scalar_type())};
    }
  }
  return ops::swiglu_backward(grad, gate, up);
}

std::string weight_key(const char* proj, int64_t e) { return std::string(proj) + std::to_string(e) + "."; }

// Expert e's weight of a projection ("gate_up" / "down"), from the experts (forward) or as forward
// saved it (backward; ctx->saved_data).
ExpertWeight weight_of(const Experts& ex, int64_t e, bool gate_up) {
  if (ex.nf4()) return {gate_up ? ex.gate_up_nf4[e] : ex.down_nf4[e], {}};
  return {{}, gate_up ? ex.gate_up_dense[e] : ex.down_dense[e]};
}

void save_weight(AutogradContext* ctx, const ExpertWeight& w, const std::string& key) {
  if (w.nf4.defined()) save_nf4(ctx, w.nf4, key);
  else ctx->saved_data[key + "dense"] = w.dense;
}

ExpertWeight load_weight(AutogradContext* ctx, const std::string& key) {
  if (ctx->saved_data.count(key + "dense") > 0) return {{}, ctx->saved_data.at(key + "dense").toTensor()};
  return {load_nf4(ctx, key), {}};
}

// One projection's weights of every expert with rows (others undefined): from the experts (forward)
// or as forward saved them (backward).
std::vector<ExpertWeight> weights_of(const Experts& ex, const ExpertSlots& slots, bool gate_up) {
  std::vector<ExpertWeight> ws(slots.counts.size());
  slots.for_used([&](int64_t e, int64_t, int64_t) { ws[e] = weight_of(ex, e, gate_up); });
  return ws;
}

std::vector<ExpertWeight> load_weights(AutogradContext* ctx, const ExpertSlots& slots, const char* proj) {
  std::vector<ExpertWeight> ws(slots.counts.size());
  slots.for_used([&](int64_t e, int64_t, int64_t) { ws[e] = load_weight(ctx, weight_key(proj, e)); });
  return ws;
}

// Whether an AdaptersDisabled is in scope (LoraLinear::active() of a projection with an adapter).
bool adapters_enabled() {
  LoraLinear probe;
  probe.r = 1;
  return probe.active();
}

// The saved variables of a GroupedExpertsFunction, in order; then the four adapters, or none.
enum ExpertsSaved : size_t {
  kSavedX, kSavedWeights, kSavedPerm, kSavedGateUp, kSavedXaGateUp, kSavedXaDown, kSavedAdapters
};

// grouped_experts' node. Inputs: x [T, hidden], weights [T, k], index [T, k], the adapters (A and B
// of gate_up, then of down, stacked as experts.h says; or none). Saved: x, weights, the grouping (perm; the
// counts in saved_data), each slot's gate/up [S, 2*inter] and x @ A^T of both adapters [S, r]
// (grouped order), the adapters, and the used experts' frozen weights (NF4 buffers by reference).
struct GroupedExpertsFunction : public torch::autograd::Function<GroupedExpertsFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weights,
                            const at::Tensor& index, at::TensorList adapters, const Experts* experts) {
    RECORD_USER_SCOPE("qlora::grouped_experts");
    const Experts& ex = *experts;
    const ExpertSlots slots = group_slots(index, ex.num_experts);
    const int64_t n_slots = index.numel(), inter = ex.inter, r = adapters.empty() ? 0 : ex.r;
    at::Tensor gu = at::empty({n_slots, 2 * inter}, x.options()), y = at::empty({n_slots, ex.hidden}, x.options());
    at::Tensor xa_gu = at::empty({n_slots, r}, x.options()), xa_down = at::empty({n_slots, r}, x.options());
    run_experts(ctx, ex, x, adapters, slots, gu, y, xa_gu, xa_down);
    std::vector<at::Tensor> saved = {x, weights, slots.perm, gu, xa_gu, xa_down};
    saved.insert(saved.end(), adapters.begin(), adapters.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["counts"] = slots.counts;
    ctx->saved_data["k"] = slots.k;
    ctx->saved_data["scale"] = ex.scale;
    save_activation(ctx, activation_of(ex));
    if (ex.down_bias.defined()) ctx->saved_data["down_bias"] = ex.down_bias;
    return combine(y, weights, slots.perm, x.scalar_type());
  }

  // Every expert's rows (grouped order): gate_up into gu, the activation of all rows, down into y;
  // x @ A^T of both adapters into xa_gu / xa_down (all [S, ...]); the used experts' frozen weights
  // saved for backward. x's rows are gathered for all experts at once (freed before the down products).
  static void run_experts(AutogradContext* ctx, const Experts& ex, const at::Tensor& x, at::TensorList adapters,
                          const ExpertSlots& slots, const at::Tensor& gu, const at::Tensor& y, const at::Tensor& xa_gu,
                          const at::Tensor& xa_down) {
    const int64_t inter = ex.inter;
    const std::vector<ExpertWeight> w_gu = weights_of(ex, slots, true), w_down = weights_of(ex, slots, false);
    project(ex, w_gu, slots, x.index_select(0, slots.rows()), adapters, 0, ex.gate_up_bias, gu, xa_gu);
    const at::Tensor act = activate(activation_of(ex), gu.narrow(1, 0, inter), gu.narrow(1, inter, inter));
    project(ex, w_down, slots, act, adapters, 2, ex.down_bias, y, xa_down);
    slots.for_used([&](int64_t e, int64_t, int64_t) {
      save_weight(ctx, w_gu[e], weight_key("gate_up", e));
      save_weight(ctx, w_down[e], weight_key("down", e));
    });
  }

  // One projection of every expert on its rows of in [S, ...]: the frozen products into out (one
  // grouped call), then each expert's adapter (adapters[first], [first + 1], cast to in's dtype once;
  // its in @ A^T into xa) and bias (bias[e], where defined).
  static void project(const Experts& ex, const std::vector<ExpertWeight>& ws, const ExpertSlots& slots,
                      const at::Tensor& in, at::TensorList adapters, size_t first, const at::Tensor& bias,
                      const at::Tensor& out, const at::Tensor& xa) {
    frozen_products(ws, slots, in, /*transposed=*/false, out);
    const CastAdapters cast = cast_adapters(adapters, first, ex.num_experts, in.scalar_type());
    slots.for_used([&](int64_t e, int64_t off, int64_t n) {
      add_adapter(in.narrow(0, off, n), adapter_of(adapters, first, ex.num_experts, e, ex.scale, cast),
                  out.narrow(0, off, n), xa.narrow(0, off, n));
      if (bias.defined()) out.narrow(0, off, n).add_(bias[e]);
    });
  }

  // As transformers' grouped_mm_experts_forward: each slot's output (x's dtype) times its weight in
  // the promoted dtype, back in slot order, the k slots of a token summed (fp32 accumulation), one
  // rounding to x's dtype. y: [S, hidden] in grouped order.
  static at::Tensor combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& perm,
                            at::ScalarType dtype) {
    const at::Tensor weighted = y * weights.reshape(-1).index_select(0, perm).unsqueeze(1);  // [S, hidden]
    const at::Tensor in_slot_order = at::empty_like(weighted).index_copy_(0, perm, weighted);
    return in_slot_order.view({weights.size(0), weights.size(1), y.size(1)}).sum(1).to(dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_USER_SCOPE("qlora::grouped_experts");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[kSavedX];
    const at::Tensor& weights = saved[kSavedWeights];
    const ExpertSlots slots =
        slots_from(saved[kSavedPerm], ctx->saved_data["counts"].toIntVector(), ctx->saved_data["k"].toInt());
    const at::TensorList adapters = at::TensorList(saved).slice(kSavedAdapters);
    const auto E = static_cast<int64_t>(slots.counts.size());
    variable_list result(4 + adapters.size());  // x, weights, index, the adapters, the experts (none)
    for (size_t i = 0; i < adapters.size(); ++i)
      if (ctx->needs_input_grad(3 + i)) result[3 + i] = at::zeros_like(adapters[i]);
    const at::Tensor& grad_out = grad_outputs[0];
    const at::Tensor& gu = saved[kSavedGateUp];  // [S, 2 * inter]
    const int64_t inter = gu.size(1) / 2;
    // What every expert's rows need, formed for all rows at once (grouped order) instead of expert
    // by expert: the output gradient's and x's rows, the activations as forward had them, the
    // down adapter's x @ A^T times the routing weights, the adapters in the compute dtype.
    GroupedBackward g;
    const at::Tensor rows = slots.rows();
    g.grad_out = grad_out.index_select(0, rows);  // [S, hidden]
    if (!adapters.empty()) {
      g.x = x.index_select(0, rows);
      g.xa_down_w = (saved[kSavedXaDown] * weights.reshape(-1).index_select(0, slots.perm).unsqueeze(1)).to(
          grad_out.scalar_type());
    }
    g.act = activate(load_activation(ctx), gu.narrow(1, 0, inter), gu.narrow(1, inter, inter));  // [S, inter]
    g.w = weights.reshape(-1).index_select(0, slots.perm);
    g.cast_gu = cast_adapters(adapters, 0, E, gu.scalar_type());
    g.cast_down = cast_adapters(adapters, 2, E, grad_out.scalar_type());
    // The routing weights' gradient per slot: one dot product of two rows each, of d act before
    // the weight (kept for all rows) and act.
    if (ctx->needs_input_grad(1)) g.dact = at::empty({gu.size(0), inter}, gu.options());
    // With down biases, <g_t, y_tj> also holds <g_t, b_e>: taken now, before dx's rows overwrite g's.
    const at::Tensor bias_dots = g.dact.defined() ? down_bias_dots(ctx, g.grad_out, slots.counts) : at::Tensor();
    // x's gradient rows, grouped order, summed per token after the experts; an expert writes its
    // rows over its rows of the output gradient, which it has then used (nothing reads them again).
    if (ctx->needs_input_grad(0))
      g.dx = g.grad_out.scalar_type() == gu.scalar_type() ? g.grad_out
                                                          : at::empty({gu.size(0), x.size(1)}, gu.options());
    backward_experts(ctx, saved, slots, g, result);
    if (g.dact.defined()) {
      at::Tensor grad_w = routing_weight_grads(g.dact, g.act);  // [S] fp32, grouped order
      if (bias_dots.defined()) grad_w.add_(bias_dots);
      result[1] = at::empty_like(grad_w).index_copy_(0, slots.perm, grad_w).view_as(weights).to(weights.scalar_type());
    }
    if (g.dx.defined()) result[0] = sum_rows_per_token(g.dx, slots.perm, weights.size(0), weights.size(1));
    return result;
  }

  // The backward's per-row tensors, grouped order ([S, ...]; undefined where not needed).
  struct GroupedBackward {
    at::Tensor grad_out, x, xa_down_w, act, w, dact, dx;
    CastAdapters cast_gu, cast_down;
  };

  // <grad_out row, its expert's down bias> per row [S] fp32 (grouped order); undefined without biases.
  static at::Tensor down_bias_dots(AutogradContext* ctx, const at::Tensor& grad_out, const std::vector<int64_t>& counts) {
    if (ctx->saved_data.count("down_bias") == 0) return {};
    const at::Tensor bias = ctx->saved_data.at("down_bias").toTensor();  // [E, hidden]
    const auto E = static_cast<int64_t>(counts.size());
    const at::Tensor experts = at::repeat_interleave(at::arange(E, bias.options().dtype(at::kLong)),
                                                     at::tensor(counts, bias.options().dtype(at::kLong)));
    return (grad_out.to(at::kFloat) * bias.index_select(0, experts).to(at::kFloat)).sum(1);
  }

  // The routing weights' gradients [S] fp32: the fp32 dot of each row of dact and act, a block of
  // rows at a time (the fp32 copies of a block stay under 1 MiB each).
  static at::Tensor routing_weight_grads(const at::Tensor& dact, const at::Tensor& act) {
    const int64_t S = dact.size(0), width = std::max<int64_t>(1, dact.size(1));
    const int64_t block = std::max<int64_t>(1, (int64_t{1} << 18) / width);
    at::Tensor out = at::empty({S}, dact.options().dtype(at::kFloat));
    for (int64_t r0 = 0; r0 < S; r0 += block) {
      const int64_t n = std::min(block, S - r0);
      out.narrow(0, r0, n).copy_((dact.narrow(0, r0, n).to(at::kFloat) * act.narrow(0, r0, n).to(at::kFloat)).sum(1));
    }
    return out;
  }

  // x's gradient [T, hidden] from each row's dx [S, hidden] (grouped order): token t's k rows added
  // into zeros in increasing expert order, which is increasing grouped position, one rounding to
  // x's dtype per addition: what index_add_ expert after expert gives (its bf16 form is a scalar
  // loop), in k vectorised additions.
  static at::Tensor sum_rows_per_token(const at::Tensor& dx, const at::Tensor& perm, int64_t tokens, int64_t k) {
    const int64_t S = perm.numel();
    const at::Tensor pos = at::empty_like(perm).index_copy_(0, perm, at::arange(S, perm.options()));  // slot -> row
    const at::Tensor order = std::get<0>(at::sort(pos.view({tokens, k}), /*dim=*/1)).t().contiguous();  // [k, T]
    at::Tensor out = at::zeros({tokens, dx.size(1)}, dx.options());
    for (int64_t j = 0; j < k; ++j) out.add_(dx.index_select(0, order[j]));
    return out;
  }

  // Expert e's adapters of gate_up and down, with the slices of the stacked gradients (result[3 ..]:
  // gate_up's A, B, down's A, B; defined where needed) their gradients go to.
  static std::pair<ExpertAdapter, ExpertAdapter> expert_adapters(AutogradContext* ctx, at::TensorList adapters,
                                                             const GroupedBackward& g, int64_t E, int64_t e,
                                                             const variable_list& result) {
    const double scale = ctx->saved_data["scale"].toDouble();
    ExpertAdapter gu = adapter_of(adapters, 0, E, e, scale, g.cast_gu), down = adapter_of(adapters, 2, E, e, scale, g.cast_down);
    if (adapters.empty()) return {gu, down};
    auto a = [&](size_t i) { return result[i].defined() ? expert_lora_a(result[i], E, e) : at::Tensor(); };
    auto b = [&](size_t i) { return result[i].defined() ? expert_lora_b(result[i], E, e) : at::Tensor(); };
    gu.grad_a = a(3), gu.grad_b = b(4), down.grad_a = a(5), down.grad_b = b(6);
    return {gu, down};
  }

  // Back through every expert: d act before the routing weights (the unweighted output gradient
  // through the frozen down products, one grouped call, then each expert's adapter) into g.dact
  // where the routing weights need it (d weights[t, j] = <g_t, y_tj> = <g_t @ W_eff, act_tj>, exact
  // for a weight of 0 too, after the experts); the adapters' gradients; x's gradient rows into
  // g.dx (the frozen gate_up products in one grouped call, written over the output gradient's rows
  // once nothing reads them, then each expert's adapter).
  static void backward_experts(AutogradContext* ctx, const variable_list& saved, const ExpertSlots& slots,
                               const GroupedBackward& g, variable_list& result) {
    const at::TensorList adapters = at::TensorList(saved).slice(kSavedAdapters);
    const auto E = static_cast<int64_t>(slots.counts.size());
    const at::Tensor& gu = saved[kSavedGateUp];  // [S, 2 * inter]
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor dact = g.dact.defined() ? g.dact : at::empty({gu.size(0), inter}, gu.options());
    frozen_products(load_weights(ctx, slots, "down"), slots, g.grad_out, /*transposed=*/true, dact);
    bool gate_up_grads = false;
    slots.for_used([&](int64_t e, int64_t off, int64_t n) {
      const auto [ad_gu, ad_down] = expert_adapters(ctx, adapters, g, E, e, result);
      gate_up_grads = gate_up_grads || ad_gu.grad_a.defined() || ad_gu.grad_b.defined();
      adapter_backward(g.grad_out.narrow(0, off, n), g.act.narrow(0, off, n),
                       adapters.empty() ? at::Tensor() : g.xa_down_w.narrow(0, off, n), ad_down,
                       g.w.narrow(0, off, n).unsqueeze(1), dact.narrow(0, off, n));
    });
    if (!g.dx.defined() && !gate_up_grads) return;
    const at::Tensor dact_w = (dact * g.w.unsqueeze(1)).to(gu.scalar_type());
    auto [dgate, dup] = activate_backward(load_activation(ctx), dact_w, gu.narrow(1, 0, inter), gu.narrow(1, inter, inter));
    const at::Tensor dgu = at::cat({dgate, dup}, 1);  // [S, 2 * inter]
    if (g.dx.defined()) frozen_products(load_weights(ctx, slots, "gate_up"), slots, dgu, /*transposed=*/true, g.dx);
    slots.for_used([&](int64_t e, int64_t off, int64_t n) {
      const ExpertAdapter ad_gu = expert_adapters(ctx, adapters, g, E, e, result).first;
      adapter_backward(dgu.narrow(0, off, n), ad_gu.a.defined() ? g.x.narrow(0, off, n) : at::Tensor(),
                       saved[kSavedXaGateUp].narrow(0, off, n), ad_gu, at::Tensor(),
                       g.dx.defined() ? g.dx.narrow(0, off, n) : at::Tensor());
    });
  }
};

void check_inputs(const Experts& ex, const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("grouped_experts: " + what); };
  if (ex.num_experts <= 0) fail("no experts");
  if (x.dim() != 2 || x.size(1) != ex.hidden) fail("x must be [T, " + std::to_string(ex.hidden) + "]");
  if (index.dim() != 2 || index.size(0) != x.size(0) || index.scalar_type() != at::kLong)
    fail("index must be [T, k] int64 with x's T");
  if (weights.sizes() != index.sizes() || !at::isFloatingType(weights.scalar_type()))
    fail("weights must be floating point of index's shape [T, k]");
  const at::Device dev = ex.nf4() ? ex.gate_up_nf4[0].device() : ex.gate_up_dense[0].device();
  if (index.device() != x.device() || weights.device() != x.device() || dev != x.device())
    fail("x, index, weights and the experts must be on one device");
  if (ex.gate_up_bias.defined() && ex.gate_up_bias.sizes() != at::IntArrayRef({ex.num_experts, 2 * ex.inter}))
    fail("gate_up_bias must be [" + std::to_string(ex.num_experts) + ", " + std::to_string(2 * ex.inter) + "]");
  if (ex.down_bias.defined() && ex.down_bias.sizes() != at::IntArrayRef({ex.num_experts, ex.hidden}))
    fail("down_bias must be [" + std::to_string(ex.num_experts) + ", " + std::to_string(ex.hidden) + "]");
  if (index.numel() > 0 && (index.min().item<int64_t>() < 0 || index.max().item<int64_t>() >= ex.num_experts))
    fail("index out of [0, " + std::to_string(ex.num_experts) + ")");
}

// Checks one expert's two weight shapes against the first's and fills the experts' sizes from it.
void check_expert_shapes(Experts& ex, const std::vector<int64_t>& gu, const std::vector<int64_t>& down, size_t e) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument("experts: expert " + std::to_string(e) + ": " + what);
  };
  if (gu.size() != 2 || down.size() != 2) fail("weights must be 2-D");
  if (e == 0) {
    if (gu[0] % 2 != 0) fail("gate_up's rows must be even (gate's, then up's)");
    ex.inter = gu[0] / 2;
    ex.hidden = gu[1];
  }
  if (gu != std::vector<int64_t>{2 * ex.inter, ex.hidden} || down != std::vector<int64_t>{ex.hidden, ex.inter})
    fail("gate_up must be [" + std::to_string(2 * ex.inter) + ", " + std::to_string(ex.hidden) + "] and down [" +
         std::to_string(ex.hidden) + ", " + std::to_string(ex.inter) + "]");
}

void check_counts(size_t gate_up, size_t down) {
  if (gate_up == 0 || gate_up != down)
    throw std::invalid_argument("experts: need as many gate_up as down weights, at least one");
}

}  // namespace

std::vector<at::Tensor> Experts::trainable() const {
  if (!has_lora()) return {};
  return {gate_up_a, gate_up_b, down_a, down_b};
}

Experts experts_nf4(std::vector<Nf4Tensor> gate_up, std::vector<Nf4Tensor> down) {
  check_counts(gate_up.size(), down.size());
  Experts ex;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    gate_up[e].validate("experts gate_up " + std::to_string(e));
    down[e].validate("experts down " + std::to_string(e));
    check_expert_shapes(ex, gate_up[e].shape, down[e].shape, e);
  }
  ex.num_experts = static_cast<int64_t>(gate_up.size());
  ex.gate_up_nf4 = std::move(gate_up);
  ex.down_nf4 = std::move(down);
  return ex;
}

Experts experts_dense(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down) {
  check_counts(gate_up.size(), down.size());
  Experts ex;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    check_expert_shapes(ex, gate_up[e].sizes().vec(), down[e].sizes().vec(), e);
    gate_up[e] = gate_up[e].detach();
    down[e] = down[e].detach();
  }
  ex.num_experts = static_cast<int64_t>(gate_up.size());
  ex.gate_up_dense = std::move(gate_up);
  ex.down_dense = std::move(down);
  return ex;
}

namespace {

// The stacked A of one projection, [r * E, in], drawn whole from gen exactly as lora_linear_add_adapter
// draws a LoRA A (kaiming_uniform, a = sqrt(5): its bound depends on `in` alone), as peft draws its
// lora_A of r * E rows.
at::Tensor experts_draw_a(int64_t num_experts, int64_t r, int64_t in, const at::Generator& gen) {
  LoraLinear one;  // only its sizes: lora_linear_add_adapter's draw, on the CPU
  one.in_features = in;
  one.out_features = 1;
  lora_linear_add_adapter(one, r * num_experts, 1.0, 0.0, gen, at::kCPU);
  return one.lora_a.detach();
}

// Expert e's adapter of one projection as a LoraLinear (A, B, scale), for lora_merged_weight.
LoraLinear expert_as_lora(const at::Tensor& a, const at::Tensor& b, int64_t e, const Experts& ex) {
  if (!ex.has_lora()) throw std::invalid_argument("experts_merged: the experts have no adapters");
  if (e < 0 || e >= ex.num_experts) throw std::invalid_argument("experts_merged: no expert " + std::to_string(e));
  LoraLinear l;
  l.lora_a = expert_lora_a(a, ex.num_experts, e);
  l.lora_b = expert_lora_b(b, ex.num_experts, e);
  l.r = ex.r;
  l.scale = ex.scale;
  l.in_features = l.lora_a.size(1);
  l.out_features = l.lora_b.size(0);
  return l;
}

}  // namespace

void experts_add_adapters(Experts& ex, int64_t r, double scale, at::Generator gen, at::Device device) {
  if (r <= 0) throw std::invalid_argument("experts: rank r must be positive, got " + std::to_string(r));
  const at::NoGradGuard no_grad;
  const at::Tensor gu_a = experts_draw_a(ex.num_experts, r, ex.hidden, gen);
  const at::Tensor down_a = experts_draw_a(ex.num_experts, r, ex.inter, gen);
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  ex.gate_up_a = gu_a.to(device).set_requires_grad(true);
  ex.gate_up_b = at::zeros({2 * ex.inter, r * ex.num_experts}, fp32).set_requires_grad(true);
  ex.down_a = down_a.to(device).set_requires_grad(true);
  ex.down_b = at::zeros({ex.hidden, r * ex.num_experts}, fp32).set_requires_grad(true);
  ex.r = r;
  ex.scale = scale;
}

at::Tensor grouped_experts(const Experts& experts, const at::Tensor& x, const at::Tensor& index,
                           const at::Tensor& weights) {
  check_inputs(experts, x, index, weights);
  std::vector<at::Tensor> adapters;
  if (experts.has_lora() && adapters_enabled())
    adapters = {experts.gate_up_a, experts.gate_up_b, experts.down_a, experts.down_b};
  return GroupedExpertsFunction::apply(x, weights, index, at::TensorList(adapters), &experts);
}

at::Tensor expert_lora_a(const at::Tensor& stacked_a, int64_t num_experts, int64_t e) {
  const int64_t r = stacked_a.size(0) / num_experts;
  return stacked_a.narrow(0, e * r, r);
}

at::Tensor expert_lora_b(const at::Tensor& stacked_b, int64_t num_experts, int64_t e) {
  return stacked_b.view({stacked_b.size(0), stacked_b.size(1) / num_experts, num_experts}).select(2, e);
}

at::Tensor interleave_gate_up(const at::Tensor& t, int64_t dim) {
  const int64_t half = t.size(dim) / 2;
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  return at::stack({t.narrow(d, 0, half), t.narrow(d, half, half)}, d + 1).flatten(d, d + 1);
}

at::Tensor deinterleave_gate_up(const at::Tensor& t, int64_t dim) {
  const int64_t n = t.size(dim);
  return at::cat({t.slice(dim, 0, n, 2), t.slice(dim, 1, n, 2)}, dim);
}

at::Tensor experts_merged_gate_up(const Experts& experts, int64_t e, const at::Tensor& base) {
  return lora_merged_weight(expert_as_lora(experts.gate_up_a, experts.gate_up_b, e, experts), base);
}

at::Tensor experts_merged_down(const Experts& experts, int64_t e, const at::Tensor& base) {
  return lora_merged_weight(expert_as_lora(experts.down_a, experts.down_b, e, experts), base);
}

}  // namespace qlora::modules
