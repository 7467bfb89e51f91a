#include "qlora/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace qlora::optim {
namespace {
std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}
}  // namespace

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions options)
    : params_(std::move(params)), steps_(params_.size(), 0), options_(options) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (!p.defined() || p.scalar_type() != at::kFloat)
      throw std::invalid_argument("AdamW: param " + std::to_string(i) + " must be a defined fp32 tensor");
    // torch creates the state lazily on a param's first step; zeros either way.
    exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
}

void AdamW::step() {
  RECORD_USER_SCOPE("qlora::adamw");  // a phase of bench_train_step's profile
  c10::NoGradGuard no_grad;
  const double lr = options_.lr, beta1 = options_.beta1, beta2 = options_.beta2;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& param = params_[i];
    const at::Tensor& grad = param.grad();
    if (!grad.defined()) continue;
    at::Tensor& exp_avg = exp_avg_[i];
    at::Tensor& exp_avg_sq = exp_avg_sq_[i];
    const double step = static_cast<double>(++steps_[i]);

    // Decoupled weight decay, then the moments, in _single_tensor_adam's order and ops.
    if (options_.weight_decay != 0) param.mul_(1 - lr * options_.weight_decay);
    exp_avg.lerp_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);

    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const double step_size = lr / bias_correction1;
    // Python's `x ** 0.5` is pow(), which need not round like sqrt().
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    const at::Tensor denom = exp_avg_sq.sqrt().div(bias_correction2_sqrt).add_(options_.eps);
    param.addcdiv_(exp_avg, denom, -step_size);
  }
}

void AdamW::zero_grad() {
  for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
}

NamedTensors AdamW::state_dict() const {
  NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg." + std::to_string(i), exp_avg_[i].clone());
    out.emplace_back("exp_avg_sq." + std::to_string(i), exp_avg_sq_[i].clone());
  }
  out.emplace_back("step", at::tensor(steps_, at::kLong));
  return out;
}

void AdamW::load_state_dict(const NamedTensors& state) {
  auto find = [&](const std::string& name) -> const at::Tensor& {
    for (const auto& [n, t] : state)
      if (n == name) return t;
    throw std::invalid_argument("AdamW::load_state_dict: missing '" + name + "'");
  };
  const size_t expected = 2 * params_.size() + 1;
  if (state.size() != expected)
    throw std::invalid_argument("AdamW::load_state_dict: expected " + std::to_string(expected) +
                                " entries (2 per param + step), got " + std::to_string(state.size()));
  const at::Tensor& steps = find("step");
  if (steps.scalar_type() != at::kLong || steps.dim() != 1 ||
      steps.size(0) != static_cast<int64_t>(params_.size()))
    throw std::invalid_argument("AdamW::load_state_dict: 'step' must be int64 [" +
                                std::to_string(params_.size()) + "]");
  // Validate everything before touching any state: a bad file must not leave a half-loaded optimizer.
  std::vector<const at::Tensor*> sources;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const char* kind : {"exp_avg.", "exp_avg_sq."}) {
      const std::string name = kind + std::to_string(i);
      const at::Tensor& t = find(name);
      if (t.scalar_type() != at::kFloat || t.sizes() != params_[i].sizes())
        throw std::invalid_argument("AdamW::load_state_dict: '" + name + "' must be fp32 " +
                                    shape_of(params_[i]) + ", got " +
                                    std::string(c10::toString(t.scalar_type())) + " " +
                                    shape_of(t));
      sources.push_back(&t);
    }
  }
  c10::NoGradGuard no_grad;
  const at::Tensor steps_cpu = steps.cpu().contiguous();
  for (size_t i = 0; i < params_.size(); ++i) {
    exp_avg_[i].copy_(*sources[2 * i]);
    exp_avg_sq_[i].copy_(*sources[2 * i + 1]);
    steps_[i] = steps_cpu.data_ptr<int64_t>()[i];
  }
}

at::Tensor grad_total_norm(const std::vector<at::Tensor>& params) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const at::Tensor& p : params)
    if (p.grad().defined()) norms.push_back(at::linalg_vector_norm(p.grad(), 2));
  if (norms.empty()) return at::zeros({}, at::kFloat);  // torch.tensor(0.0)
  const at::Device first = norms.front().device();
  for (at::Tensor& n : norms) n = n.to(first);
  return at::linalg_vector_norm(at::stack(norms), 2);
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm) {
  c10::NoGradGuard no_grad;
  const at::Tensor total_norm = grad_total_norm(params);
  if (max_norm <= 0) return total_norm;
  // Python's `max_norm / (total_norm + 1e-6)` is Tensor.__rtruediv__: reciprocal() * max_norm.
  const at::Tensor clip_coef = (total_norm + 1e-6).reciprocal() * max_norm;
  const at::Tensor clamped = at::clamp(clip_coef, std::optional<at::Scalar>(), std::optional<at::Scalar>(1.0));
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (g.defined()) g.mul_(clamped.to(g.device()));
  }
  return total_norm;
}

}  // namespace qlora::optim
