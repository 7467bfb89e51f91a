// The crash report: a child process installs it and dies of a fault, an abort or a stack
// overflow; its stderr must name the signal and hold the call stack, its exit must still be that
// signal's, and scripts/symbolize_crash.sh must name the function that crashed.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "qlora/io/crash_report.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QLORA_UNDER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define QLORA_UNDER_ASAN 1
#endif

namespace {

// AddressSanitizer owns SIGSEGV and SIGBUS (install_crash_report leaves a handler it finds) and
// aborts on its report: the fault cases are its to report there.
#ifdef QLORA_UNDER_ASAN
#define SKIP_UNDER_ASAN() GTEST_SKIP() << "AddressSanitizer handles SIGSEGV in this build"
#else
#define SKIP_UNDER_ASAN() (void)0
#endif

struct Death {
  int signal = 0;  // 0: the child exited instead
  std::string err;
};

// Runs `die` in a child with the crash report installed; its stderr goes to a file.
Death run_child(const std::function<void()>& die) {
  char path[] = "/tmp/qlora_crash_report_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fd, STDERR_FILENO);
    qlora::io::install_crash_report("/some/dir/crash_test");
    die();
    _exit(0);
  }
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  Death d;
  if (WIFSIGNALED(status)) d.signal = WTERMSIG(status);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  d.err = ss.str();
  std::remove(path);
  return d;
}

int count_frames(const std::string& err) {
  int n = 0;
  for (size_t p = err.find(")[0x"); p != std::string::npos; p = err.find(")[0x", p + 1)) ++n;
  return n;
}

}  // namespace

// Not static and not inlined, so that the binary's symbol table names it.
extern "C" __attribute__((noinline)) void qlora_test_crash_by_null_write() {
  volatile uintptr_t address = 0x10;  // volatile: the compiler cannot see the store is invalid
  *reinterpret_cast<volatile int*>(address) = 1;
}

extern "C" __attribute__((noinline)) int qlora_test_recurse(int n) {
  volatile char pad[4096];
  pad[0] = static_cast<char>(n);
  return qlora_test_recurse(n + 1) + pad[0];
}

TEST(CrashReport, AFaultIsReportedWithItsStackAndStillEndsTheProcessBySignal) {
  SKIP_UNDER_ASAN();
  const Death d = run_child(qlora_test_crash_by_null_write);
  EXPECT_EQ(d.signal, SIGSEGV);
  EXPECT_NE(d.err.find("crash_test: fatal signal 11 (Segmentation fault), address 0x10, pid "), std::string::npos) << d.err;
  EXPECT_GE(count_frames(d.err), 3) << d.err;
}

TEST(CrashReport, AnAbortIsReportedOnceAndStillEndsTheProcessBySignal) {
  const Death d = run_child([] { std::abort(); });
  EXPECT_EQ(d.signal, SIGABRT);
  EXPECT_NE(d.err.find("crash_test: fatal signal 6 (Aborted), sent by pid "), std::string::npos) << d.err;
  EXPECT_EQ(d.err.find("fatal signal"), d.err.rfind("fatal signal")) << d.err;
  EXPECT_GE(count_frames(d.err), 3) << d.err;
}

TEST(CrashReport, AStackOverflowIsReported) {
  SKIP_UNDER_ASAN();
  const Death d = run_child([] { (void)qlora_test_recurse(0); });
  EXPECT_EQ(d.signal, SIGSEGV);
  EXPECT_NE(d.err.find("crash_test: fatal signal 11 (Segmentation fault)"), std::string::npos) << d.err;
}

// The symbolizer turns the binary's own module(+offset) frames into function names.
TEST(CrashReport, SymbolizeCrashNamesTheFunctionThatCrashed) {
  SKIP_UNDER_ASAN();
  if (std::system("command -v addr2line > /dev/null 2>&1") != 0) GTEST_SKIP() << "no addr2line (binutils)";
  const Death d = run_child(qlora_test_crash_by_null_write);
  ASSERT_EQ(d.signal, SIGSEGV);
  char log[] = "/tmp/qlora_crash_log_XXXXXX";
  const int fd = mkstemp(log);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, d.err.data(), d.err.size()), static_cast<ssize_t>(d.err.size()));
  close(fd);
  const std::string cmd = std::string("bash ") + QLORA_SOURCE_DIR + "/scripts/symbolize_crash.sh " + log;
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int rc = pclose(p);
  std::remove(log);
  EXPECT_EQ(rc, 0) << out;
  const size_t first = out.find("qlora_test_crash_by_null_write");
  ASSERT_NE(first, std::string::npos) << out;
  // Innermost first: the crashing function comes before the one that called it.
  const size_t caller = out.find("run_child");
  ASSERT_NE(caller, std::string::npos) << out;
  EXPECT_LT(first, caller) << out;
}
