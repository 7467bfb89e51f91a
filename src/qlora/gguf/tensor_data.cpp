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

at::Tensor regroup_heads(const at::Tensor& w, const HeadRegroup& g) {
  const int64_t n = g.groups * g.per_group * g.head_dim;
  const at::Tensor heads = w.narrow(g.dim, g.offset, n);
  std::vector<int64_t> split(heads.sizes().begin(), heads.sizes().end());
  split[static_cast<size_t>(g.dim)] = g.head_dim;
  split.insert(split.begin() + g.dim, {g.groups, g.per_group});  // [.., groups, per_group, head_dim, ..]
  const at::Tensor tiled = heads.reshape(split).transpose(g.dim, g.dim + 1).reshape(heads.sizes());
  const int64_t rest = w.size(g.dim) - g.offset - n;
  return at::cat({w.narrow(g.dim, 0, g.offset), tiled, w.narrow(g.dim, g.offset + n, rest)}, g.dim).contiguous();
}

at::Tensor planned_values(at::Tensor x, const TensorPlan& plan) {
  if (plan.squeeze) x = x.squeeze();
  if (plan.permute_heads > 0) x = unrotate(x, plan.permute_heads);
  if (plan.regroup) x = regroup_heads(x, *plan.regroup);
  if (plan.neg_exp) x = -at::exp(x.to(at::kFloat));
  if (plan.add != 0.0f) x = x.to(at::kFloat) + plan.add;
  return x;
}

std::vector<int64_t> planned_shape(const std::vector<int64_t>& shape, const TensorPlan& plan) {
  if (!plan.squeeze) return shape;
  std::vector<int64_t> out;
  for (int64_t d : shape)
    if (d != 1) out.push_back(d);
  return out;
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
