// What a step whose loss or gradient norm is not finite (NaN, inf) does: training.on_nonfinite.
#pragma once

#include "qlora/io/enum_names.h"

namespace qlora::train {

enum class NonFinitePolicy {
  kStop,  // stop with an error naming the step and the last good checkpoint
  kSkip,  // drop the step's update; stop after training.max_consecutive_skips in a row
};
inline constexpr io::EnumName<NonFinitePolicy> kNonFinitePolicyNames[] = {{NonFinitePolicy::kStop, "stop"},
                                                                         {NonFinitePolicy::kSkip, "skip"}};

}  // namespace qlora::train
