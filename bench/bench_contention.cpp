// Fair under contention, measured in one run and printed as one JSON object: the tiny default run
// (`qlora run lora_finetune`, one epoch of --steps steps, outputs in a temporary directory) alone and
// beside one busy competitor (`yes > /dev/null`), with qlora's defaults (engine/omp_wait_policy.h: a short spin
// OpenMP workers; a model this narrow on one intra-op thread, recipes/lora_finetune.cpp) and, as the
// peer, what they replaced: libgomp's own spinning default (300000 spins before sleeping) on every
// core (--peer sets other variables, e.g. "OMP_WAIT_POLICY=ACTIVE OMP_NUM_THREADS=2"). Target: beside the competitor the default run
// takes at most 2x its time alone. With --reps N the four configurations alternate N times and
// each reports its median.
//
//   build/bench_contention [--steps 40] [--reps 1] [--peer "VAR=VALUE ..."] [--qlora build/qlora]
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/machine.h"
#include "bench/timing.h"

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// `yes > /dev/null` while this lives: killed on scope exit, error included, and with this process.
struct Competitor {
  pid_t pid = ::fork();
  Competitor() {
    if (pid < 0) throw std::runtime_error("cannot fork the competitor");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(::open("/dev/null", O_WRONLY), STDOUT_FILENO);
      ::execlp("yes", "yes", static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Competitor() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
};

using qlora::bench::median;

// Wall seconds of one tiny run under `env` (an `env` command prefix), its output in `dir`.
double run_seconds(const std::string& env, const std::string& qlora, int steps, const fs::path& dir) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path log = dir / "run.log";
  const std::string cmd = env + " " + qlora + " run lora_finetune checkpoint.output_dir=" + (dir / "out").string() +
                          " training.epochs=1 training.max_steps_per_epoch=" + std::to_string(steps) +
                          " logging.progress=plain > " + log.string() + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = std::system(cmd.c_str());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rc != 0) {
    std::stringstream out;
    out << std::ifstream(log).rdbuf();
    throw std::runtime_error("failed (rc " + std::to_string(rc) + "): " + cmd + "\n" + out.str());
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  int steps = 40, reps = 1;
  std::string peer = "GOMP_SPINCOUNT=300000 OMP_NUM_THREADS=" + std::to_string(sysconf(_SC_NPROCESSORS_ONLN));
  std::string qlora = (fs::read_symlink("/proc/self/exe").parent_path() / "qlora").string();
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
    if (s == "--steps") steps = std::stoi(argv[++i]);
    else if (s == "--reps") reps = std::stoi(argv[++i]);
    else if (s == "--peer") peer = argv[++i];
    else if (s == "--qlora") qlora = argv[++i];
    else throw std::invalid_argument("unknown argument " + s + " (--steps N --reps N --peer VAR=VALUE --qlora PATH)");
  }
  // The default: no wait-policy variable, so qlora picks its own; the peer: a spinning one.
  const std::string unset = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u OMP_NUM_THREADS";
  const std::vector<std::pair<std::string, std::string>> policies = {{"default", unset},
                                                                     {"spinning", unset + " " + peer}};
  const fs::path dir = fs::temp_directory_path() / ("qlora_bench_contention_" + std::to_string(::getpid()));
  json r = {{"bench", "contention"}, {"cpu", qlora::bench::cpu_model()}, {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)},
            {"loadavg_before", qlora::bench::load_average()}, {"steps", steps}, {"reps", reps},
            {"run", "qlora run lora_finetune training.epochs=1 training.max_steps_per_epoch=" + std::to_string(steps)},
            {"competitor", "yes > /dev/null"},
            {"policies", {{"default", "none set: qlora's own (engine/omp_wait_policy.h)"}, {"spinning", peer}}}};
  std::map<std::string, std::vector<double>> times;
  for (int rep = 0; rep < reps; ++rep)
    for (const auto& [name, env] : policies) {
      times[name + "_alone"].push_back(run_seconds(env, qlora, steps, dir));
      Competitor busy;
      times[name + "_beside_busy"].push_back(run_seconds(env, qlora, steps, dir));
    }
  fs::remove_all(dir);
  for (const auto& [k, v] : times) {
    r["wall_s"][k] = median(v);
    r["wall_s_each"][k] = v;
  }
  for (const auto& [name, env] : policies)
    r["slowdown_beside_busy"][name] = median(times[name + "_beside_busy"]) / median(times[name + "_alone"]);
  r["default_alone_vs_spinning_alone"] = median(times["default_alone"]) / median(times["spinning_alone"]);
  r["target"] = "slowdown <= 2x beside one busy process (default policy)";
  r["target_met"] = r["slowdown_beside_busy"]["default"].get<double>() <= 2.0;
  r["loadavg_after"] = qlora::bench::load_average();
  std::cout << r.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_contention: " << e.what() << "\n";
  return 1;
}
