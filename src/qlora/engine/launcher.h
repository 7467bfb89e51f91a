// `qlora run --nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P] RECIPE ...`
// spawns this node's N ranks of the same binary with torchrun's environment (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a rank started by torchrun, Slurm or
// by hand sees exactly what it would see here.
//
// Output: rank 0 keeps the launcher's stdout (its progress bar still sees a terminal); every
// other stream is read line by line and printed with a "[rank K] " prefix, so errors say whose
// they are. Failure: when one rank exits non-zero or dies by a signal, the launcher names it, sends
// SIGTERM to the others, SIGKILL after a grace period, and exits non-zero. SIGINT/SIGTERM to the
// launcher are passed on to the ranks.
#pragma once

#include <string>
#include <vector>

namespace qlora::engine {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port on this machine (single node only)
  double kill_grace_s = 10.0;
};

// Consumes the launcher flags at the front of `args` (up to the recipe name) and validates them;
// errors name the flag.
LaunchOptions parse_launch_args(std::vector<std::string>& args);

// A TCP port on `addr` that nobody listens on right now (bind to port 0, read it, close).
int free_tcp_port(const std::string& addr);

// True when this process is a rank of a multi-process job (WORLD_SIZE > 1 in the environment).
bool launched_as_rank();

// Starts the ranks as `exe <args...>` (for qlora: `run lora_finetune ...`) and supervises them;
// returns the exit code for the launcher (0 when every rank exited 0).
int launch(const LaunchOptions& options, const std::string& exe, const std::vector<std::string>& args);

// OpenMP's wait policy. libgomp (the torch wheel's OpenMP) spins an idle worker 300000 times
// (GOMP_SPINCOUNT; ~7 ms at ~25 ns per pause on an EPYC) before it sleeps; beside another busy
// process those spinning threads take its core and a step slows ~3x. Fully passive workers (sleep
// at once) are fair but slow alone: waking one costs ~90 us on a VM, more than most elementwise
// ops and skinny GEMMs of a step take (a 100M step: 1.80 s passive vs 1.66 s spinning). A short
// spin, 3000 pauses (~75 us), catches the next parallel region of the same step (1.66 s alone) and
// costs a competitor little (2.0x beside `yes`, passive 1.8x, 300000 spins 3.0x).
// qlora's processes therefore run with kOmpWaitPolicy unless the environment already sets
// OMP_WAIT_POLICY or GOMP_SPINCOUNT (the user's choice wins). libgomp
// reads them once, in its own initialiser before main, so setting them needs a fresh exec:
// QLORA_OMP_WAIT_POLICY_PREINIT, in the executable's main file, runs omp_wait_policy_preinit
// before any library initialiser, which re-executes /proc/self/exe with the same argv and the
// variable added (then set, so there is no second re-exec; when the exec fails the process simply
// goes on). Ranks started by launch() inherit it with the environment.
inline constexpr const char* kOmpWaitPolicy = "GOMP_SPINCOUNT=3000";
void omp_wait_policy_preinit(int argc, char** argv, char** envp);

}  // namespace qlora::engine

// Nothing of libc or the C++ runtime is initialised when it runs: it only reads envp and execs.
#define QLORA_OMP_WAIT_POLICY_PREINIT \
  [[gnu::section(".preinit_array"), gnu::used]] static auto* qlora_omp_wait_policy_preinit = \
      &qlora::engine::omp_wait_policy_preinit
