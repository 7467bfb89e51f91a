#include "qlora/io/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace qlora::io {
namespace {

using Clock = Process::Clock;

[[noreturn]] void throw_errno(const char* what) { throw std::system_error(errno, std::generic_category(), what); }

// SIGPIPE blocked in this thread while it writes to a program: a write to a pipe nobody reads
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

// Both ends of a new pipe, close-on-exec.
void make_pipe(Fd& read_end, Fd& write_end) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw_errno("pipe");
  read_end = Fd(p[0]);
  write_end = Fd(p[1]);
}

// execve's view of `v` (null-terminated; the strings stay v's).
std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (const std::string& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// What the new program gets, all built before fork: from fork to exec the child makes only
// async-signal-safe calls.
struct ChildSetup {
  const SpawnOptions& options;
  char* const* argv;
  char* const* envp;
  std::string_view exec_error;
  pid_t parent;
  int in, out, err;  // the child's ends of the pipes; -1: the stream stays this process's
};

[[noreturn]] void become_program(const ChildSetup& c) {
  if (c.options.own_group) ::setpgid(0, 0);
  if (c.options.parent_death_signal) {
    ::prctl(PR_SET_PDEATHSIG, c.options.parent_death_signal);
    if (::getppid() != c.parent) ::_exit(1);  // the parent died before prctl: nobody would signal it
  }
  if (c.in >= 0) ::dup2(c.in, STDIN_FILENO);
  if (c.out >= 0) ::dup2(c.out, STDOUT_FILENO);
  if (c.err >= 0) ::dup2(c.err, STDERR_FILENO);
  ::execve(c.argv[0], c.argv, c.envp);
  (void)!::write(STDERR_FILENO, c.exec_error.data(), c.exec_error.size());
  ::_exit(127);
}

// stdout kept up to kMaxOutBytes (then only counted as too much), stderr's last kMaxErrTail bytes.
void keep_out(SubprocessResult& r, std::string_view bytes) {
  if (r.out.size() + bytes.size() > kMaxOutBytes) r.out_overflow = true;
  else r.out.append(bytes);
}
void keep_err_tail(SubprocessResult& r, std::string_view bytes) {
  r.err_tail.append(bytes);
  if (r.err_tail.size() > kMaxErrTail) r.err_tail.erase(0, r.err_tail.size() - kMaxErrTail);
}

std::chrono::milliseconds until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return std::chrono::milliseconds(std::clamp<int64_t>(left, 0, 1000));
}

Process start_shell(const std::string& command) {
  SpawnOptions o;
  o.argv = {"/bin/sh", "-c", command};
  o.pipe_stdin = o.pipe_stdout = o.pipe_stderr = true;
  o.own_group = true;  // the deadline kills the shell's children and theirs too
  try {
    return Process(o);
  } catch (const std::system_error& e) {
    throw std::runtime_error("cannot start '" + command + "': " + e.what());
  }
}

}  // namespace

// ---- Fd ---------------------------------------------------------------------------------------
Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Fd::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

// ---- Process ----------------------------------------------------------------------------------
Process::Process(const SpawnOptions& o) : own_group_(o.own_group) {
  if (o.argv.empty()) throw std::invalid_argument("Process: no program to run (argv is empty)");
  const std::vector<char*> argv = c_strings(o.argv);
  const std::vector<char*> env = o.env ? c_strings(*o.env) : std::vector<char*>();
  const std::string exec_error = "cannot exec " + o.argv[0] + "\n";
  Fd child_in, child_out, child_err;  // closed here once the child has its copies
  if (o.pipe_stdin) make_pipe(child_in, in_);
  if (o.pipe_stdout) make_pipe(out_, child_out);
  if (o.pipe_stderr) make_pipe(err_, child_err);
  char* const* envp = o.env ? env.data() : environ;
  const ChildSetup setup{o, argv.data(), envp, exec_error, ::getpid(), child_in.get(), child_out.get(), child_err.get()};
  pid_ = ::fork();
  if (pid_ < 0) throw_errno("fork");
  if (pid_ == 0) become_program(setup);
  running_ = true;
  if (own_group_) ::setpgid(pid_, pid_);  // also here: whichever runs first, the group exists before a kill
}

Process::~Process() {
  if (!running_) return;
  signal(SIGKILL);
  try {
    wait();
  } catch (const std::system_error&) {  // not ours to reap any more
  }
}

