// Where a training step's time goes, for bench_train_step: every ATen op and every qlora scope
// (RECORD_USER_SCOPE("qlora::...") in the library) is timed through PyTorch's RecordFunction
// callbacks, and its self time (its time minus the ops it called) is added to one phase:
//   - the innermost enclosing qlora scope names the phase ("qlora::nf4_dequantize" -> "nf4_dequantize",
//     "qlora::base_linear": the frozen projections' GEMMs, "qlora::output_loss", "qlora::adamw", ...);
//   - outside any qlora scope, by the op: GEMMs ("gemm_other": the LoRA matmuls and their
//     gradients), attention kernels, and everything else ("elementwise_other": norms, RoPE, SwiGLU,
//     residual adds, casts, copies, autograd's accumulations).
// Only the thread that made the profiler is recorded (the step and its CPU backward run there): an
// op that fans out over intra-op threads (blocked attention's heads) counts as its wall time, in
// the phase of the scope that started it, not as the sum of its threads' times.
// The step's wall time minus the sum of the phases is "untracked" (C++ between ops, the autograd
// engine, allocation outside ops). Recording costs ~1 us per op, so the profiled step is a
// separate step from the timed ones.
//
// And the step's GEMM floor: the forward and backward input-gradient GEMMs of every frozen
// projection (each decoder layer's, and the output head over all tokens), fp32, on the same
// threads, with nothing else: the time no implementation of this step can beat.
#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace qlora::bench {

class StepProfile {
 public:
  StepProfile() {
    owner() = std::this_thread::get_id();
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end).needsInputs(false));
  }
  ~StepProfile() { at::removeCallback(handle_); }
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;

  // Seconds per phase since construction.
  std::map<std::string, double> phases() const { return totals(); }
  // Seconds per "phase: op" (self time), the `n` largest.
  std::vector<std::pair<std::string, double>> top_ops(size_t n) const {
    std::vector<std::pair<std::string, double>> v(by_op().begin(), by_op().end());
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    v.resize(std::min(n, v.size()));
    return v;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Frame {
    const char* name;
    Clock::time_point start;
    double children = 0.0;  // seconds spent in ops this one called
  };
  static std::map<std::string, double>& totals() {
    static std::map<std::string, double> t;
    return t;
  }
  static std::map<std::string, double>& by_op() {
    static std::map<std::string, double> t;
    return t;
  }
  static std::thread::id& owner() {
    static std::thread::id id;
    return id;
  }
  static std::vector<Frame>& stack() {
    thread_local std::vector<Frame> s;
    return s;
  }
  static bool starts_with(const char* s, const char* prefix) { return std::strncmp(s, prefix, std::strlen(prefix)) == 0; }
  static bool contains(const char* s, const char* part) { return std::strstr(s, part) != nullptr; }

  // The phase of the op on top of the stack: the innermost qlora scope, else by the op's name.
  static std::string phase_of(const std::vector<Frame>& s) {
    for (auto it = s.rbegin(); it != s.rend(); ++it)
      if (starts_with(it->name, "qlora::")) return it->name + 7;
    const char* op = s.back().name;
    if (contains(op, "scaled_dot_product") || contains(op, "flash_attention")) return "attention";
    for (const char* g : {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"})
      if (std::strcmp(op, g) == 0) return "gemm_other";
    return "elementwise_other";
  }

  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (std::this_thread::get_id() != owner()) return nullptr;
    stack().push_back({fn.name(), Clock::now()});
    return nullptr;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext*) {
    if (std::this_thread::get_id() != owner()) return;
    std::vector<Frame>& s = stack();
    if (s.empty()) return;
    const double total = std::chrono::duration<double>(Clock::now() - s.back().start).count();
    const std::string phase = phase_of(s);
    totals()[phase] += total - s.back().children;
    by_op()[phase + ": " + s.back().name] += total - s.back().children;
    s.pop_back();
    if (!s.empty()) s.back().children += total;
  }

  at::CallbackHandle handle_;
};

// The breakdown of one profiled step taking `step_s` seconds: seconds per phase, "untracked", and
// each phase's share of the step.
inline nlohmann::json phase_breakdown(const StepProfile& prof, double step_s) {
  const std::map<std::string, double> phases = prof.phases();
  nlohmann::json seconds = nlohmann::json::object(), share = nlohmann::json::object();
  double tracked = 0.0;
  for (const auto& [name, s] : phases) {
    seconds[name] = s;
    share[name] = s / step_s;
    tracked += s;
  }
  seconds["untracked"] = std::max(0.0, step_s - tracked);
  share["untracked"] = std::max(0.0, step_s - tracked) / step_s;
  nlohmann::json top = nlohmann::json::array();
  for (const auto& [op, s] : prof.top_ops(20)) top.push_back({{"op", op}, {"seconds", s}});
  return {{"profiled_step_s", step_s}, {"seconds", seconds}, {"share", share}, {"top_ops", top}};
}

// A frozen projection's shape, [out, in], and how many times the step runs it.
struct GemmShape {
  int64_t out, in, count;
};

// The GEMM floor of a step over `tokens` tokens: for every shape, x[tokens, in] @ W^T and
// gy[tokens, out] @ W in `dtype` (the step's compute dtype; bf16 accumulates in fp32), `count`
// times; the median of `reps` passes, in seconds.
inline double gemm_floor_s(const std::vector<GemmShape>& shapes, int64_t tokens, at::ScalarType dtype = at::kFloat,
                           int reps = 3) {
  std::vector<double> times;
  const at::TensorOptions f32 = at::TensorOptions().dtype(dtype);
  for (int r = 0; r <= reps; ++r) {  // pass 0 warms up
    double t = 0.0;
    for (const GemmShape& g : shapes) {
      const at::Tensor w = at::randn({g.out, g.in}, f32), x = at::randn({tokens, g.in}, f32);
      const at::Tensor gy = at::randn({tokens, g.out}, f32);
      at::Tensor y = at::empty({tokens, g.out}, f32), gx = at::empty({tokens, g.in}, f32);
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < g.count; ++i) {
        at::mm_out(y, x, w.t());
        at::mm_out(gx, gy, w);
      }
      t += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (r > 0) times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace qlora::bench
