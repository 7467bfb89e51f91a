// The preference losses of `qlora run lora_dpo`, per pair, from sequence log-probabilities, with
// the rewards TRL logs. Formulas as TRL 1.x computes them (trl/trainer/dpo_trainer.py; ORPO and
// CPO/SimPO in trl/experimental), checked against it in tests/conformance/test_dpo_trl.py:
//   Δ = (πc − rc) − (πr − rr)  (summed log-probs of the responses; r: the reference policy)
//   sigmoid  −(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)   (ε = label_smoothing: conservative DPO, as torchtune's
//            DPOLoss and TRL's CPO sigmoid; TRL 1.x's DPO "sigmoid" ignores ε, and its "robust" is
//            ((1−ε)·(−logσ(βΔ)) − ε·(−logσ(−βΔ)))/(1−2ε), so cDPO = 2(1−ε)·sigmoid − (1−2ε)·robust)
//   ipo      ((πc−rc)/nc − (πr−rr)/nr − 1/(2β))²   (n: a response's scored tokens)
//   hinge    max(0, 1 − βΔ)
//   rewards  β(πc − rc), β(πr − rr)
// Reference-free, on length-averaged log-probs ac = πc/nc, ar = πr/nr (rewards β·ac, β·ar):
//   orpo     −β·logσ(log-odds), log-odds = (ac − ar) − (log(1−e^ac) − log(1−e^ar)), plus the
//            chosen response's NLL as a mean over the step's chosen tokens (TRL's also scores the
//            prompt; here the loss covers responses only)
//   simpo    −(1−ε)·logσ(β(ac − ar) − γ) − ε·logσ(−(β(ac − ar) − γ))   (TRL's CPO "simpo" with
//            cpo_alpha = 0)
#pragma once

#include <ATen/ATen.h>

#include "qlora/io/enum_names.h"

namespace qlora::train {

enum class PreferenceLoss { kSigmoid, kIpo, kHinge, kOrpo, kSimpo };
inline constexpr io::EnumName<PreferenceLoss> kPreferenceLossNames[] = {{PreferenceLoss::kSigmoid, "sigmoid"},
                                                                       {PreferenceLoss::kIpo, "ipo"},
                                                                       {PreferenceLoss::kHinge, "hinge"},
                                                                       {PreferenceLoss::kOrpo, "orpo"},
                                                                       {PreferenceLoss::kSimpo, "simpo"}};

// Whether the loss compares with the reference policy (the base with the adapters off).
bool needs_reference(PreferenceLoss loss);

struct PreferenceLossOptions {
  PreferenceLoss loss = PreferenceLoss::kSigmoid;
  double beta = 0.1;
  double label_smoothing = 0.0;  // sigmoid and simpo
  double simpo_gamma = 0.5;
};

// Per pair, [P] each: summed log-probabilities of the responses (policy with its graph; the
// reference's without, undefined for orpo and simpo) and their scored token counts.
struct PairLogps {
  at::Tensor chosen, rejected;
  at::Tensor ref_chosen, ref_rejected;
  at::Tensor chosen_tokens, rejected_tokens;
};

struct PreferenceTerms {
  at::Tensor pair_losses;   // [P]: the step divides their sum by its number of pairs
  at::Tensor token_losses;  // [P] chosen NLL sums (orpo; else undefined): divided by the step's chosen tokens
  // Detached, [P]: the rewards and the log-probs TRL logs (summed for the DPO losses, averaged for
  // orpo and simpo, as each trainer logs logps/chosen).
  at::Tensor chosen_rewards, rejected_rewards, chosen_logps, rejected_logps;
};

PreferenceTerms preference_terms(const PairLogps& logps, const PreferenceLossOptions& options);

}  // namespace qlora::train
