#include "qlora/ops/grouped_matmul_ops.h"

#include <ATen/ops/_grouped_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <string>

#include "kernels/grouped_nf4_matmul_cpu.h"
#include "qlora/ops/kernel_operands.h"
#include "qlora/ops/nf4_ops.h"

namespace qlora::ops {

namespace {

// A 2-D CPU tensor of x's dtype, `rows` x `cols`, unit stride along its rows.
bool rows_like(const at::Tensor& t, const at::Tensor& x, int64_t rows, int64_t cols) {
  return kernel_dtype(t) && t.scalar_type() == x.scalar_type() && t.dim() == 2 && t.size(0) == rows &&
         t.size(1) == cols && t.stride(1) == 1 && (rows <= 1 || t.stride(0) >= cols);
}

// CUDA: the used experts' weights dequantized a batch at a time into one stacked bf16 buffer of at
// most kCudaStackBytes (never all experts at once), each batch one ATen grouped GEMM (offs: its
// groups' cumulative row ends, int32). bf16 only, the dtype of the device's grouped GEMM. Where
// ATen has no grouped GEMM for this device (it throws), false from then on: the caller's
// per-expert products, which wrote y whole, as after a batch that did run.
constexpr int64_t kCudaStackBytes = int64_t{256} << 20;

bool grouped_mm_cuda(const at::Tensor& x, const std::vector<int64_t>& counts, const std::vector<const Nf4Tensor*>& weights,
                     int64_t N, int64_t K, bool transposed, at::Tensor& y) {
  static std::atomic<bool> unsupported{false};
  if (unsupported || x.scalar_type() != at::kBFloat16 || y.scalar_type() != at::kBFloat16) return false;
  const size_t batch = static_cast<size_t>(std::max<int64_t>(1, kCudaStackBytes / (N * K * 2)));
  try {
    int64_t row0 = 0;
    for (size_t g = 0; g < counts.size();) {
      std::vector<size_t> used;
      std::vector<int32_t> ends;
      int64_t rows = 0;
      for (; g < counts.size() && used.size() < batch; ++g)
        if (counts[g] > 0) used.push_back(g), rows += counts[g], ends.push_back(static_cast<int32_t>(rows));
      if (used.empty()) break;
      at::Tensor stack = at::empty({static_cast<int64_t>(used.size()), N, K}, x.options());
      for (size_t i = 0; i < used.size(); ++i) {
        at::Tensor slot = stack.select(0, static_cast<int64_t>(i));
        nf4_dequantize_out(*weights[used[i]], slot);
      }
      const at::Tensor offs = at::tensor(ends, at::TensorOptions().dtype(at::kInt)).to(x.device(), /*non_blocking=*/true);
      y.narrow(0, row0, rows).copy_(at::_grouped_mm(x.narrow(0, row0, rows), transposed ? stack : stack.transpose(1, 2), offs));
      row0 += rows;
    }
  } catch (const c10::Error&) {
    unsupported = true;
    return false;
  }
  return true;
}

}  // namespace

bool grouped_nf4_matmul_out(const at::Tensor& x, const std::vector<int64_t>& counts,
                            const std::vector<const Nf4Tensor*>& weights, bool transposed, at::Tensor& y) {
  if (counts.size() != weights.size()) return false;
  int64_t rows = 0, N = 0, K = 0;
  std::vector<kernels::Nf4Operand> operands(counts.size());
  std::vector<int64_t> offsets(counts.size());
  for (size_t g = 0; g < counts.size(); ++g) {
    offsets[g] = rows;
    rows += counts[g];
    if (counts[g] == 0) continue;
    const Nf4Tensor& w = *weights[g];
    if (w.shape.size() != 2 || w.device() != x.device()) return false;
    if (N == 0) N = w.shape[0], K = w.shape[1];
    if (w.shape[0] != N || w.shape[1] != K) return false;
    if (x.is_cpu() && !kernels::grouped_nf4_matmul_takes(w.layout, N, K)) return false;
  }
  const int64_t in = transposed ? N : K, out = transposed ? K : N;
  if (N == 0 || x.dim() != 2 || y.dim() != 2 || x.size(0) != rows || y.size(0) != rows || x.size(1) != in ||
      y.size(1) != out)
    return false;
  if (x.is_cuda()) return grouped_mm_cuda(x, counts, weights, N, K, transposed, y);
  if (!rows_like(x, x, rows, in) || !rows_like(y, x, rows, out)) return false;
  RECORD_USER_SCOPE("qlora::grouped_nf4_matmul");
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] == 0) continue;
    weights[g]->validate("grouped matmul weight " + std::to_string(g));
    operands[g] = nf4_operand(*weights[g]);
  }
  kernels::GroupedNf4Matmul p;
  p.groups = static_cast<int64_t>(counts.size()), p.N = N, p.K = K;
  p.weights = operands.data(), p.offsets = offsets.data(), p.counts = counts.data();
  p.transposed = transposed;
  p.dtype = x.scalar_type() == at::kBFloat16 ? nf4::Dtype::BF16 : nf4::Dtype::F32;
  p.x = x.const_data_ptr(), p.ldx = rows > 1 ? x.stride(0) : in;
  p.y = y.mutable_data_ptr(), p.ldy = rows > 1 ? y.stride(0) : out;
  kernels::grouped_nf4_matmul_cpu(p);
  return true;
}

}  // namespace qlora::ops
