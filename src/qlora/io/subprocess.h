// Running a user's program: `/bin/sh -c COMMAND` in a process group of its own, its stdin fed from
// a string while its stdout and stderr are read (one poll loop: neither side can block the other,
// however much either writes), under a deadline that kills the whole group. The GRPO reward
// command (train/reward_command.h) is its user.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace qlora::io {

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

// Runs `command` with `input` on its stdin (closed after it) and waits until it exits or
// `timeout_s` passes (then SIGKILL to its process group, reaped before returning). SIGPIPE does not
// reach this process: a program that stops reading only ends its input early. Throws
// std::runtime_error when the program cannot be started (pipe, fork).
SubprocessResult run_subprocess(const std::string& command, std::string_view input, double timeout_s);

// "exited with code 3", "was killed by signal 9 (Killed)": a waitpid status in words.
std::string describe_exit(int status);

}  // namespace qlora::io
