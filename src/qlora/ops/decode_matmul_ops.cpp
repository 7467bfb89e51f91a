#include "qlora/ops/decode_matmul_ops.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "kernels/decode_matmul_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

namespace {

// A 2-D float32 CPU tensor of `cols` columns with unit stride along its rows.
bool fp32_rows(const at::Tensor& t, int64_t cols) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == cols &&
         (t.size(0) <= 1 || t.stride(0) >= cols) && t.stride(1) == 1;
}

// The call's x and y fields, or false where x [M, K] and y [M, N] do not suit the kernel.
bool operands(const at::Tensor& x, at::Tensor& y, int64_t N, int64_t K, kernels::DecodeMatmul& p) {
  if (K % 16 != 0 || !fp32_rows(x, K) || !fp32_rows(y, N) || x.size(0) != y.size(0)) return false;
  p.N = N, p.K = K, p.M = x.size(0);
  p.x = x.data_ptr<float>(), p.ldx = p.M > 1 ? x.stride(0) : K;
  p.y = y.data_ptr<float>(), p.ldy = p.M > 1 ? y.stride(0) : N;
  return true;
}

}  // namespace

bool decode_matmul_out(const at::Tensor& x, const Nf4Tensor& w, at::Tensor& y) {
  kernels::DecodeMatmul p;
  if (w.shape.size() != 2 || !w.device().is_cpu() || !kernels::decode_matmul_takes_nf4(w.layout, w.shape[0], w.shape[1]) ||
      !operands(x, y, w.shape[0], w.shape[1], p))
    return false;
  RECORD_USER_SCOPE("qlora::decode_matmul");
  w.validate("decode matmul weight");
  p.nf4 = nf4_operand(w);
  kernels::decode_matmul_cpu(p);
  return true;
}

bool decode_matmul_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  kernels::DecodeMatmul p;
  if (w.dim() != 2 || !fp32_rows(w, w.size(1)) || !operands(x, y, w.size(0), w.size(1), p)) return false;
  RECORD_USER_SCOPE("qlora::decode_matmul");
  p.dense = w.data_ptr<float>(), p.ldw = w.size(0) > 1 ? w.stride(0) : w.size(1);
  kernels::decode_matmul_cpu(p);
  return true;
}

}  // namespace qlora::ops
