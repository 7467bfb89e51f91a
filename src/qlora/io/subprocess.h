// Running other programs, the one way this project does it: fork and exec (Process), pipes
// written and read in one poll loop (PipePump: neither side can block the other, however much
// either writes), waitpid under a deadline, signals to a program or to its whole process group.
// Two users: run_subprocess below (the GRPO reward command, train/reward_command.h: `/bin/sh -c
// COMMAND` with stdin fed from a string, under a deadline that kills its group) and the launcher's
// ranks (engine/launcher.h: N programs supervised at once, their output forwarded line by line).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace qlora::io {

// A file descriptor, closed when this goes.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { close(); }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void close();

 private:
  int fd_ = -1;
};

// How to start a program.
struct SpawnOptions {
  std::vector<std::string> argv;  // argv[0]: the program's path, run as given (no PATH search)
  std::optional<std::vector<std::string>> env;  // "NAME=value" each; unset: this process's environment
  // A pipe to this process for each stream so marked; the others are this process's own.
  bool pipe_stdin = false, pipe_stdout = false, pipe_stderr = false;
  bool own_group = false;        // a process group of its own: signal() then reaches what it starts too
  int parent_death_signal = 0;   // sent to it when this process dies (Linux PR_SET_PDEATHSIG); 0: none
};

// A started program. This process's ends of its pipes are close-on-exec, so no other program
// inherits them. A Process destroyed while its program runs kills it (SIGKILL, to its group when it
// has one) and reaps it: no program is left unsupervised.
class Process {
 public:
  using Clock = std::chrono::steady_clock;

  // Throws std::system_error ("pipe" or "fork" and errno) when the program cannot be started. A
  // program that cannot be exec'd says "cannot exec ARGV0" on its stderr and exits with code 127.
  explicit Process(const SpawnOptions& options);
  ~Process();
  Process(Process&& o) noexcept;
  Process& operator=(Process&&) = delete;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // This process's end of a piped stream, handed over (an empty Fd when not piped or taken before).
  Fd take_stdin() { return std::move(in_); }
  Fd take_stdout() { return std::move(out_); }
  Fd take_stderr() { return std::move(err_); }

  bool running() const { return running_; }
  int status() const { return status_; }  // waitpid's status, once it has exited
  // Reaps it if it has exited, without waiting; true once it has. Throws on a waitpid error.
  bool poll_exit();
  // Waits until it exits (true) or `deadline` passes (false).
  bool wait_until(Clock::time_point deadline);
  void wait();
  // `sig` to the program, or to its whole group when it has one; nothing once it is reaped.
  void signal(int sig) const;

 private:
  bool reap(int waitpid_options);  // true once reaped
  pid_t pid_ = -1;
  bool own_group_ = false;
  bool running_ = false;
  int status_ = 0;
  Fd in_, out_, err_;
};

// Moves bytes between this process and pipes (a program's stdin, stdout, stderr) in one poll
// loop. Reading: each pipe's bytes go to its sink as they come; at end of file (or a read error)
// the sink gets an empty view once and the pipe is closed. Writing: one pipe is fed a string, then
// closed; a reader that goes away ends it early (EPIPE; SIGPIPE never reaches this process).
class PipePump {
 public:
  using Sink = std::function<void(std::string_view bytes)>;

  void read_from(Fd fd, Sink sink);
  // `input` must outlive the pump's writing; an empty input closes the pipe at once.
  void write_to(Fd fd, std::string_view input);
  // One poll of every open pipe, for up to `timeout`; each ready pipe is handled once. A signal
  // arriving ends the wait early. Throws std::runtime_error when poll fails.
  void step(std::chrono::milliseconds timeout);
  bool reading() const { return !readers_.empty(); }
  // Closes the pipe being written, if still open: true when it was (the reader left input unread).
  bool stop_writing();
  // The reader went away before taking all of the input.
  bool write_failed() const { return write_failed_; }

 private:
  struct Reader {
    Fd fd;
    Sink sink;
  };
  void feed();
  void drain(size_t k);
  std::vector<Reader> readers_;
  Fd writer_;
  std::string_view input_;
  size_t written_ = 0;
  bool write_failed_ = false;
};

struct SubprocessResult {
  int status = 0;          // waitpid's status (meaningless when timed_out)
  bool timed_out = false;  // the deadline passed: the group got SIGKILL
  std::string out;         // stdout, up to kMaxOutBytes
  bool out_overflow = false;  // stdout went past kMaxOutBytes (the rest was read and dropped)
  std::string err_tail;    // the last kMaxErrTail bytes of stderr
  bool stdin_closed_early = false;  // the program exited or closed stdin before reading all input
};

inline constexpr size_t kMaxErrTail = 4096;
inline constexpr size_t kMaxOutBytes = size_t{64} << 20;

// Runs `/bin/sh -c command` in a process group of its own with `input` on its stdin (closed after
// it) and waits until it exits or `timeout_s` passes (then SIGKILL to its process group, reaped
// before returning). SIGPIPE does not reach this process: a program that stops reading only ends
// its input early. Throws std::runtime_error when the program cannot be started (pipe, fork).
SubprocessResult run_subprocess(const std::string& command, std::string_view input, double timeout_s);

// "exited with code 3", "was killed by signal 9 (Killed)": a waitpid status in words.
std::string describe_exit(int status);

}  // namespace qlora::io
