// Learning-rate schedules as LambdaLR multipliers: optimizer step k (0-based) runs with
// lr = base_lr * factor(k), exactly as torch's LambdaLR does after construction (which evaluates
// factor(0) before the first step) and one scheduler.step() after every optimizer step.
#pragma once

#include <cstdint>
#include <string_view>

#include "qlora/io/enum_names.h"

namespace qlora::optim {

enum class ScheduleKind { Cosine, Constant };  // both with linear warmup

inline constexpr io::EnumName<ScheduleKind> kScheduleKindNames[] = {{ScheduleKind::Cosine, "cosine"},
                                                                    {ScheduleKind::Constant, "constant"}};
// Throws std::invalid_argument listing the names.
ScheduleKind schedule_kind_from_name(std::string_view name);
const char* schedule_kind_name(ScheduleKind kind);

// torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup's lr_lambda, same double
// arithmetic in the same order: linear warmup from 0, then half a cosine (num_cycles 0.5) to 0 at
// total_steps, floored at 0.
double cosine_with_warmup_factor(int64_t step, int64_t warmup_steps, int64_t total_steps,
                                 double num_cycles = 0.5);
// Linear warmup from 0, then 1.
double constant_with_warmup_factor(int64_t step, int64_t warmup_steps);

struct LrSchedule {
  ScheduleKind kind = ScheduleKind::Cosine;
  double base_lr = 2e-4;
  int64_t warmup_steps = 100;
  int64_t total_steps = 1000;  // optimizer steps over the whole run; cosine reaches its floor here
  // Cosine only: after warmup, factor = min_lr_ratio + (1 - min_lr_ratio) * cosine, so the lr
  // decays to base_lr * min_lr_ratio instead of 0. At 0 this is torchtune's factor, bit for bit.
  double min_lr_ratio = 0.0;

  double factor(int64_t step) const;
  double lr_at(int64_t step) const { return base_lr * factor(step); }
};

}  // namespace qlora::optim
