// Replays an optimizer run recorded by tests/conformance/test_optim_torch.py with our AdamW,
// clipping and schedule, and writes what it produced for the script to compare bit for bit.
//   optim_replay IN.safetensors OUT.safetensors
// IN: param.<i> (initial fp32 params), grad.<step>.<i>, and metadata: steps, num_params, lr,
// beta1, beta2, eps, weight_decay, max_norm, schedule (cosine|constant), warmup_steps,
// total_steps, resume_at (0 = never; otherwise the optimizer state is saved to OUT.state, the
// optimizer rebuilt from that file after resume_at steps, and the run continued).
// OUT: param.<i>.step<s>, exp_avg.<i>, exp_avg_sq.<i> (final), norm (fp32 [steps]),
// lr (float64 bits as int64 [steps]: our safetensors layer has no F64).
#include "qlora/io/safetensors.h"
#include "qlora/optim/adamw.h"
#include "qlora/optim/schedule.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

using namespace qlora;

namespace {

std::string meta(const io::SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) throw std::runtime_error(f.path() + ": metadata '" + key + "' missing");
  return it->second;
}
double meta_double(const io::SafetensorsFile& f, const std::string& key) {
  return std::strtod(meta(f, key).c_str(), nullptr);  // Python repr() reads back exactly
}
int64_t meta_int(const io::SafetensorsFile& f, const std::string& key) {
  return std::stoll(meta(f, key));
}

int run(const std::string& in_path, const std::string& out_path) {
  const auto in = io::SafetensorsFile::open(in_path);
  const int64_t steps = meta_int(in, "steps"), n = meta_int(in, "num_params");
  const int64_t resume_at = meta_int(in, "resume_at");
  optim::AdamWOptions o;
  o.lr = meta_double(in, "lr");
  o.beta1 = meta_double(in, "beta1");
  o.beta2 = meta_double(in, "beta2");
  o.eps = meta_double(in, "eps");
  o.weight_decay = meta_double(in, "weight_decay");
  const double max_norm = meta_double(in, "max_norm");
  optim::LrSchedule sched;
  sched.kind = meta(in, "schedule") == "constant" ? optim::ScheduleKind::Constant : optim::ScheduleKind::Cosine;
  sched.base_lr = o.lr;
  sched.warmup_steps = meta_int(in, "warmup_steps");
  sched.total_steps = meta_int(in, "total_steps");

  std::vector<at::Tensor> params;
  for (int64_t i = 0; i < n; ++i) params.push_back(in.tensor("param." + std::to_string(i)).clone());
  auto opt = std::make_unique<optim::AdamW>(params, o);

  std::vector<std::pair<std::string, at::Tensor>> out;
  std::vector<float> norms;
  std::vector<int64_t> lr_bits;
  for (int64_t s = 0; s < steps; ++s) {
    if (resume_at > 0 && s == resume_at) {
      // Through a file, as a real resume goes: params and state saved, everything rebuilt.
      const std::string state_path = out_path + ".state";
      auto state = opt->state_dict();
      for (int64_t i = 0; i < n; ++i) state.emplace_back("param." + std::to_string(i), params[i]);
      io::save_safetensors(state_path, state);
      opt.reset();
      const auto f = io::SafetensorsFile::open(state_path);
      optim::NamedTensors loaded;
      for (int64_t i = 0; i < n; ++i) {
        params[i] = f.tensor("param." + std::to_string(i)).clone();
        for (const char* k : {"exp_avg.", "exp_avg_sq."})
          loaded.emplace_back(k + std::to_string(i), f.tensor(k + std::to_string(i)));
      }
      loaded.emplace_back("step", f.tensor("step"));
      opt = std::make_unique<optim::AdamW>(params, o);
      opt->load_state_dict(loaded);
    }
    for (int64_t i = 0; i < n; ++i)
      params[i].mutable_grad() = in.tensor("grad." + std::to_string(s) + "." + std::to_string(i)).clone();
    norms.push_back(optim::clip_grad_norm_(params, max_norm).item<float>());
    const double lr = sched.lr_at(s);
    int64_t bits;
    std::memcpy(&bits, &lr, sizeof bits);
    lr_bits.push_back(bits);
    opt->set_lr(lr);
    opt->step();
    for (int64_t i = 0; i < n; ++i)
      out.emplace_back("param." + std::to_string(i) + ".step" + std::to_string(s), params[i].clone());
  }
  const auto state = opt->state_dict();
  for (const auto& [name, t] : state)
    if (name != "step") out.emplace_back(name, t);
  out.emplace_back("norm", at::tensor(norms, at::kFloat));
  out.emplace_back("lr", at::tensor(lr_bits, at::kLong));
  io::save_safetensors(out_path, out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN.safetensors OUT.safetensors\n", argv[0]);
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optim_replay: %s\n", e.what());
    return 1;
  }
}
