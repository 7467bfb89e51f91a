#include "qlora/train/faults.h"

#include <utility>

namespace qlora::train {
namespace {
FaultPlan& plan() {
  static FaultPlan p;
  return p;
}
}  // namespace

void install_fault_plan(FaultPlan p) { plan() = std::move(p); }
const FaultPlan& fault_plan() { return plan(); }

}  // namespace qlora::train