Process::Process(Process&& o) noexcept
    : pid_(o.pid_), own_group_(o.own_group_), running_(o.running_), status_(o.status_),
      in_(std::move(o.in_)), out_(std::move(o.out_)), err_(std::move(o.err_)) {
  o.running_ = false;
}

bool Process::reap(int options) {
  if (!running_) return true;
  const pid_t r = ::waitpid(pid_, &status_, options);
  if (r == pid_) running_ = false;
  else if (r < 0 && errno != EINTR) throw_errno("waitpid");
  return !running_;
}

bool Process::poll_exit() { return reap(WNOHANG); }

bool Process::wait_until(Clock::time_point deadline) {
  while (!reap(WNOHANG)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

void Process::wait() {
  while (!reap(0)) {
  }
}

void Process::signal(int sig) const {
  if (running_) ::kill(own_group_ ? -pid_ : pid_, sig);
}

// ---- PipePump ---------------------------------------------------------------------------------
void PipePump::read_from(Fd fd, Sink sink) {
  if (fd) readers_.push_back({std::move(fd), std::move(sink)});
}

void PipePump::write_to(Fd fd, std::string_view input) {
  writer_ = std::move(fd);
  input_ = input;
  written_ = 0;
  write_failed_ = false;
  if (writer_ && input.empty()) writer_.close();
  if (writer_) ::fcntl(writer_.get(), F_SETFL, ::fcntl(writer_.get(), F_GETFL) | O_NONBLOCK);
}

void PipePump::step(std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds = {{writer_.get(), POLLOUT, 0}};  // fd -1: skipped
  for (const Reader& r : readers_) fds.push_back({r.fd.get(), POLLIN, 0});
  const int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  if (n < 0 && errno != EINTR) throw std::runtime_error(std::string("poll: ") + std::strerror(errno));
  if (n <= 0) return;
  if (fds[0].revents & (POLLOUT | POLLERR | POLLHUP)) feed();
  for (size_t k = readers_.size(); k-- > 0;)  // from the back: a pipe at its end is erased
    if (fds[k + 1].revents & (POLLIN | POLLERR | POLLHUP)) drain(k);
}

bool PipePump::stop_writing() {
  const bool open = static_cast<bool>(writer_);
  writer_.close();
  return open;
}

// Writes what the pipe takes of the rest of the input; closes it when all is written or nobody reads.
void PipePump::feed() {
  SigpipeBlocked no_sigpipe;
  const ssize_t n = ::write(writer_.get(), input_.data() + written_, std::min<size_t>(input_.size() - written_, 65536));
  if (n > 0) written_ += static_cast<size_t>(n);
  else if (n < 0 && errno != EINTR && errno != EAGAIN) write_failed_ = true, writer_.close();
  if (written_ == input_.size()) writer_.close();
}

// Hands what readers_[k] has to its sink; at end of file (or a read error) closes and erases it.
void PipePump::drain(size_t k) {
  char buf[65536];
  Reader& r = readers_[k];
  const ssize_t n = ::read(r.fd.get(), buf, sizeof buf);
  if (n > 0) return r.sink(std::string_view(buf, static_cast<size_t>(n)));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  r.sink({});
  readers_.erase(readers_.begin() + static_cast<std::ptrdiff_t>(k));
}

// ---- run_subprocess ---------------------------------------------------------------------------
SubprocessResult run_subprocess(const std::string& command, std::string_view input, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  Process p = start_shell(command);
  SubprocessResult r;
  PipePump pump;  // after p: on a throw the pipes close first, then p's destructor kills and reaps the group
  pump.write_to(p.take_stdin(), input);
  pump.read_from(p.take_stdout(), [&r](std::string_view b) { keep_out(r, b); });
  pump.read_from(p.take_stderr(), [&r](std::string_view b) { keep_err_tail(r, b); });
  while (pump.reading() && Clock::now() < deadline) pump.step(until(deadline));
  // Both outputs closed before it took all of its input: it gets end of file now.
  if (!pump.reading() && pump.stop_writing()) r.stdin_closed_early = true;
  if (pump.write_failed()) r.stdin_closed_early = true;
  if (pump.reading() || !p.wait_until(deadline)) {
    r.timed_out = true;
    p.signal(SIGKILL);  // the group: a shell's children and their children too
    p.wait();
  }
  r.status = p.status();
  return r;
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "stopped";
}

}  // namespace qlora::io
