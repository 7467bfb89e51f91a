#include "qlora/io/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace qlora::io {
namespace {

using Clock = std::chrono::steady_clock;

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// The three pipes, closed on every way out.
struct Pipes {
  int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
  ~Pipes() {
    for (int* p : {in, out, err}) close_fd(p[0]), close_fd(p[1]);
  }
};

// SIGPIPE blocked in this thread while it writes to the program: a write to a pipe nobody reads
// fails with EPIPE instead of ending this process. The signal that write leaves pending is taken
// before the old mask comes back.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeBlocked() {
    const timespec zero{0, 0};
    while (sigtimedwait(&pipe_, nullptr, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_, old_;
};

pid_t start(const std::string& command, Pipes& p) {
  if (::pipe2(p.in, O_CLOEXEC) != 0 || ::pipe2(p.out, O_CLOEXEC) != 0 || ::pipe2(p.err, O_CLOEXEC) != 0)
    throw std::runtime_error("cannot create pipes for '" + command + "': " + std::strerror(errno));
  const char* argv[] = {"sh", "-c", command.c_str(), nullptr};  // built before fork
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("cannot start '" + command + "': " + std::strerror(errno));
  if (pid == 0) {  // only async-signal-safe calls until exec
    ::setpgid(0, 0);
    ::dup2(p.in[0], STDIN_FILENO);
    ::dup2(p.out[1], STDOUT_FILENO);
    ::dup2(p.err[1], STDERR_FILENO);
    ::execve("/bin/sh", const_cast<char* const*>(argv), environ);
    static const char msg[] = "cannot exec /bin/sh\n";
    (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: whichever runs first, the group exists before a kill
  close_fd(p.in[0]);
  close_fd(p.out[1]);
  close_fd(p.err[1]);
  ::fcntl(p.in[1], F_SETFL, ::fcntl(p.in[1], F_GETFL) | O_NONBLOCK);
  return pid;
}

// Reads what `fd` has: stdout kept up to kMaxOutBytes (then only counted as too much), stderr's
// last kMaxErrTail bytes. Closes it at end of file.
void drain(int& fd, SubprocessResult& r, bool is_err) {
  char buf[65536];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  if (n > 0) {
    std::string& sink = is_err ? r.err_tail : r.out;
    if (!is_err && sink.size() + static_cast<size_t>(n) > kMaxOutBytes) return void(r.out_overflow = true);
    sink.append(buf, static_cast<size_t>(n));
    if (is_err && sink.size() > kMaxErrTail) sink.erase(0, sink.size() - kMaxErrTail);
  } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
    close_fd(fd);
  }
}

// Writes what the pipe takes of input[written:]; closes it when all is written or nobody reads.
void feed(int& fd, std::string_view input, size_t& written, bool& closed_early) {
  const ssize_t n = ::write(fd, input.data() + written, std::min<size_t>(input.size() - written, 65536));
  if (n > 0) written += static_cast<size_t>(n);
  else if (n < 0 && errno != EINTR && errno != EAGAIN) closed_early = true, close_fd(fd);
  if (written == input.size()) close_fd(fd);
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

// Until both output pipes reach end of file or the deadline passes; false on the deadline.
bool pump(Pipes& p, std::string_view input, SubprocessResult& r, Clock::time_point deadline) {
  size_t written = 0;
  if (input.empty()) close_fd(p.in[1]);
  while (p.out[0] >= 0 || p.err[0] >= 0) {
    if (Clock::now() >= deadline) return false;
    pollfd fds[3] = {{p.in[1], POLLOUT, 0}, {p.out[0], POLLIN, 0}, {p.err[0], POLLIN, 0}};  // fd -1: skipped
    const int n = ::poll(fds, 3, remaining_ms(deadline));
    if (n < 0 && errno != EINTR) throw std::runtime_error(std::string("poll: ") + std::strerror(errno));
    if (n <= 0) continue;
    if (fds[0].revents & (POLLOUT | POLLERR | POLLHUP)) feed(p.in[1], input, written, r.stdin_closed_early);
    if (fds[1].revents & (POLLIN | POLLERR | POLLHUP)) drain(p.out[0], r, false);
    if (fds[2].revents & (POLLIN | POLLERR | POLLHUP)) drain(p.err[0], r, true);
  }
  if (p.in[1] >= 0) {  // both outputs closed before it took everything: it gets end of file now
    r.stdin_closed_early = true;
    close_fd(p.in[1]);
  }
  return true;
}

// waitpid until the deadline; false when the program is still running then.
bool reap(pid_t pid, int& status, Clock::time_point deadline) {
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return true;
    if (r < 0 && errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

SubprocessResult run_subprocess(const std::string& command, std::string_view input, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  Pipes p;
  const pid_t pid = start(command, p);
  SubprocessResult r;
  bool done = false;
  try {
    SigpipeBlocked no_sigpipe;
    done = pump(p, input, r, deadline) && reap(pid, r.status, deadline);
  } catch (...) {
    ::kill(-pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    throw;
  }
  if (!done) {
    r.timed_out = true;
    ::kill(-pid, SIGKILL);  // the group: a shell's children and their children too
    while (::waitpid(pid, &r.status, 0) < 0 && errno == EINTR) {
    }
  }
  return r;
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "stopped";
}

}  // namespace qlora::io
