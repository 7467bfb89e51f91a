// The seam through which tests inject faults into a training run (a rank killed after a step or
// inside a save, a rank that hangs alive, a step whose loss is NaN, the tiny base's pre-training
// cut short). Production never installs a plan: every hook is empty and the loop only checks that.
// The test binary tests/tools/qlora_faults.cpp installs one from its own environment before running
// the ordinary `qlora` command line.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace qlora::train {

struct FaultPlan {
  std::function<void(int rank, int64_t step)> before_step;  // step (1-based) is about to run
  std::function<void(int rank, int64_t step)> after_step;   // step is done and logged
  // Inside the resume save of `step`, at its barrier number `barrier` (1: the directory exists,
  // 2: this rank's part is durable, 3: committed).
  std::function<void(int rank, int64_t step, int barrier)> in_save;
  // True: this rank's loss of `step` is made NaN before backward (a diverged step, on demand).
  std::function<bool(int rank, int64_t step)> poison_loss;
  // Before an epoch's GGUF file `name` ("epoch_0/model-f16.gguf") is written; throwing stands for a
  // write that fails (a full disk).
  std::function<void(const std::string& name)> before_gguf;
  // After step `step` (1-based) of the tiny base's pre-training (tiny_default.cpp): true stops it
  // there, and the base is written as it stands (recipe.tiny_base_shipped reproduces a prefix of
  // pre-training through scripts/make_tiny_base.sh --prefix, not all of it).
  std::function<bool(int64_t step)> stop_pretraining;
};

void install_fault_plan(FaultPlan plan);  // tests only
const FaultPlan& fault_plan();

}  // namespace qlora::train
