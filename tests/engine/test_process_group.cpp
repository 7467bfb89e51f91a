// Process groups across real processes (fork): collectives on the world, shard and replica groups
// for full sharding and HSDP, and failure handling — a dead rank is named within seconds, a
// stopped one is caught by the heartbeat watchdog.
#include "qlora/engine/process_group.h"

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

#include "fork_ranks.h"

using namespace qlora::engine;
using namespace qlora::engine::testing;

namespace {

// Each rank contributes values that encode (rank, index), so every placement error shows.
void collectives_on(Comm& c) {
  const int n = c.size(), r = c.rank();
  const at::Tensor mine = at::arange(5, at::kFloat) + 100.0f * r;  // [5]
  at::Tensor gathered = at::empty({5 * n});
  wait(c.all_gather(gathered, mine));
  for (int k = 0; k < n; ++k)
    check(at::equal(gathered.narrow(0, 5 * k, 5), at::arange(5, at::kFloat) + 100.0f * k), "all_gather fp32");
  const at::Tensor bytes = at::full({7}, r + 1, at::kByte);  // NF4 codes travel as bytes
  at::Tensor gbytes = at::empty({7 * n}, at::kByte);
  wait(c.all_gather(gbytes, bytes));
  for (int k = 0; k < n; ++k) check(gbytes[7 * k].item<int>() == k + 1, "all_gather uint8");
  const at::Tensor full = at::arange(3 * n, at::kFloat) * (r + 1);  // [3n]
  at::Tensor part = at::empty({3});
  wait(c.reduce_scatter_sum(part, full));
  const double ranks_sum = n * (n + 1) / 2.0;
  check(at::allclose(part, (at::arange(3, at::kFloat) + 3 * r) * ranks_sum), "reduce_scatter");
  at::Tensor one = at::full({1}, double(r));
  wait(c.all_reduce_sum(one));
  check(one.item<double>() == n * (n - 1) / 2.0, "all_reduce");
  c.barrier();
}

}  // namespace

TEST(ProcessGroup, CollectivesOnOneToFourRanks) {
  for (int n = 1; n <= 4; ++n) {
    const Result res = run_ranks(n, 0, [](World& w) {
      check(w.shard().size() == w.size() && w.replica().size() == 1, "full sharding mesh");
      collectives_on(w.world());
    });
    expect_all_ok(res);
  }
}

TEST(ProcessGroup, HsdpMeshTwoByTwo) {
  const Result res = run_ranks(4, 2, [](World& w) {
    // Shard groups {0,1} {2,3}; replica groups {0,2} {1,3}.
    const int r = w.rank();
    check(w.shard().global_ranks() == std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}, "shard members");
    check(w.replica().global_ranks() == std::vector<int>{r % 2, r % 2 + 2}, "replica members");
    check(w.shard().rank() == r % 2 && w.replica().rank() == r / 2, "ranks within groups");
    collectives_on(w.shard());
    collectives_on(w.replica());
    collectives_on(w.world());
  });
  expect_all_ok(res);
}

TEST(ProcessGroup, ShardSizeMustDivideTheWorld) {
  const Result res = run_ranks(3, 2, [](World&) {});
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(res.exit_codes[r], 1);
    EXPECT_NE(res.stderr_text[r].find("dist.shard_size 2 must divide the world size 3"), std::string::npos)
        << res.stderr_text[r];
  }
}

TEST(ProcessGroup, DeadRankIsNamedBySurvivors) {
  const Result res = run_ranks(3, 0, [](World& w) {
    collectives_on(w.world());
    if (w.rank() == 2) ::raise(SIGKILL);  // dies without a word
    for (int i = 0; i < 3; ++i) collectives_on(w.world());
  });
  EXPECT_EQ(res.exit_codes[2], 128 + SIGKILL);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(res.exit_codes[r], 1) << res.stderr_text[r];
    EXPECT_NE(res.stderr_text[r].find("rank 2"), std::string::npos) << res.stderr_text[r];
  }
  EXPECT_LT(res.seconds, 60.0) << "the issue's bound for noticing a dead peer";
}

TEST(ProcessGroup, StoppedRankIsCaughtByTheWatchdog) {
  // A stopped (SIGSTOP) rank keeps its sockets open: only the heartbeat shows it is gone. The
  // collective timeout (20 s here) is longer than the heartbeat's, so the watchdog must act.
  const Result res = run_ranks(
      3, 0,
      [](World& w) {
        collectives_on(w.world());
        if (w.rank() == 1) {
          // Stopped for good: a helper process wakes and kills it once the others are gone.
          const pid_t me = ::getpid();
          if (::fork() == 0) {
            ::sleep(12);
            ::kill(me, SIGKILL);
            std::_Exit(0);
          }
          ::raise(SIGSTOP);
        }
        collectives_on(w.world());
      },
      {{"QLORA_HEARTBEAT_TIMEOUT_S", "4"}});
  for (int r : {0, 2}) {
    EXPECT_EQ(res.exit_codes[r], 1) << res.stderr_text[r];
    EXPECT_NE(res.stderr_text[r].find("rank 1 has not been heard from"), std::string::npos)
        << "rank " << r << " (exit " << res.exit_codes[r] << "): " << res.stderr_text[r];
  }
  EXPECT_LT(res.seconds, 60.0);
}
