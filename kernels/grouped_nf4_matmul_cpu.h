// The frozen products of a Mixture-of-Experts layer: the rows of x grouped by expert (group g's
// rows are [offsets[g], offsets[g] + counts[g])), each group times its own NF4 weight W_g [N, K],
// which is never dequantized to memory. A work item decodes a tile of W_g (the values
// nf4_dequantize_cpu gives, in x's dtype) into a buffer that stays in cache and runs all of its
// group's rows against it, so each weight is decoded once per call and only groups with rows are
// read. Two products:
// - forward, y [rows, N] = x [rows, K] W_g^T: an item is (group, 32 rows of W_g); dot products
//   along K (kernels/dot_tile.h);
// - transposed (backward), y [rows, K] = x [rows, N] W_g: an item is (group, 64 of its rows);
//   W_g's rows decoded 64 at a time and added into fp32 accumulators of the item's rows.
// x and y are fp32 or bf16 (the same dtype; row strides ldx, ldy); sums in fp32, one rounding per
// output. bf16 on AVX512_BF16 multiplies with its dot products (vdpbf16ps: pairs of exact bf16
// products into fp32 lanes); elsewhere fp32 FMAs on the widened values. Every output is summed by
// one thread in an order the shapes fix, whatever the thread count; results match a float64
// product of x and the dequantized W to fp32 rounding (then y's).
#pragma once

#include <cstdint>

#include "kernels/nf4_cpu.h"
#include "quant/nf4_format.h"

namespace qlora::kernels {

struct GroupedNf4Matmul {
  int64_t groups = 0, N = 0, K = 0;     // every W_g is [N, K]
  const Nf4Operand* weights = nullptr;  // [groups]
  const int64_t* offsets = nullptr;     // [groups] the group's first row of x and y
  const int64_t* counts = nullptr;      // [groups] its rows (0: W_g is never read)
  bool transposed = false;              // false: y = x W_g^T (x [., K]); true: y = x W_g (x [., N])
  nf4::Dtype dtype = nf4::Dtype::F32;   // x's and y's: F32 or BF16
  const void* x = nullptr;
  int64_t ldx = 0;
  void* y = nullptr;
  int64_t ldy = 0;
};

// Whether W [N, K] in `layout` suits the kernel: K whole 64-column tiles of whole blocks, N even.
bool grouped_nf4_matmul_takes(const nf4::Layout& layout, int64_t N, int64_t K);
void grouped_nf4_matmul_cpu(const GroupedNf4Matmul& p);

}  // namespace qlora::kernels
