#include "qlora/engine/launcher.h"
#include "qlora/io/subprocess.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace qlora::engine {

// torchrun does the same; the small window before rank 0 binds the port is accepted.
int free_tcp_port(const std::string& addr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("launcher: socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1) a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("launcher: cannot find a free port on " + addr + ": " + err);
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

namespace {

using Clock = std::chrono::steady_clock;

struct Rank {
  io::Process process;
  int rank = 0;
};

volatile sig_atomic_t g_forward_signal = 0;
void on_signal(int sig) { g_forward_signal = sig; }

// SIGINT and SIGTERM caught (for the launcher to pass on to the ranks) while this lives. Installed
// before the ranks start, so a Ctrl-C while they start still reaches them all.
class ForwardedSignals {
 public:
  ForwardedSignals() {
    g_forward_signal = 0;
    struct sigaction sa{};
    sa.sa_handler = on_signal;
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~ForwardedSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  ForwardedSignals(const ForwardedSignals&) = delete;
  ForwardedSignals& operator=(const ForwardedSignals&) = delete;

 private:
  struct sigaction old_int_{}, old_term_{};
};

// One rank's stream printed on the launcher's stderr line by line, each line prefixed "[rank K] "
// (a PipePump sink: an empty view is the end of the stream, which ends its last line too).
struct RankLines {
  int rank;
  std::string pending;  // bytes after the last newline

  void operator()(std::string_view bytes) {
    pending.append(bytes);
    size_t start = 0;
    for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1)
      std::fprintf(stderr, "[rank %d] %.*s\n", rank, static_cast<int>(nl - start), pending.data() + start);
    pending.erase(0, start);
    if (bytes.empty() && !pending.empty()) {
      std::fprintf(stderr, "[rank %d] %s\n", rank, pending.c_str());
      pending.clear();
    }
    std::fflush(stderr);
  }
};

// This process's environment with torchrun's variables set for `rank` (any inherited ones replaced).
std::vector<std::string> rank_env(const LaunchOptions& o, int rank, int local, int port) {
  const std::pair<std::string_view, std::string> set[] = {{"RANK", std::to_string(rank)},
                                                          {"WORLD_SIZE", std::to_string(o.nproc_per_node * o.nnodes)},
                                                          {"LOCAL_RANK", std::to_string(local)},
                                                          {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
                                                          {"GROUP_RANK", std::to_string(o.node_rank)},
                                                          {"MASTER_ADDR", o.master_addr},
                                                          {"MASTER_PORT", std::to_string(port)}};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view kv(*e), k = kv.substr(0, kv.find('='));
    if (std::none_of(std::begin(set), std::end(set), [&](const auto& s) { return s.first == k; })) env.emplace_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(std::string(k) + "=" + v);
  return env;
}

// This node's ranks started as `exe args...`; their piped streams handed to `pump`. Rank 0 keeps
// the launcher's stdout (its progress bar still sees a terminal). A rank that cannot be started
// throws; the ones started before it are killed and reaped as `ranks` goes.
std::vector<Rank> start_ranks(const LaunchOptions& o, const std::string& exe, const std::vector<std::string>& args,
                              io::PipePump& pump) {
  const int port = o.master_port ? o.master_port : free_tcp_port(o.master_addr);
  io::SpawnOptions spawn;
  spawn.argv = {exe};
  spawn.argv.insert(spawn.argv.end(), args.begin(), args.end());
  spawn.pipe_stderr = true;
  spawn.parent_death_signal = SIGTERM;  // a launcher killed outright takes its ranks along
  std::vector<Rank> ranks;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    const int rank = o.node_rank * o.nproc_per_node + local;
    spawn.env = rank_env(o, rank, local, port);
    spawn.pipe_stdout = rank != 0;
    try {
      ranks.push_back({io::Process(spawn), rank});
    } catch (const std::system_error& e) {
      throw std::runtime_error("launcher: cannot start rank " + std::to_string(rank) + ": " + e.code().message());
    }
    pump.read_from(ranks.back().process.take_stdout(), RankLines{rank, {}});
    pump.read_from(ranks.back().process.take_stderr(), RankLines{rank, {}});
  }
  return ranks;
}

// The ranks watched until all have exited and their output has ended. The first failure (a rank
// exiting non-zero or killed, or SIGINT/SIGTERM to the launcher) sends SIGTERM (or that signal) to
// the ranks still running, and SIGKILL once `grace_s` has passed; it also fixes the exit code.
class Supervisor {
 public:
  Supervisor(std::vector<Rank>& ranks, double grace_s) : ranks_(ranks), grace_s_(grace_s) {}

  int run(io::PipePump& pump) {
    size_t running = ranks_.size();
    while (running > 0 || pump.reading()) {
      pump.step(std::chrono::milliseconds(100));  // forwards output; a signal ends its wait
      if (g_forward_signal && !stopping_) {
        std::fprintf(stderr, "[launcher] %s: stopping the ranks\n", strsignal(g_forward_signal));
        stop(g_forward_signal, 128 + g_forward_signal);
      }
      for (Rank& r : ranks_)
        if (r.process.running() && r.process.poll_exit()) --running, exited(r);
      if (stopping_ && running > 0 && Clock::now() > kill_at_) {
        signal_all(SIGKILL);
        kill_at_ = Clock::time_point::max();
      }
    }
    return exit_code_;  // 0 only when every rank exited 0
  }

 private:
  void exited(const Rank& r) {
    const int status = r.process.status();
    if ((WIFEXITED(status) && WEXITSTATUS(status) == 0) || stopping_) return;
    std::fprintf(stderr, "[launcher] rank %d %s; stopping the other ranks\n", r.rank, io::describe_exit(status).c_str());
    stop(SIGTERM, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  void stop(int sig, int exit_code) {
    stopping_ = true;
    exit_code_ = exit_code;
    signal_all(sig);
    kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s_ * 1000));
  }
  void signal_all(int sig) {
    for (const Rank& r : ranks_) r.process.signal(sig);  // only those not reaped yet
  }

  std::vector<Rank>& ranks_;
  const double grace_s_;
  int exit_code_ = 0;
  bool stopping_ = false;
  Clock::time_point kill_at_{};
};

}  // namespace

void check_launch_options(const LaunchOptions& o) {
  if (o.node_rank >= o.nnodes)
    throw std::invalid_argument("--node-rank " + std::to_string(o.node_rank) + " must be below --nnodes " +
                                std::to_string(o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw std::invalid_argument("--nnodes " + std::to_string(o.nnodes) +
                                " needs --master-port (the same on every node) and --master-addr of node 0");
}

bool launched_as_rank() {
  const char* w = std::getenv("WORLD_SIZE");
  return w && std::atoi(w) > 1;
}

int launch(const LaunchOptions& o, const std::string& exe, const std::vector<std::string>& args) {
  const ForwardedSignals forwarded;
  io::PipePump pump;
  std::vector<Rank> ranks = start_ranks(o, exe, args, pump);
  return Supervisor(ranks, o.kill_grace_s).run(pump);
}

}  // namespace qlora::engine
