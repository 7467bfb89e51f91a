// What the vision towers share: reading a tower's tensors under its checkpoint prefix, LayerNorm ViT
// pieces (attention within each image, the rotate-half rotation, the axial 2-D rotary tables), the
// activations by their config names, and the projector's cast. Numerics follow transformers op for op.
#pragma once
#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "qlora/io/checkpoint_dir.h"
#include "qlora/models/vision/tower.h"
#include "qlora/modules/lora_linear.h"

namespace qlora::models::vision {

// A tower's tensors in one checkpoint, under the first of several prefixes that holds `probe`
// (the Hub's and transformers' spellings differ: "vision_tower.vision_model." / "vision_tower.").
class TowerWeights {
 public:
  // Errors name the checkpoint, the probe key and every prefix tried.
  TowerWeights(const io::CheckpointDir& ckpt, const std::vector<std::string>& prefixes, const std::string& probe,
               const TowerLoadOptions& opt);
  const std::string& prefix() const { return prefix_; }
  // <prefix><name> with this shape, in `dtype` (default: the compute dtype) on the device. A tensor
  // stored only as NF4 (`qlora quantize`) is dequantized.
  at::Tensor dense(const std::string& name, const std::vector<int64_t>& shape) const;
  at::Tensor dense(const std::string& name, const std::vector<int64_t>& shape, at::ScalarType dtype) const;
  // <module>.weight [out, in] (+ <module>.bias [out]) as a LoraLinear: NF4 when `encoder` and the
  // options ask for it, else dense in the compute dtype.
  modules::LoraLinear linear(const std::string& module, int64_t out, int64_t in, bool bias, bool encoder) const;

 private:
  const io::CheckpointDir& ckpt_;
  TowerLoadOptions opt_;
  std::string prefix_;
};

// The config's vision_config object; errors name `where`.
const nlohmann::json& vision_config(const nlohmann::json& config, const std::string& where);
// rope_parameters.rope_theta (or rope_theta), else `dflt`.
double vision_rope_theta(const nlohmann::json& vc, const std::string& where, double dflt);

// An activation by its transformers name: "gelu_pytorch_tanh" / "gelu_new" (tanh approximation),
// "gelu" (erf); others std::invalid_argument naming `where` and the key.
enum class Act { kGeluTanh, kGelu };
Act parse_act(const std::string& name, const std::string& where, const std::string& key);
// The activation of x, the caller's temporary (a linear's output): computed in place where x needs
// no gradient (the frozen tower), else into a new tensor.
at::Tensor activate(at::Tensor x, Act act);

at::Tensor linear(const modules::LoraLinear& l, const at::Tensor& x, bool training);

// A linear's output left without its bias, with the bias beside it, where the bias can go into the
// pass that follows (ops/epilogue_ops.h): nothing differentiated and no adapter on the layer (a
// frozen tower's linear). Otherwise the whole linear (y) and no bias.
struct Unbiased {
  at::Tensor y, bias;
};
Unbiased linear_unbiased(const modules::LoraLinear& l, const at::Tensor& x, bool training);
// activate(y + bias), in place on y where nothing needs its gradient.
at::Tensor activate(Unbiased u, Act act);
// x + (y + bias): the residual, in place on y where nothing needs a gradient.
at::Tensor residual(const at::Tensor& x, Unbiased u);
// A projector tensor in the compute dtype (a trained one is an fp32 copy).
inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) { return t.to(dtype); }

// Full attention within consecutive segments of rows: q, k, v [rows, heads, head_dim]; segment
// lengths summing to rows; scaled dot products (transformers' SDPA per segment). Returns [rows, heads * head_dim].
at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<int64_t>& segments, double scale);

// x * cos + rotate_half(x) * sin, in the operands' dtypes (broadcast as given).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// x [rows, heads, d] rotated in fp32 and returned in x's dtype, as transformers' vision rotary
// (q.float() * cos + rotate_half(q.float()) * sin, then cast back); cos and sin [rows, 1, d] fp32.
// Where x needs no gradient, ops::rope_in_fp32's one pass (within one rounding) instead of ATen's seven.
at::Tensor rotate_in_fp32(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The axial rotary's inverse frequencies: 1 / theta^(arange(0, head_dim / 2, 2) / (head_dim / 2)),
// [head_dim / 4] fp32 (one axis' share; the two axes use the same frequencies).
at::Tensor axial_inv_freq(int64_t head_dim, double theta);

}  // namespace qlora::models::vision
