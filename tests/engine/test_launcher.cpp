// engine/launcher.h: the ranks of `qlora run --nproc-per-node N` started and supervised, with
// /bin/sh standing in for the rank binary: each rank's environment, its output passed on (rank 0's
// stdout untouched, every other stream prefixed by its rank, line by line), the exit code, a failed
// rank stopping the others (SIGTERM, then SIGKILL after the grace period) and SIGTERM to the
// launcher passed on to the ranks. recipe.lora_finetune_ranks and recipe.nodes run the real thing.
#include "qlora/engine/launcher.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

using namespace qlora::engine;

namespace {

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

struct Launched {
  int code = -1;
  std::string out, err;
  double seconds = 0;
};

// launch(o) of `/bin/sh -c script` with the launcher's stdout and stderr captured.
Launched run(const LaunchOptions& o, const std::string& script) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  Launched l;
  l.code = launch(o, "/bin/sh", {"-c", script});
  l.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  l.err = ::testing::internal::GetCapturedStderr();
  l.out = ::testing::internal::GetCapturedStdout();
  return l;
}

LaunchOptions ranks(int n) {
  LaunchOptions o;
  o.nproc_per_node = n;
  o.kill_grace_s = 0.5;
  return o;
}

}  // namespace

TEST(Launcher, EnvironmentOfEachRank) {
  ::setenv("RANK", "99", 1);  // replaced, not inherited
  ::setenv("QLORA_LAUNCHER_TEST", "kept", 1);
  LaunchOptions o = ranks(2);
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_port = 23456;
  const Launched l =
      run(o, "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT "
             "$QLORA_LAUNCHER_TEST\" >&2");
  ::unsetenv("RANK");
  ::unsetenv("QLORA_LAUNCHER_TEST");
  EXPECT_EQ(l.code, 0) << l.err;
  EXPECT_CONTAINS(l.err, "[rank 2] 2 4 0 2 1 127.0.0.1 23456 kept\n");
  EXPECT_CONTAINS(l.err, "[rank 3] 3 4 1 2 1 127.0.0.1 23456 kept\n");
}

TEST(Launcher, FreePortWhenNoneIsGiven) {
  const Launched l = run(ranks(1), "echo \"port=$MASTER_PORT\" >&2");
  EXPECT_EQ(l.code, 0);
  const size_t at = l.err.find("[rank 0] port=");
  ASSERT_NE(at, std::string::npos) << l.err;
  EXPECT_GT(std::stoi(l.err.substr(at + 14)), 0);
}

TEST(Launcher, OutputPassedOnPerRank) {
  const Launched l = run(ranks(2), "printf 'out%s\\nmore' \"$RANK\"; printf 'err%s' \"$RANK\" >&2");
  EXPECT_EQ(l.code, 0);
  EXPECT_EQ(l.out, "out0\nmore");  // rank 0's stdout is the launcher's, untouched
  EXPECT_CONTAINS(l.err, "[rank 1] out1\n");
  EXPECT_CONTAINS(l.err, "[rank 1] more\n");  // a last line without a newline ends with its stream
  EXPECT_CONTAINS(l.err, "[rank 1] err1\n");
  EXPECT_CONTAINS(l.err, "[rank 0] err0\n");
}

TEST(Launcher, FailedRankStopsTheOthersAndGivesItsExitCode) {
  // Rank 0 ignores SIGTERM (it gets SIGKILL after the grace period); rank 2 dies of it.
  const Launched l = run(ranks(3), "if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; "
                                   "if [ $RANK = 0 ]; then trap '' TERM; fi; exec sleep 30");
  EXPECT_EQ(l.code, 3);
  EXPECT_CONTAINS(l.err, "[launcher] rank 1 exited with code 3; stopping the other ranks\n");
  EXPECT_EQ(l.err.find("[launcher] rank 0"), std::string::npos) << l.err;  // the first failure only
  EXPECT_LT(l.seconds, 10);
}

TEST(Launcher, KilledRankGives128PlusItsSignal) {
  const Launched l = run(ranks(2), "if [ $RANK = 1 ]; then kill -9 $$; fi; exec sleep 30");
  EXPECT_EQ(l.code, 128 + 9);
  EXPECT_CONTAINS(l.err, "[launcher] rank 1 was killed by signal 9 (Killed); stopping the other ranks\n");
  EXPECT_LT(l.seconds, 10);
}

TEST(Launcher, SigtermToTheLauncherReachesEveryRank) {
  struct sigaction before{};
  ::sigaction(SIGTERM, nullptr, &before);
  // Rank 1 signals its parent, the launcher (this test), which passes SIGTERM on to both ranks.
  const Launched l = run(ranks(2), "if [ $RANK = 1 ]; then kill -TERM $PPID; fi; exec sleep 30");
  EXPECT_EQ(l.code, 128 + SIGTERM);
  EXPECT_CONTAINS(l.err, "[launcher] Terminated: stopping the ranks\n");
  EXPECT_EQ(l.err.find("stopping the other ranks"), std::string::npos) << l.err;
  EXPECT_LT(l.seconds, 10);
  struct sigaction after{};
  ::sigaction(SIGTERM, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);  // the launcher's handler is gone again
}

TEST(Launcher, RankBinaryThatCannotBeExec) {
  ::testing::internal::CaptureStderr();
  const int code = launch(ranks(1), "/nonexistent/qlora", {"run"});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 127);
  EXPECT_CONTAINS(err, "[rank 0] cannot exec /nonexistent/qlora\n");
  EXPECT_CONTAINS(err, "[launcher] rank 0 exited with code 127");
}

TEST(Launcher, CheckLaunchOptions) {
  LaunchOptions o;
  o.nnodes = 2;
  o.node_rank = 2;
  EXPECT_THROW(check_launch_options(o), std::invalid_argument);
  o.node_rank = 1;
  EXPECT_THROW(check_launch_options(o), std::invalid_argument);  // several nodes need a port
  o.master_port = 29500;
  EXPECT_NO_THROW(check_launch_options(o));
}
