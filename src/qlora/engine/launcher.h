// `qlora run --nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P] RECIPE ...`
// spawns this node's N ranks of the same binary with torchrun's environment (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a rank started by torchrun, Slurm or
// by hand sees exactly what it would see here.
//
// Output: rank 0 keeps the launcher's stdout (its progress bar still sees a terminal); every
// other stream is read line by line and printed with a "[rank K] " prefix, so errors say whose
// they are. Failure: when one rank exits non-zero or dies by a signal, the launcher names it, sends
// SIGTERM to the others, SIGKILL after a grace period, and exits non-zero. SIGINT/SIGTERM to the
// launcher are passed on to the ranks. The ranks are started and watched with io/subprocess.h
// (io::Process, io::PipePump), which every program qlora runs goes through.
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

// What the flags' ranges alone cannot check (`qlora run` parses them, cli/cli.cpp): the node
// rank below the node count, and a port given for several nodes; errors name the flag.
void check_launch_options(const LaunchOptions& o);

// A TCP port on `addr` that nobody listens on right now (bind to port 0, read it, close).
int free_tcp_port(const std::string& addr);

// True when this process is a rank of a multi-process job (WORLD_SIZE > 1 in the environment).
bool launched_as_rank();

// Starts the ranks as `exe <args...>` (for qlora: `run lora_finetune ...`) and supervises them;
// returns the exit code for the launcher (0 when every rank exited 0).
int launch(const LaunchOptions& options, const std::string& exe, const std::vector<std::string>& args);

}  // namespace qlora::engine
