// Linear layer over a frozen NF4 weight, as an autograd function.
//
// Memory is the point of QLoRA: the weight is dequantized just in time for each matmul and the
// dequantized copy is dropped right after. Backward does not find it saved; it dequantizes again
// to form grad_input. The base weight never gets a gradient (it is frozen and not a graph input).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <string>
#include <vector>

#include "quant/nf4_tensor.h"

namespace qlora::modules {

// y = x @ W^T (+ bias) with W = dequantize(weight) in x's dtype.
// x: [..., in] float32/bfloat16; weight: NF4 of shape [out, in] on x's device; bias (optional):
// frozen, [out], x's dtype, added inside the GEMM (one rounding, as nn.Linear). Returns [..., out].
at::Tensor nf4_linear(const at::Tensor& x, const Nf4Tensor& weight, const at::Tensor& bias = {});

// The two products of an NF4 weight W [out, in] a linear layer runs, W dequantized to the other
// operand's dtype just in time and dropped after: x @ W^T ([..., in] -> [..., out], forward) and
// grad_y @ W ([..., out] -> [..., in], backward). A weight of more than 16M elements (a 7B's MLP)
// goes by chunks of rows (whole scaler groups), so at most ~64 MB of it is ever dequantized at once.
at::Tensor nf4_times_transposed(const at::Tensor& x, const Nf4Tensor& weight, const at::Tensor& bias = {});
at::Tensor grad_times_nf4(const at::Tensor& grad_y, const Nf4Tensor& weight);
// The same on 2-D operands into given outputs, which may be column slices of wider ones (a group
// of projections sharing one input): y [T, out] = x2 [T, in] @ W^T; gx [T, in] = g2 [T, out] @ W,
// added to gx's contents when `accumulate`.
// Under inference mode (generation), products with at most kDecodeRows rows of x (decode steps,
// short prompts) read W as NF4 for all of them (ops::decode_matmul_out), never dequantized to
// memory; otherwise they multiply the dequantized W. Dense frozen weights take the same kernel in
// the same case (LoRA's base, the output head). Only under inference mode: training, evaluation
// and a checkpointed layer's replay keep BLAS's sums, so a forward without grad and its replay
// with grad compute the same bits.
// A bias [out] (x's dtype) goes into the GEMM as addmm's (one rounding, as nn.Linear).
void nf4_times_transposed_out(const at::Tensor& x2, const Nf4Tensor& weight, at::Tensor y, const at::Tensor& bias = {});
inline constexpr int64_t kDecodeRows = 64;
bool decode_rows(const at::Tensor& x2);  // inference mode and 1..kDecodeRows rows
void grad_times_nf4_out(const at::Tensor& g2, const Nf4Tensor& weight, at::Tensor& gx, bool accumulate);
// ||W_i||^2 per row, [out] fp32, W dequantized by the same chunks of rows (for DoRA's norms).
at::Tensor nf4_row_sq_norms(const Nf4Tensor& weight);
// Weights of one in_features dequantized one under the other, [sum of out, in] in dtype, so a group
// of small projections runs as one GEMM; undefined when that is more than the 16M elements a
// chunk may hold (each weight then goes by its own chunks of rows).
at::Tensor nf4_stacked(const std::vector<const Nf4Tensor*>& weights, at::ScalarType dtype);

// The NF4 buffers go into ctx->saved_data as plain IValues (not saved variables): they are
// constants of the graph, and storing them by reference-counted tensor costs no copy. For the
// autograd functions over NF4 weights (this one, lora_linear.cpp's LoraGroupFunction).
// `prefix` tells apart several weights saved by one node.
void save_nf4(torch::autograd::AutogradContext* ctx, const Nf4Tensor& w, const std::string& prefix = "");
Nf4Tensor load_nf4(torch::autograd::AutogradContext* ctx, const std::string& prefix = "");

// The autograd function behind nf4_linear. Saved state (ctx): the NF4 buffers (codes, scalers,
// factors, mean) in saved_data plus its shape/layout as ints; no saved variables at all, since
// grad_input needs only the weight and grad_output. Exposed so tests can inspect what is kept.
struct Nf4LinearFunction : public torch::autograd::Function<Nf4LinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const Nf4Tensor& weight, const std::optional<at::Tensor>& bias);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

}  // namespace qlora::modules
