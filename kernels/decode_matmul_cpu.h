// y = x W^T for few rows of x: the decode steps of generation, where x holds one token per
// sequence (M = the batch's sequences, up to a few dozen) and the product is bound by reading W,
// which BLAS copies into its own layout on every call (sgemm's packing: as many bytes as W per
// step). Here W is read once per call, in place: a dense fp32 W row by row, an NF4 W decoded a few
// rows at a time into a buffer that stays in cache (its values are nf4_dequantize_cpu's) and never
// dequantized whole to memory. fp32 x [M, K] and y [M, N], row-major with row strides ldx, ldy.
// Each output is one dot product summed in a fixed order whatever the thread count (threads split
// W's rows), not BLAS's order: results match x @ W^T to rounding.
#pragma once

#include <cstdint>

#include "kernels/nf4_cpu.h"
#include "quant/nf4_format.h"

namespace qlora::kernels {

struct DecodeMatmul {
  int64_t N = 0, K = 0, M = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  // W: dense fp32 (row stride ldw), or else NF4.
  const float* dense = nullptr;
  int64_t ldw = 0;
  Nf4Operand nf4;
};

// Whether an NF4 W [N, K] suits decode_matmul_cpu: rows of whole blocks (K a multiple of block_size).
bool decode_matmul_takes_nf4(const nf4::Layout& layout, int64_t N, int64_t K);
void decode_matmul_cpu(const DecodeMatmul& p);

}  // namespace qlora::kernels
