#include "qlora/engine/launcher.h"
#include "qlora/io/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
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

struct Stream {
  int fd = -1;
  int rank = 0;
  std::string pending;  // bytes after the last newline
};

struct Child {
  pid_t pid = -1;
  int rank = 0;
  bool running = true;
  int status = 0;
};

volatile sig_atomic_t g_forward_signal = 0;
void on_signal(int sig) { g_forward_signal = sig; }

void emit(Stream& s, const char* data, size_t n, bool flush_all) {
  s.pending.append(data, n);
  size_t start = 0;
  for (size_t nl; (nl = s.pending.find('\n', start)) != std::string::npos; start = nl + 1)
    std::fprintf(stderr, "[rank %d] %.*s\n", s.rank, static_cast<int>(nl - start), s.pending.data() + start);
  s.pending.erase(0, start);
  if (flush_all && !s.pending.empty()) {
    std::fprintf(stderr, "[rank %d] %s\n", s.rank, s.pending.c_str());
    s.pending.clear();
  }
  std::fflush(stderr);
}

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
  const int port = o.master_port ? o.master_port : free_tcp_port(o.master_addr);
  const int world = o.nproc_per_node * o.nnodes;
  std::vector<Child> children;
  std::vector<Stream> streams;
  // Handlers first, so a Ctrl-C while ranks start still reaches them all.
  struct sigaction sa{}, old_int{}, old_term{};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  // argv and the environment are built before fork: the child only calls async-signal-safe
  // functions until exec.
  std::vector<std::string> argv_s = {exe};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t launcher_pid = ::getpid();
  for (int local = 0; local < o.nproc_per_node; ++local) {
    const int rank = o.node_rank * o.nproc_per_node + local;
    std::vector<std::string> env_s;
    for (char** e = environ; *e; ++e) {
      const std::string kv(*e);
      const std::string k = kv.substr(0, kv.find('='));
      if (k != "RANK" && k != "WORLD_SIZE" && k != "LOCAL_RANK" && k != "LOCAL_WORLD_SIZE" && k != "GROUP_RANK" &&
          k != "MASTER_ADDR" && k != "MASTER_PORT")
        env_s.push_back(kv);
    }
    for (const auto& [k, v] : {std::pair<std::string, std::string>{"RANK", std::to_string(rank)},
                               {"WORLD_SIZE", std::to_string(world)},
                               {"LOCAL_RANK", std::to_string(local)},
                               {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
                               {"GROUP_RANK", std::to_string(o.node_rank)},
                               {"MASTER_ADDR", o.master_addr},
                               {"MASTER_PORT", std::to_string(port)}})
      env_s.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
    pid_t pid = -1;
    if ((rank == 0 || ::pipe2(out_pipe, O_CLOEXEC) == 0) && ::pipe2(err_pipe, O_CLOEXEC) == 0) pid = ::fork();
    if (pid < 0) {
      const std::string err = std::strerror(errno);
      for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]})
        if (fd >= 0) ::close(fd);
      for (auto& c : children) ::kill(c.pid, SIGKILL);  // nobody left unsupervised
      for (auto& c : children) ::waitpid(c.pid, nullptr, 0);
      throw std::runtime_error("launcher: cannot start rank " + std::to_string(rank) + ": " + err);
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // a launcher killed outright takes its ranks along
      if (::getppid() != launcher_pid) ::_exit(1);
      if (rank != 0) ::dup2(out_pipe[1], STDOUT_FILENO);  // rank 0 keeps the terminal
      ::dup2(err_pipe[1], STDERR_FILENO);
      ::execve(exe.c_str(), argv.data(), envp.data());
      static const char msg[] = "launcher: cannot exec the rank binary\n";
      (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
      ::_exit(127);
    }
    if (rank != 0) {
      ::close(out_pipe[1]);
      streams.push_back({out_pipe[0], rank, {}});
    }
    ::close(err_pipe[1]);
    streams.push_back({err_pipe[0], rank, {}});
    children.push_back({pid, rank, true, 0});
  }

  int exit_code = 0;
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_at{};
  auto stop_all = [&](int sig) {
    for (auto& c : children)
      if (c.running) ::kill(c.pid, sig);
  };
  size_t running = children.size();
  while (running > 0 || !streams.empty()) {
    // Forward output.
    std::vector<pollfd> fds;
    for (const auto& s : streams) fds.push_back({s.fd, POLLIN, 0});
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (size_t k = fds.size(); k-- > 0;) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[65536];
      const ssize_t n = ::read(streams[k].fd, buf, sizeof(buf));
      if (n > 0) {
        emit(streams[k], buf, static_cast<size_t>(n), false);
      } else if (n == 0 || errno != EINTR) {
        emit(streams[k], "", 0, true);
        ::close(streams[k].fd);
        streams.erase(streams.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
    if (g_forward_signal && !stopping) {
      std::fprintf(stderr, "[launcher] %s: stopping the ranks\n", strsignal(g_forward_signal));
      stopping = true;
      exit_code = 128 + g_forward_signal;
      stop_all(g_forward_signal);
      kill_at = std::chrono::steady_clock::now() +
                std::chrono::milliseconds(static_cast<int64_t>(o.kill_grace_s * 1000));
    }
    // Reap.
    for (auto& c : children) {
      if (!c.running) continue;
      const pid_t r = ::waitpid(c.pid, &c.status, WNOHANG);
      if (r != c.pid) continue;
      c.running = false;
      --running;
      const bool ok = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
      if (!ok && !stopping) {
        std::fprintf(stderr, "[launcher] rank %d %s; stopping the other ranks\n", c.rank, io::describe_exit(c.status).c_str());
        exit_code = WIFEXITED(c.status) ? WEXITSTATUS(c.status) : 128 + WTERMSIG(c.status);
        stopping = true;
        stop_all(SIGTERM);
        kill_at = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(static_cast<int64_t>(o.kill_grace_s * 1000));
      }
    }
    if (stopping && running > 0 && std::chrono::steady_clock::now() > kill_at) {
      stop_all(SIGKILL);
      kill_at = std::chrono::steady_clock::time_point::max();
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return exit_code;  // 0 only when every rank exited 0
}

}  // namespace qlora::engine
