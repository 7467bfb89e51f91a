#include "qlora/io/crash_report.h"

#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace qlora::io {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
constexpr int kMaxFrames = 128;
const char* g_program = "qlora";

// Async-signal-safe output: write(2) only, no stdio, no allocation.
void put(const char* s) {
  size_t n = strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void put_number(uint64_t v, int base) {
  char buf[32];
  int i = sizeof(buf) - 1;
  buf[i] = '\0';
  do {
    buf[--i] = "0123456789abcdef"[v % static_cast<uint64_t>(base)];
    v /= static_cast<uint64_t>(base);
  } while (v && i > 2);
  if (base == 16) {
    buf[--i] = 'x';
    buf[--i] = '0';
  }
  put(buf + i);
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "Segmentation fault";
    case SIGBUS: return "Bus error";
    case SIGILL: return "Illegal instruction";
    case SIGFPE: return "Floating-point exception";
    case SIGABRT: return "Aborted";
    default: return "signal";
  }
}

void on_fatal_signal(int sig, siginfo_t* info, void*) {
  put("\n");
  put(g_program);
  put(": fatal signal ");
  put_number(static_cast<uint64_t>(sig), 10);
  put(" (");
  put(signal_name(sig));
  put(")");
  if (info && info->si_code <= 0) {  // sent (kill, raise, abort): no faulting address
    put(", sent by pid ");
    put_number(static_cast<uint64_t>(info->si_pid), 10);
  } else if (info) {
    put(", address ");
    put_number(reinterpret_cast<uintptr_t>(info->si_addr), 16);
  }
  put(", pid ");
  put_number(static_cast<uint64_t>(::getpid()), 10);
  put(", tid ");
  put_number(static_cast<uint64_t>(::syscall(SYS_gettid)), 10);
  char exe[4096];  // the binary's absolute path: the frames may name it as it was typed
  const ssize_t n_exe = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n_exe > 0) {
    exe[n_exe] = '\0';
    put(", executable ");
    put(exe);
  }
  put("; call stack (innermost first; scripts/symbolize_crash.sh names the module(+offset) frames):\n");
  void* frames[kMaxFrames];
  const int n = ::backtrace(frames, kMaxFrames);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  // SA_RESETHAND restored the default action: a fault returns to the faulting instruction and
  // faults again, an abort (or a signal sent by kill) is raised once more.
  if (sig == SIGABRT || !info || info->si_code <= 0) ::raise(sig);
}

}  // namespace

void install_crash_report(const char* program) {
  if (program && *program) {
    const char* slash = strrchr(program, '/');
    g_program = slash ? slash + 1 : program;
  }
  static bool installed = false;
  if (installed) return;
  installed = true;
  // backtrace() loads libgcc's unwinder on first use, which allocates: do it now, not in the handler.
  void* warm[2];
  (void)::backtrace(warm, 2);
  // An alternate stack, so that a stack overflow can be reported: static, for the process's life
  // (well above MINSIGSTKSZ with AVX-512 state, and what backtrace() needs).
  alignas(64) static char alt_stack[128 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof(alt_stack);
  ::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (const int sig : kSignals) {
    struct sigaction old {};
    // Leave a handler someone else installed (a sanitizer's, a debugger's) in place.
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler != SIG_DFL) continue;
    ::sigaction(sig, &sa, nullptr);
  }
}

}  // namespace qlora::io
