// A bench's --dtype fp32|bf16|auto, resolved as the recipes resolve model.dtype on this CPU
// (config::resolve_compute_dtype with kernels::bf16_gemms_fast()), shared by bench_train_step and
// bench_preference_step.
#pragma once

#include <c10/core/ScalarType.h>

#include <stdexcept>
#include <string>

#include "kernels/cpu_isa.h"
#include "qlora/config/builders.h"

namespace qlora::bench {

// Returns the compute dtype; `dtype` becomes what workers re-executed with it get ("fp32" or
// "bf16"), and `why` says what chose it. Throws std::invalid_argument for another name.
inline at::ScalarType resolve_bench_dtype(std::string& dtype, std::string* why) {
  if (dtype != "fp32" && dtype != "bf16" && dtype != "auto")
    throw std::invalid_argument("--dtype must be fp32, bf16 or auto, got '" + dtype + "'");
  const at::ScalarType configured = dtype == "auto" ? at::ScalarType::Undefined
                                    : dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const at::ScalarType t = config::resolve_compute_dtype(configured, c10::kCPU, kernels::bf16_gemms_fast(), why);
  if (why->empty()) *why = "--dtype " + dtype;
  dtype = t == at::kBFloat16 ? "bf16" : "fp32";
  return t;
}

}  // namespace qlora::bench
