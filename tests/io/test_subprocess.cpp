// io/subprocess.h: Process (fork and exec with pipes, environment, process group, parent-death
// signal), PipePump (one poll loop over pipes) and run_subprocess on them. The reward command
// (tests/train/test_reward_command.cpp) and the launcher (tests/engine/test_launcher.cpp) test
// their users.
#include "qlora/io/subprocess.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

using namespace qlora::io;

namespace {

using Clock = Process::Clock;

SpawnOptions shell(const std::string& script) {
  SpawnOptions o;
  o.argv = {"/bin/sh", "-c", script};
  return o;
}

// Everything the process's piped stdout and stderr say, until both end.
struct Output {
  std::string out, err;
  int out_calls = 0, out_ends = 0;
};
Output read_all(Process& p) {
  Output o;
  PipePump pump;
  pump.read_from(p.take_stdout(), [&o](std::string_view b) {
    ++o.out_calls;
    o.out_ends += b.empty();
    o.out.append(b);
  });
  pump.read_from(p.take_stderr(), [&o](std::string_view b) { o.err.append(b); });
  while (pump.reading()) pump.step(std::chrono::milliseconds(1000));
  return o;
}

// Gone, or a zombie waiting for someone else to reap it.
bool gone(pid_t pid) {
  for (int k = 0; k < 300; ++k) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string p, comm, state;
    if (!(stat >> p >> comm >> state) || state == "Z") return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

TEST(Process, PipesEnvironmentAndExitStatus) {
  SpawnOptions o = shell("echo \"$FOO\"; printf x >&2; exit 3");
  o.env = std::vector<std::string>{"FOO=bar"};
  o.pipe_stdout = o.pipe_stderr = true;
  Process p(o);
  const Output out = read_all(p);
  p.wait();
  EXPECT_EQ(out.out, "bar\n");
  EXPECT_EQ(out.err, "x");
  EXPECT_EQ(out.out_ends, 1);  // the end of the stream reaches the sink once, as an empty view
  EXPECT_FALSE(p.running());
  EXPECT_EQ(describe_exit(p.status()), "exited with code 3");
  EXPECT_FALSE(p.take_stdout());  // handed over already
}

TEST(Process, ProgramThatCannotBeExecSaysSoAndExits127) {
  SpawnOptions o;
  o.argv = {"/nonexistent/program", "arg"};
  o.pipe_stderr = true;
  Process p(o);
  const Output out = read_all(p);
  p.wait();
  EXPECT_EQ(out.err, "cannot exec /nonexistent/program\n");
  EXPECT_EQ(describe_exit(p.status()), "exited with code 127");
}

TEST(Process, DeadlineThenSignalToItsGroup) {
  SpawnOptions o = shell("sleep 30 & echo $!; wait");
  o.own_group = true;
  o.pipe_stdout = true;
  Process p(o);
  Fd out = p.take_stdout();
  std::string line;
  char ch = 0;
  while (::read(out.get(), &ch, 1) == 1 && ch != '\n') line += ch;
  const pid_t child = std::stoi(line);
  const auto t0 = Clock::now();
  EXPECT_FALSE(p.wait_until(t0 + std::chrono::milliseconds(100)));
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(100));
  EXPECT_TRUE(p.running());
  EXPECT_FALSE(p.poll_exit());
  p.signal(SIGKILL);
  EXPECT_TRUE(p.wait_until(Clock::now() + std::chrono::seconds(10)));
  EXPECT_EQ(describe_exit(p.status()), "was killed by signal 9 (Killed)");
  EXPECT_TRUE(gone(child)) << "the shell's child " << child << " outlived its group's SIGKILL";
  p.signal(SIGKILL);  // reaped: nothing to signal, and no other process gets it
}

TEST(Process, DestroyedWhileRunningKillsAndReaps) {
  pid_t pid = 0;
  {
    Process p(shell("exec sleep 30"));
    pid = p.pid();
  }
  errno = 0;
  EXPECT_EQ(::kill(pid, 0), -1);  // not even a zombie: reaped
  EXPECT_EQ(errno, ESRCH);
}

TEST(Process, ParentDeathSignalReachesItWhenTheParentDies) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  std::fflush(nullptr);
  const pid_t parent = ::fork();
  if (parent == 0) {  // a parent that dies once its program runs, passing on the program's pid
    SpawnOptions o = shell("echo $$; exec sleep 30");
    o.parent_death_signal = SIGTERM;
    o.pipe_stdout = true;
    Process child(o);
    const Fd out = child.take_stdout();
    char ch = 0;
    while (::read(out.get(), &ch, 1) == 1 && ::write(p[1], &ch, 1) == 1 && ch != '\n') {
    }
    ::_exit(0);  // no destructor: only the parent-death signal can stop the program
  }
  ::close(p[1]);
  std::string line;
  char ch = 0;
  while (::read(p[0], &ch, 1) == 1 && ch != '\n') line += ch;
  ::close(p[0]);
  ::waitpid(parent, nullptr, 0);
  ASSERT_FALSE(line.empty());
  EXPECT_TRUE(gone(std::stoi(line))) << "the program outlived its parent";
}

TEST(PipePump, WritesAllInputWhileReadingAllOutput) {
  SpawnOptions o = shell("cat");
  o.pipe_stdin = o.pipe_stdout = true;
  Process p(o);
  const std::string input(1 << 20, 'a');  // far past a pipe's 64 KB
  std::string out;
  PipePump pump;
  pump.write_to(p.take_stdin(), input);
  pump.read_from(p.take_stdout(), [&out](std::string_view b) { out.append(b); });
  while (pump.reading()) pump.step(std::chrono::milliseconds(1000));
  p.wait();
  EXPECT_EQ(out, input);
  EXPECT_FALSE(pump.write_failed());
  EXPECT_FALSE(pump.stop_writing());  // closed once all was written
}

TEST(RunSubprocess, OutputCapsAndTail) {
  const SubprocessResult r = run_subprocess("head -c 67108865 /dev/zero; head -c 5000 /dev/zero | tr '\\0' e >&2; echo end >&2",
                                            "", 30);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(describe_exit(r.status), "exited with code 0");
  EXPECT_TRUE(r.out_overflow);
  EXPECT_LE(r.out.size(), kMaxOutBytes);
  EXPECT_EQ(r.err_tail.size(), kMaxErrTail);
  EXPECT_EQ(r.err_tail.substr(kMaxErrTail - 5), "eend\n");
}

TEST(RunSubprocess, InputReadOrNot) {
  SubprocessResult r = run_subprocess("cat", "abc", 10);
  EXPECT_EQ(r.out, "abc");
  EXPECT_FALSE(r.stdin_closed_early);
  r = run_subprocess("exit 0", std::string(1 << 20, 'x'), 10);
  EXPECT_TRUE(r.stdin_closed_early);
  EXPECT_EQ(describe_exit(r.status), "exited with code 0");
}

TEST(RunSubprocess, DeadlineKillsIt) {
  const auto t0 = Clock::now();
  const SubprocessResult r = run_subprocess("echo started >&2; exec sleep 30", "", 0.3);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.err_tail, "started\n");
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
}
