// Full (bidirectional, unmasked) attention within consecutive segments of rows, bf16, on the AMX
// tiles of Sapphire Rapids and later: the vision towers' attention where nothing is differentiated
// (a frozen tower, generation). A flash-attention forward: per head and block of 32 queries, the
// scores of 512 keys at a time in fp32 from bf16 products (AMX), the online softmax in fp32
// (AVX-512), the probabilities rounded to bf16 for their product with V (AMX, fp32 sums), the output
// divided by the row's sum and rounded once. ATen's CPU flash kernel does the same; this one is
// 1.7x faster at the towers' 16 heads of 72 over 3072 patches (build/bench_attention --tower).
// tests/kernels/test_attention_amx.cpp checks it against float64 beside ATen's.
//
// Where AMX is absent (or QLORA_CPU_ISA caps the ISA below avx512_bf16) the caller takes ATen's
// SDPA: attention_amx_available() says which.
#pragma once

#include <cstdint>

namespace qlora::kernels {

// AMX-BF16 granted by the OS (cpu_isa.h) and active_isa() at avx512_bf16.
bool attention_amx_available();

// One operand [rows, heads, d] of bf16 bit patterns, d contiguous; strides in elements.
struct RowsHeads {
  const uint16_t* data;
  int64_t row_stride;
  int64_t head_stride;
};

// out [rows, heads, d] contiguous = softmax(q k^T * scale) v within each segment (lengths summing to
// the rows), per head. d: 1..256. Requires attention_amx_available().
void segment_attention_amx(RowsHeads q, RowsHeads k, RowsHeads v, int64_t heads, int64_t d, const int64_t* segments,
                           int64_t n_segments, float scale, uint16_t* out);

}  // namespace qlora::kernels
