#include "qlora/optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace qlora::optim {

ScheduleKind schedule_kind_from_name(std::string_view name) {
  return io::enum_from_name(kScheduleKindNames, name, "lr schedule");
}

const char* schedule_kind_name(ScheduleKind kind) { return io::enum_name(kScheduleKindNames, kind); }

// Python divides ints with true division, correctly rounded; for |ints| < 2^53 that is the double
// quotient, so converting first gives the same bits.
double cosine_with_warmup_factor(int64_t step, int64_t warmup_steps, int64_t total_steps,
                                 double num_cycles) {
  if (step < warmup_steps)
    return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
  const double progress = static_cast<double>(step - warmup_steps) /
                          static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  // Left to right as in Python: ((pi * num_cycles) * 2.0) * progress.
  const double multiple = 0.5 * (1.0 + std::cos(M_PI * num_cycles * 2.0 * progress));
  return std::max(0.0, multiple);
}

double constant_with_warmup_factor(int64_t step, int64_t warmup_steps) {
  if (step < warmup_steps)
    return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
  return 1.0;
}

double LrSchedule::factor(int64_t step) const {
  if (kind == ScheduleKind::Constant) return constant_with_warmup_factor(step, warmup_steps);
  const double f = cosine_with_warmup_factor(step, warmup_steps, total_steps);
  if (step < warmup_steps || min_lr_ratio == 0.0) return f;
  return min_lr_ratio + (1.0 - min_lr_ratio) * f;
}

}  // namespace qlora::optim
