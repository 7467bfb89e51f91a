#include "qlora/train/preference_loss.h"

#include <cmath>
#include <stdexcept>

namespace qlora::train {
namespace {

// −(1−ε)·logσ(z) − ε·logσ(−z)
at::Tensor smoothed_sigmoid_loss(const at::Tensor& z, double eps) {
  at::Tensor l = -at::log_sigmoid(z) * (1.0 - eps);
  return eps == 0.0 ? l : l - at::log_sigmoid(-z) * eps;
}

// log(1 − e^x) for x < 0, accurate on both sides of −ln 2.
at::Tensor log1mexp(const at::Tensor& x) {
  return at::where(x < -std::log(2.0), at::log1p(-at::exp(x)), at::log(-at::expm1(x)));
}

}  // namespace

bool needs_reference(PreferenceLoss loss) {
  return loss == PreferenceLoss::kSigmoid || loss == PreferenceLoss::kIpo || loss == PreferenceLoss::kHinge;
}

PreferenceTerms preference_terms(const PairLogps& p, const PreferenceLossOptions& o) {
  const double beta = o.beta;
  PreferenceTerms t;
  if (needs_reference(o.loss)) {
    if (!p.ref_chosen.defined() || !p.ref_rejected.defined())
      throw std::invalid_argument("preference loss: this loss needs the reference log-probabilities");
    const at::Tensor rho_c = p.chosen - p.ref_chosen, rho_r = p.rejected - p.ref_rejected;  // [P]
    const at::Tensor delta = rho_c - rho_r;
    if (o.loss == PreferenceLoss::kSigmoid) t.pair_losses = smoothed_sigmoid_loss(delta * beta, o.label_smoothing);
    else if (o.loss == PreferenceLoss::kHinge) t.pair_losses = at::relu(1.0 - delta * beta);
    else
      t.pair_losses = (rho_c / p.chosen_tokens.clamp_min(1) - rho_r / p.rejected_tokens.clamp_min(1) - 1.0 / (2.0 * beta))
                          .square();
    t.chosen_rewards = (rho_c * beta).detach();
    t.rejected_rewards = (rho_r * beta).detach();
    t.chosen_logps = p.chosen.detach();
    t.rejected_logps = p.rejected.detach();
    return t;
  }
  const at::Tensor ac = p.chosen / p.chosen_tokens.clamp_min(1), ar = p.rejected / p.rejected_tokens.clamp_min(1);
  if (o.loss == PreferenceLoss::kOrpo) {
    const at::Tensor log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar));
    t.pair_losses = -at::log_sigmoid(log_odds) * beta;
    t.token_losses = -p.chosen;
  } else {
    t.pair_losses = smoothed_sigmoid_loss((ac - ar) * beta - o.simpo_gamma, o.label_smoothing);
  }
  t.chosen_rewards = (ac * beta).detach();
  t.rejected_rewards = (ar * beta).detach();
  t.chosen_logps = ac.detach();
  t.rejected_logps = ar.detach();
  return t;
}

}  // namespace qlora::train
