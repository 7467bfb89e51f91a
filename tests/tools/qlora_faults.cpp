// `qlora` for tests that need a run to fail on purpose: the same command line, with the fault plan
// that QLORA_FAULT_PLAN describes installed first (train/faults.h is the seam; the production
// binary never reads this variable). Ranks started by `qlora_faults run --nproc-per-node N` are
// this binary again and inherit the variable, so every rank installs the same plan.
//
//   QLORA_FAULT_PLAN="kill_after_step=3"                 every rank dies by SIGKILL after step 3
//   QLORA_FAULT_PLAN="kill_after_step=2,rank=1"          only rank 1 does
//   QLORA_FAULT_PLAN="kill_in_save_at_step=4,rank=1"     rank 1 dies inside the step-4 save, its
//                                                        part written, the checkpoint not committed
//   QLORA_FAULT_PLAN="hang_at_step=3,rank=1"             rank 1's loop stalls (alive) before step 3
//   QLORA_FAULT_PLAN="nan_at_step=3,nan_steps=2,rank=1"  rank 1's loss is NaN at steps 3 and 4
//                                                        (nan_steps defaults to 1)
//   QLORA_FAULT_PLAN="gguf_fails_at_epoch=0"             writing epoch 0's GGUF files fails
//   QLORA_FAULT_PLAN="stop_pretraining_after=200"        the tiny base's pre-training (QLORA_NO_SHIPPED_BASE)
//                                                        stops after its step 200 (make_tiny_base.sh --prefix)
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "qlora/train/faults.h"

namespace qlora::cli {
int qlora_cli(int argc, char** argv);
}

namespace {

std::map<std::string, int64_t> parse_plan(const std::string& text) {
  std::map<std::string, int64_t> kv;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("QLORA_FAULT_PLAN: '" + item + "' is not key=value");
    const std::string key = item.substr(0, eq);
    if (key != "kill_after_step" && key != "kill_in_save_at_step" && key != "hang_at_step" && key != "rank" &&
        key != "nan_at_step" && key != "nan_steps" && key != "gguf_fails_at_epoch" && key != "stop_pretraining_after")
      throw std::invalid_argument("QLORA_FAULT_PLAN: unknown key '" + key + "'");
    kv[key] = std::stoll(item.substr(eq + 1));
  }
  return kv;
}

qlora::train::FaultPlan make_plan(const std::map<std::string, int64_t>& kv) {
  const auto get = [&](const char* k) { return kv.count(k) ? kv.at(k) : int64_t{-1}; };
  const int64_t rank = get("rank"), kill_after = get("kill_after_step"), in_save = get("kill_in_save_at_step"),
                hang = get("hang_at_step"), gguf_epoch = get("gguf_fails_at_epoch"),
                stop_pretraining = get("stop_pretraining_after"), nan_at = get("nan_at_step"), nan_steps = kv.count("nan_steps") ? kv.at("nan_steps") : 1;
  const auto mine = [rank](int r) { return rank < 0 || r == rank; };
  qlora::train::FaultPlan plan;
  if (kill_after >= 0)
    plan.after_step = [=](int r, int64_t step) {
      if (mine(r) && step == kill_after) ::raise(SIGKILL);
    };
  if (hang >= 0)
    plan.before_step = [=](int r, int64_t step) {
      if (mine(r) && step == hang) std::this_thread::sleep_for(std::chrono::hours(1));
    };
  if (in_save >= 0)  // barrier 2: this rank's part is durable, the checkpoint not yet committed
    plan.in_save = [=](int r, int64_t step, int barrier) {
      if (mine(r) && step == in_save && barrier == 2) ::raise(SIGKILL);
    };
  if (gguf_epoch >= 0)
    plan.before_gguf = [=](const std::string& name) {
      if (name.rfind("epoch_" + std::to_string(gguf_epoch) + "/", 0) == 0)
        throw std::runtime_error("cannot write " + name + ": No space left on device (injected by QLORA_FAULT_PLAN)");
    };
  if (stop_pretraining >= 0)
    plan.stop_pretraining = [=](int64_t step) { return step == stop_pretraining; };
  if (nan_at >= 0)
    plan.poison_loss = [=](int r, int64_t step) { return mine(r) && step >= nan_at && step < nan_at + nan_steps; };
  return plan;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* text = std::getenv("QLORA_FAULT_PLAN"); text && *text) {
    try {
      qlora::train::install_fault_plan(make_plan(parse_plan(text)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "qlora_faults: %s\n", e.what());
      return 2;
    }
  }
  return qlora::cli::qlora_cli(argc, argv);
}
