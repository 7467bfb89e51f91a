// Runs a test body in N real rank processes (fork), each joined to one World over a fresh local
// port, and collects their exit codes and stderr. Shared by the dist tests.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "qlora/engine/launcher.h"
#include "qlora/engine/process_group.h"

namespace qlora::engine::testing {

struct Result {
  std::vector<int> exit_codes;  // per rank; 128 + signal when killed
  std::vector<std::string> stderr_text;
  double seconds = 0;
};

// Runs body(world) in `n` forked ranks; a rank's exit code is 0 when body returns, 1 when it
// throws (the message goes to that rank's stderr, captured).
inline Result run_ranks(int n, int64_t shard_size, const std::function<void(World&)>& body,
                 const std::vector<std::pair<std::string, std::string>>& env = {}) {
  const int port = free_tcp_port("127.0.0.1");
  const std::string dir = ::testing::TempDir();
  std::vector<pid_t> pids;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string log = dir + "/pg_rank" + std::to_string(r) + "_" + std::to_string(::getppid()) + ".log";
      std::freopen(log.c_str(), "w", stderr);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      at::set_num_threads(1);
      int code = 0;
      try {
        RankEnv e;
        e.rank = r;
        e.world_size = n;
        e.local_world_size = n;
        e.master_port = port;
        auto w = World::join(e, shard_size, std::chrono::seconds(20), c10::kCPU);
        try {
          body(*w);
        } catch (const std::exception& ex) {
          w->rethrow_with_culprits(ex, "the test body");
        }
        w->finish();
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "error: %s\n", ex.what());
        code = 1;
      }
      std::fflush(stderr);
      std::_Exit(code);
    }
    pids.push_back(pid);
  }
  Result res;
  std::vector<int> status(n, 0);
  std::vector<bool> done(n, false);
  // A rank that is still there 90 s in (a stopped one: its pending signals wait for SIGCONT) is
  // killed, so the test ends and reports it instead of hanging.
  for (int left = n; left > 0;) {
    for (int r = 0; r < n; ++r)
      if (!done[r] && ::waitpid(pids[r], &status[r], WNOHANG) == pids[r]) done[r] = true, --left;
    if (left && std::chrono::steady_clock::now() - t0 > std::chrono::seconds(90))
      for (int r = 0; r < n; ++r)
        if (!done[r]) ::kill(pids[r], SIGKILL);
    if (left) ::usleep(20000);
  }
  for (int r = 0; r < n; ++r) {
    res.exit_codes.push_back(WIFEXITED(status[r]) ? WEXITSTATUS(status[r]) : 128 + WTERMSIG(status[r]));
    std::ifstream f(dir + "/pg_rank" + std::to_string(r) + "_" + std::to_string(::getpid()) + ".log");
    std::stringstream ss;
    ss << f.rdbuf();
    res.stderr_text.push_back(ss.str());
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

inline void expect_all_ok(const Result& res) {
  for (size_t r = 0; r < res.exit_codes.size(); ++r)
    EXPECT_EQ(res.exit_codes[r], 0) << "rank " << r << ": " << res.stderr_text[r];
}

inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

}  // namespace qlora::engine::testing
