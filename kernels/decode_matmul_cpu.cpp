// decode_matmul_cpu.h's kernel, over kernels/dot_tile.h's tile. Weight rows come straight from a
// dense W, or from a buffer of NJ rows decoded from NF4 (nf4_dequantize_blocks_cpu) just before
// every row of x uses them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels/decode_matmul_cpu.h"
#include "kernels/dot_tile.h"
#include "kernels/nf4_cpu.h"
#include "kernels/simd.h"

namespace qlora::kernels {

namespace {

// Weight rows [n0, n1) against every row of x, kNJ at a time: a dense W's rows in place (the last,
// short group copied into buf, zero-padded), an NF4 W's decoded into buf.
template <int L>
QLORA_INLINE void rows(const DecodeMatmul& p, int64_t n0, int64_t n1, std::vector<float>& buf) {
  constexpr int NJ = dot::kNJ<L>;
  const int64_t K = p.K;
  buf.assign(static_cast<size_t>(NJ * K), 0.0f);
  for (int64_t n = n0; n < n1; n += NJ) {
    const int nj = static_cast<int>(std::min<int64_t>(NJ, n1 - n));
    if (p.dense && nj == NJ) {
      dot::all_rows<L>(p.M, K, p.x, p.ldx, p.dense + n * p.ldw, p.ldw, nj, p.y + n, p.ldy);
      continue;
    }
    if (p.dense) {
      for (int j = 0; j < nj; ++j) std::copy(p.dense + (n + j) * p.ldw, p.dense + (n + j) * p.ldw + K, buf.data() + j * K);
    } else {
      const int64_t per_row = K / p.nf4.layout.block_size;
      nf4_dequantize_blocks_cpu(p.nf4, nf4::Dtype::F32, n * per_row, (n + nj) * per_row, buf.data());
    }
    if (nj < NJ) std::fill(buf.begin() + nj * K, buf.end(), 0.0f);  // the missing rows of the last group
    dot::all_rows<L>(p.M, K, p.x, p.ldx, buf.data(), K, nj, p.y + n, p.ldy);
  }
}

}  // namespace

bool decode_matmul_takes_nf4(const nf4::Layout& layout, int64_t N, int64_t K) {
  return K > 0 && N > 0 && layout.block_size % 16 == 0 && K % layout.block_size == 0 && layout.numel == N * K;
}

void decode_matmul_cpu(const DecodeMatmul& p) {
  // At least 64k multiply-adds per chunk of weight rows before a second thread is worth waking.
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(1, p.M * p.K));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf;
    dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE { rows<lanes<decltype(isa)::value>>(p, n0, n1, buf); });
  });
}

}  // namespace qlora::kernels
