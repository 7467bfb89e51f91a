#include "qlora/models/vision/blocks.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <stdexcept>

#include "qlora/io/quantize_checkpoint.h"
#include "qlora/models/config_json.h"
#include "qlora/modules/nf4_linear.h"
#include "qlora/modules/rope.h"
#include "qlora/ops/epilogue_ops.h"
#include "qlora/ops/nf4_ops.h"
#include "qlora/ops/rope_ops.h"
#include "qlora/ops/segment_attention_ops.h"

namespace qlora::models::vision {

TowerWeights::TowerWeights(const io::CheckpointDir& ckpt, const std::vector<std::string>& prefixes,
                           const std::string& probe, const TowerLoadOptions& opt)
    : ckpt_(ckpt), opt_(opt) {
  std::string tried;
  for (const std::string& p : prefixes) {
    if (ckpt.contains(p + probe)) {
      prefix_ = p;
      return;
    }
    tried += (tried.empty() ? "'" : ", '") + p + probe + "'";
  }
  throw std::invalid_argument(ckpt.path() + ": no vision tower: none of the keys " + tried + " is in the checkpoint");
}

at::Tensor TowerWeights::dense(const std::string& name, const std::vector<int64_t>& shape) const {
  return dense(name, shape, opt_.compute_dtype);
}

at::Tensor TowerWeights::dense(const std::string& name, const std::vector<int64_t>& shape,
                               at::ScalarType dtype) const {
  const std::string key = prefix_ + name;
  // A checkpoint written by `qlora quantize` keeps some 2-D weights as NF4 entries only (load_nf4
  // reads them, and names the checkpoint and key when neither form exists).
  at::Tensor t = ckpt_.contains(key) ? ckpt_.tensor(key) : ops::nf4_dequantize(io::load_nf4(ckpt_, key), dtype);
  if (t.sizes().vec() != shape)
    throw std::invalid_argument((ckpt_.contains(key) ? ckpt_.file_of(key).path() : ckpt_.path()) + ": tensor '" + key +
                                "' has shape " + c10::str(t.sizes()) + ", expected " +
                                c10::str(at::IntArrayRef(shape)) + " from config.json's vision_config");
  return t.to(opt_.device, dtype);
}

modules::LoraLinear TowerWeights::linear(const std::string& module, int64_t out, int64_t in, bool bias,
                                         bool encoder) const {
  modules::LoraLinear l;
  if (encoder && opt_.base_in_nf4) {
    const std::string key = prefix_ + module + ".weight";
    Nf4Tensor w = io::load_nf4(ckpt_, key);
    if (w.shape != std::vector<int64_t>{out, in})
      throw std::invalid_argument(ckpt_.path() + ": tensor '" + key + "' has shape " +
                                  c10::str(at::IntArrayRef(w.shape)) + ", expected " +
                                  c10::str(at::IntArrayRef({out, in})) + " from config.json's vision_config");
    l = modules::lora_linear_nf4(w.to(opt_.device));
  } else {
    l = modules::lora_linear_dense(dense(module + ".weight", {out, in}));
  }
  if (bias) modules::lora_linear_set_bias(l, dense(module + ".bias", {out}));
  return l;
}

const nlohmann::json& vision_config(const nlohmann::json& config, const std::string& where) {
  if (!config.is_object() || !cfg::present(config, "vision_config") || !config.at("vision_config").is_object())
    cfg::fail(where, "vision_config", "expected an object (the vision tower's config)");
  return config.at("vision_config");
}

double vision_rope_theta(const nlohmann::json& vc, const std::string& where, double dflt) {
  if (cfg::present(vc, "rope_parameters")) {
    const nlohmann::json& rp = vc.at("rope_parameters");
    if (!rp.is_object()) cfg::fail(where, "vision_config.rope_parameters", "expected an object, got " + rp.dump());
    const std::string type = cfg::present(rp, "rope_type") ? rp.at("rope_type").dump() : "\"axial\"";
    if (type != "\"axial\"" && type != "\"default\"")
      cfg::fail(where, "vision_config.rope_parameters.rope_type", type + ": the vision rotary is axial");
    if (cfg::present(rp, "rope_theta")) return cfg::get_num(rp, "rope_theta", where + " vision_config.rope_parameters");
  }
  return cfg::get_num(vc, "rope_theta", where + " vision_config", dflt);
}

Act parse_act(const std::string& name, const std::string& where, const std::string& key) {
  if (name == "gelu_pytorch_tanh" || name == "gelu_new") return Act::kGeluTanh;
  if (name == "gelu") return Act::kGelu;
  cfg::fail(where, key, "'" + name + "': the vision towers compute gelu_pytorch_tanh, gelu_new or gelu");
}

at::Tensor activate(at::Tensor x, Act act) {
  const char* approximate = act == Act::kGeluTanh ? "tanh" : "none";
  if (at::GradMode::is_enabled() && x.requires_grad()) return at::gelu(x, approximate);
  // Nothing to differentiate: in place, no second buffer of x's size (the tanh form in one pass).
  return act == Act::kGeluTanh ? ops::bias_gelu_tanh_(x) : at::gelu_(x, approximate);
}

at::Tensor linear(const modules::LoraLinear& l, const at::Tensor& x, bool training) {
  return modules::lora_linear_forward(l, x, training);
}

namespace {
bool differentiated(const at::Tensor& t) { return at::GradMode::is_enabled() && t.requires_grad(); }
}  // namespace

Unbiased linear_unbiased(const modules::LoraLinear& l, const at::Tensor& x, bool training) {
  if (l.active() || differentiated(x) || !l.bias.defined() || l.bias.scalar_type() != x.scalar_type())
    return {linear(l, x, training), {}};
  return {l.base_nf4.defined() ? modules::nf4_linear(x, l.base_nf4) : at::linear(x, l.base_dense), l.bias};
}

at::Tensor activate(Unbiased u, Act act) {
  if (!u.bias.defined()) return activate(u.y, act);
  if (act == Act::kGeluTanh) return ops::bias_gelu_tanh_(u.y, u.bias);
  return at::gelu_(u.y.add_(u.bias), "none");
}

at::Tensor residual(const at::Tensor& x, Unbiased u) {
  if (differentiated(x) || differentiated(u.y)) return x + u.y;  // (no bias: u.y holds it)
  return ops::bias_residual_(u.y, x, u.bias);
}

at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<int64_t>& segments, double scale) {
  return ops::segment_attention(q, k, v, segments, scale).reshape({q.size(0), -1});
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

at::Tensor rotate_in_fp32(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (at::GradMode::is_enabled() && x.requires_grad()) return rotate(x.to(at::kFloat), cos, sin).to(x.scalar_type());
  // Nothing to differentiate (the frozen tower): the one-pass kernel, its output [rows, heads, d] contiguous.
  const at::Tensor heads_first = x.transpose(0, 1).unsqueeze(0);  // [1, heads, rows, d]
  return ops::rope_in_fp32(heads_first, cos.squeeze(1), sin.squeeze(1), /*heads_inner=*/true).squeeze(0).transpose(0, 1);
}

at::Tensor axial_inv_freq(int64_t head_dim, double theta) {
  return modules::rope_inv_freq(head_dim / 2, theta, std::nullopt);
}

}  // namespace qlora::models::vision
