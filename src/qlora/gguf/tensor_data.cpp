#include "qlora/gguf/tensor_data.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace qlora::gguf {

at::Tensor unrotate(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0);
  return w.reshape({heads, 2, rows / heads / 2, w.size(1)}).transpose(1, 2).reshape(w.sizes()).contiguous();
}

void write_tensor(Writer& out, const at::Tensor& t, GgmlType type) {
  const int64_t cols = t.dim() == 0 ? 1 : t.size(-1), rows = t.numel() / std::max<int64_t>(cols, 1);
  const at::Tensor matrix = t.reshape({rows, cols});
  const uint64_t rb = row_bytes(type, cols);
  const int64_t chunk = std::max<int64_t>(1, (1 << 23) / static_cast<int64_t>(rb));  // ~8 MB of output a write
  std::vector<uint8_t> buf;
  for (int64_t r = 0; r < rows; r += chunk) {
    const int64_t n = std::min(chunk, rows - r);
    const at::Tensor x = matrix.narrow(0, r, n).to(at::kFloat).contiguous();
    const float* src = x.data_ptr<float>();
    buf.resize(static_cast<size_t>(n * rb));
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) encode_row(type, src + i * cols, cols, buf.data() + i * rb);
    });
    out.write(buf.data(), buf.size());
  }
}

}  // namespace qlora::gguf
