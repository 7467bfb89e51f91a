// Ranks, their process groups and their failure handling.
//
// Rendezvous is c10d's TCPStore (hosted by rank 0) from torchrun's variables or Slurm's;
// collectives are c10d's: ProcessGroupGloo for CPU tensors, ProcessGroupNCCL for CUDA ones.
// The mesh is (replica, shard): `shard_size` consecutive ranks form a shard group (parameters and
// optimizer state are split over it), and ranks with the same position in every shard group form a
// replica group (gradients are all-reduced over it). shard_size = world size is full sharding;
// smaller is HSDP.
//
// Failure: every rank publishes a heartbeat in the store from a thread of its own. A watchdog thread
// ends the process with a message naming the rank when a peer's heartbeat stalls (a dead or
// stopped process; a wedged main thread keeps beating and is caught by the collective timeout
// instead), when a peer reports it failed, or when the store's host (rank 0) stops answering; a
// collective that fails (a peer's socket closed) is turned into an error naming the ranks that
// failed or stopped. Either way no rank hangs silently.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace qlora::engine {

struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "none";  // "torchrun" or "slurm"
};

// torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, else Slurm's
// SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NTASKS_PER_NODE (MASTER_ADDR, else
// SLURM_LAUNCH_NODE_IPADDR); neither: a single rank. Errors name the variable.
RankEnv rank_env_from_environment();

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// One process group. Collectives are asynchronous: wait() on the returned work (it throws on a
// failed or timed-out collective).
class Comm {
 public:
  Comm() = default;
  // entered: counts the collectives this rank has entered (World's progress record); may be null.
  Comm(c10::intrusive_ptr<c10d::Backend> pg, std::vector<int> global_ranks, std::atomic<int64_t>* entered = nullptr);
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(global_ranks_.size()); }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  // out: [size() * in.numel()] flat, same dtype as in: every rank's `in`, in rank order.
  WorkPtr all_gather(at::Tensor out, at::Tensor in);
  // out: [in.numel() / size()]: this rank's slice of the element-wise sum of every rank's `in`.
  WorkPtr reduce_scatter_sum(at::Tensor out, at::Tensor in);
  WorkPtr all_reduce_sum(at::Tensor t);
  // out (on `root` only; ignored elsewhere): [size() * in.numel()] flat, every rank's `in` in rank
  // order. Only the root receives: a state dict for one writer moves no bytes to anyone else.
  WorkPtr gather_to(int root, at::Tensor out, at::Tensor in);
  // timeout: this barrier's own (e.g. a long wait while rank 0 writes an export); default: the
  // group's collective timeout.
  void barrier(std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

 private:
  void enter() {
    if (entered_) entered_->fetch_add(1, std::memory_order_relaxed);
  }
  c10::intrusive_ptr<c10d::Backend> pg_;
  std::vector<int> global_ranks_;
  int rank_ = 0;
  std::atomic<int64_t>* entered_ = nullptr;
};

// Waits for a collective started by Comm (a null work is one that completed at once).
void wait(const WorkPtr& work);

class World {
 public:
  // Joins the job described by `env` (blocks until every rank has joined, or throws after
  // `timeout` naming who is missing). shard_size 0 = world size; it must divide the world size.
  // A world of size 1 (one process) has no store, no heartbeat and collectives that do nothing:
  // the engine runs the same code on it.
  static std::unique_ptr<World> join(const RankEnv& env, int64_t shard_size, std::chrono::seconds timeout,
                                     c10::Device device);
  // A clean end: peers stop watching this rank; rank 0 (the store's host) waits until every rank
  // has finished. Call it after the last collective.
  void finish();
  // Without finish() (an error is unwinding), tells the peers this rank failed so they stop at
  // once; stops the watchdog.
  ~World();

  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  const RankEnv& env() const { return env_; }
  Comm& world() { return world_; }
  Comm& shard() { return shard_; }      // this rank's shard group
  Comm& replica() { return replica_; }  // this rank's replica group (size 1 without HSDP)

  // Rethrows `e`, a failure during `what`, as std::runtime_error naming the ranks whose heartbeat
  // stopped (it watches them for a few seconds first); with every peer alive, the error is this
  // rank's own and comes back with just the rank prepended (one process: as it is).
  [[noreturn]] void rethrow_with_culprits(const std::exception& e, const std::string& what);

  // The training loop's progress: the step about to run. With the count of collectives entered
  // since, the heartbeat publishes it; when a collective times out, a peer whose (step,
  // collectives) lags this rank's is named as the one that hangs (alive, but not getting there).
  void mark_progress(int64_t step);

  // Seconds of silence after which a peer counts as gone (default 30; QLORA_HEARTBEAT_TIMEOUT_S).
  double heartbeat_timeout_s() const { return heartbeat_timeout_s_; }

 private:
  World() = default;
  void watchdog_loop();
  struct Culprits {
    std::vector<int> failed;  // said so (an error unwound them)
    std::vector<int> silent;  // heartbeat stopped, or the store's host is gone
    std::vector<std::pair<int, int64_t>> behind;  // alive but its loop lags this rank's: (rank, its step)
  };
  Culprits culprits(double window_s);
  int64_t counter(const std::string& key);

  RankEnv env_;
  c10::intrusive_ptr<c10d::Store> store_;     // rendezvous and the groups' prefix stores
  c10::intrusive_ptr<c10d::Store> hb_store_;  // heartbeats, done/failed/gone flags: its own socket
  Comm world_, shard_, replica_;
  double heartbeat_timeout_s_ = 30.0;
  std::string failure_reason_;
  std::atomic<int64_t> step_{-1}, entered_{0};  // set by rethrow_with_culprits when a peer is to blame
  std::atomic<bool> stop_{false}, finished_{false};
  std::thread watchdog_;
};

}  // namespace qlora::engine
