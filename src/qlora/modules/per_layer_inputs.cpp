#include "qlora/modules/per_layer_inputs.h"

#include <ATen/ops/embedding.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scalar_tensor.h>

#include <cmath>

#include "qlora/modules/rms_norm.h"

namespace qlora::modules {

at::Tensor per_layer_inputs_forward(const PerLayerInputs& p, const at::Tensor& tokens, const at::Tensor& embeds) {
  const int64_t b = tokens.size(0), s = tokens.size(1);
  // The table's rows where it lives, then to the compute device and dtype (bf16 rows widen exactly).
  at::Tensor table = at::embedding(p.table, tokens.to(p.table.device()));  // [b, s, layers * dim]
  table = table.to(embeds.device(), embeds.scalar_type());
  // Its scale rounded to the compute dtype first, as transformers' scaled embedding does.
  // The scales are transformers' Python powers (pow, not sqrt: the same double to the last bit).
  table = table * at::scalar_tensor(std::pow(static_cast<double>(p.dim), 0.5), table.options());
  const double proj_scale = std::pow(static_cast<double>(embeds.size(-1)), -0.5);
  const at::Tensor context =
      rms_norm(at::linear(embeds, p.projection).mul(proj_scale).view({b, s, p.layers, p.dim}), p.norm, p.rms_norm_eps,
               p.norm_scale);
  return (context + table.view({b, s, p.layers, p.dim})).mul(std::pow(2.0, -0.5));  // [b, s, layers, dim]
}

}  // namespace qlora::modules
