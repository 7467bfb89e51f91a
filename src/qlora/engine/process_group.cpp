#include "qlora/engine/process_group.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "qlora/engine/backends.h"

namespace qlora::engine {
namespace {

constexpr double kHeartbeatInterval = 1.0;  // seconds

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

int env_int(const char* name, int lo, int fallback, bool required) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    if (required) throw std::invalid_argument("environment variable " + std::string(name) + " is not set");
    return fallback;
  }
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > (1 << 20))
    throw std::invalid_argument("environment variable " + std::string(name) + "='" + v + "' is not an integer >= " +
                                std::to_string(lo));
  return static_cast<int>(x);
}

std::string key(const char* what, int rank) { return std::string("qlora/") + what + "/" + std::to_string(rank); }

// Gloo binds where peers can reach it: loopback when the job is on one machine, else the
// interface GLOO_SOCKET_IFNAME names, else this machine's hostname.
std::string gloo_host(const RankEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) return std::string("iface:") + ifname;
  const bool local = env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0;
  return local && env.local_world_size == env.world_size ? "127.0.0.1" : "default";
}

}  // namespace

RankEnv rank_env_from_environment() {
  RankEnv e;
  if (std::getenv("RANK") || std::getenv("WORLD_SIZE")) {
    e.source = "torchrun";
    e.rank = env_int("RANK", 0, 0, true);
    e.world_size = env_int("WORLD_SIZE", 1, 1, true);
    e.local_rank = env_int("LOCAL_RANK", 0, e.rank, false);
    e.local_world_size = env_int("LOCAL_WORLD_SIZE", 1, e.world_size, false);
    e.master_addr = env_or("MASTER_ADDR", "127.0.0.1");
    e.master_port = env_int("MASTER_PORT", 1, 29500, e.world_size > 1);
  } else if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS")) {
    e.source = "slurm";
    e.rank = env_int("SLURM_PROCID", 0, 0, true);
    e.world_size = env_int("SLURM_NTASKS", 1, 1, true);
    e.local_rank = env_int("SLURM_LOCALID", 0, 0, false);
    // SLURM_NTASKS_PER_NODE may read "4(x2)"; its leading number is what we need.
    e.local_world_size = std::max(1, std::atoi(env_or("SLURM_NTASKS_PER_NODE", "1")));
    e.master_addr = env_or("MASTER_ADDR", env_or("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"));
    e.master_port = env_int("MASTER_PORT", 1, 29500, false);
  }
  if (e.rank >= e.world_size)
    throw std::invalid_argument("rank " + std::to_string(e.rank) + " is not below the world size " +
                                std::to_string(e.world_size) + " (" + e.source + " environment)");
  return e;
}

// ---- Comm ---------------------------------------------------------------------------------

Comm::Comm(c10::intrusive_ptr<c10d::Backend> pg, std::vector<int> global_ranks, std::atomic<int64_t>* entered)
    : pg_(std::move(pg)), global_ranks_(std::move(global_ranks)), rank_(pg_ ? pg_->getRank() : 0), entered_(entered) {}

WorkPtr Comm::all_gather(at::Tensor out, at::Tensor in) {
  enter();
  if (out.numel() != in.numel() * size())
    throw std::invalid_argument("all_gather: output has " + std::to_string(out.numel()) + " elements, expected " +
                                std::to_string(size()) + " x " + std::to_string(in.numel()));
  if (size() == 1) {
    out.copy_(in.view({-1}));
    return {};
  }
  return pg_->_allgather_base(out, in);
}

WorkPtr Comm::reduce_scatter_sum(at::Tensor out, at::Tensor in) {
  enter();
  if (in.numel() != out.numel() * size())
    throw std::invalid_argument("reduce_scatter: input has " + std::to_string(in.numel()) + " elements, expected " +
                                std::to_string(size()) + " x " + std::to_string(out.numel()));
  if (size() == 1) {
    out.copy_(in.view({-1}));
    return {};
  }
  if (in.is_cuda()) return pg_->_reduce_scatter_base(out, in);  // NCCL's native form
  // The list form is Gloo's fastest reduce-scatter (measured: ~allreduce cost; the flat
  // _reduce_scatter_base is ~1.5x slower there).
  std::vector<at::Tensor> outs{out};
  std::vector<std::vector<at::Tensor>> ins(1);
  for (int r = 0; r < size(); ++r) ins[0].push_back(in.narrow(0, r * out.numel(), out.numel()));
  return pg_->reduce_scatter(outs, ins);
}

WorkPtr Comm::gather_to(int root, at::Tensor out, at::Tensor in) {
  enter();
  if (rank_ == root && out.numel() != in.numel() * size())
    throw std::invalid_argument("gather_to: output has " + std::to_string(out.numel()) + " elements, expected " +
                                std::to_string(size()) + " x " + std::to_string(in.numel()));
  if (size() == 1) {
    out.copy_(in.view({-1}));
    return {};
  }
  std::vector<std::vector<at::Tensor>> outs;  // Gloo wants none at all on the other ranks
  if (rank_ == root) {
    outs.emplace_back();
    for (int r = 0; r < size(); ++r) outs[0].push_back(out.narrow(0, r * in.numel(), in.numel()));
  }
  std::vector<at::Tensor> ins{in};
  c10d::GatherOptions o;
  o.rootRank = root;
  return pg_->gather(outs, ins, o);
}

WorkPtr Comm::all_reduce_sum(at::Tensor t) {
  enter();
  if (size() == 1) return {};
  std::vector<at::Tensor> v{t};
  return pg_->allreduce(v);
}

void Comm::barrier(std::chrono::milliseconds timeout) {
  enter();
  if (size() == 1) return;
  c10d::BarrierOptions o;
  if (timeout.count() > 0) o.timeout = timeout;
  pg_->barrier(o)->wait();
}

void wait(const WorkPtr& w) {
  if (w) w->wait();
}

// ---- World --------------------------------------------------------------------------------

std::unique_ptr<World> World::join(const RankEnv& env, int64_t shard_size, std::chrono::seconds timeout,
                                   c10::Device device) {
  if (shard_size == 0) shard_size = env.world_size;
  if (shard_size < 1 || env.world_size % shard_size != 0)
    throw std::invalid_argument("dist.shard_size " + std::to_string(shard_size) + " must divide the world size " +
                                std::to_string(env.world_size));
  std::unique_ptr<World> w(new World());
  w->env_ = env;
  if (env.world_size == 1) {  // one process: no store, no peers, collectives that do nothing
    w->world_ = w->shard_ = w->replica_ = Comm(nullptr, {0}, &w->entered_);
    return w;
  }
  if (const char* t = std::getenv("QLORA_HEARTBEAT_TIMEOUT_S")) {
    char* end = nullptr;
    w->heartbeat_timeout_s_ = std::strtod(t, &end);
    if (*end != '\0' || !(w->heartbeat_timeout_s_ >= 3))
      throw std::invalid_argument(std::string("QLORA_HEARTBEAT_TIMEOUT_S='") + t + "' must be a number of seconds >= 3");
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = env.world_size;
  so.waitWorkers = true;
  so.timeout = ms;
  try {
    w->store_ = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    throw std::runtime_error("rank " + std::to_string(env.rank) + ": rendezvous at " + env.master_addr + ":" +
                             std::to_string(env.master_port) + " failed (" + env.source + " environment, " +
                             std::to_string(env.world_size) + " ranks): " + e.what());
  }
  // The heartbeat has its own connection: TCPStore holds a client's lock through blocking calls
  // (NCCL's rendezvous get, finish()'s wait), which must not silence this rank's heartbeat. Its
  // timeout is the heartbeat's, so an unresponsive store host is noticed in that time too.
  c10d::TCPStoreOptions ho;
  ho.port = so.port;
  ho.isServer = false;
  ho.waitWorkers = false;
  ho.timeout = std::chrono::milliseconds(static_cast<int64_t>(w->heartbeat_timeout_s_ * 1000));
  w->hb_store_ = c10::make_intrusive<c10d::TCPStore>(env.master_addr, ho);
  const std::string host = gloo_host(env);
  auto make = [&](const std::string& prefix, const std::vector<int>& members) -> Comm {
    int me = 0;
    while (members[me] != env.rank) ++me;
    if (members.size() == 1) return Comm(nullptr, members, &w->entered_);
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, w->store_);
    const int n = static_cast<int>(members.size());
#if QLORA_WITH_CUDA
    if (device.is_cuda()) return Comm(make_nccl_backend(store, me, n, ms, device), members, &w->entered_);
#endif
    if (!device.is_cpu())
      throw std::invalid_argument("no collective backend for device " + device.str() + " in this build");
    return Comm(make_gloo_backend(store, me, n, ms, host), members, &w->entered_);
  };
  std::vector<int> all(env.world_size), shard, replica;
  for (int r = 0; r < env.world_size; ++r) all[r] = r;
  const int s = static_cast<int>(shard_size), first = env.rank / s * s;
  for (int r = first; r < first + s; ++r) shard.push_back(r);
  for (int r = env.rank % s; r < env.world_size; r += s) replica.push_back(r);
  w->world_ = make("world", all);
  w->shard_ = s == env.world_size ? w->world_ : make("shard" + std::to_string(first / s), shard);
  w->replica_ = make("replica" + std::to_string(env.rank % s), replica);
  w->hb_store_->add(key("hb", env.rank), 1);
  w->watchdog_ = std::thread([p = w.get()] { p->watchdog_loop(); });
  return w;
}

void World::finish() {
  if (finished_ || !hb_store_) return;
  finished_ = true;
  hb_store_->set(key("done", env_.rank), std::vector<uint8_t>{1});
  // Rank 0 hosts the store: it stays until every rank has said it is done, so nobody's last
  // store call finds it gone. The run itself succeeded: a straggler only earns a warning.
  if (env_.rank == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < env_.world_size; ++r) keys.push_back(key("done", r));
    try {
      store_->wait(keys, std::chrono::milliseconds(static_cast<int64_t>(heartbeat_timeout_s_ * 1000)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank 0] warning: not every rank reported done within %.0f s (%s)\n",
                   heartbeat_timeout_s_, e.what());
    }
  }
}

World::~World() {
  if (!finished_ && hb_store_) {
    // An error is unwinding this rank: tell the peers at once rather than by silence.
    try {
      const std::string why = failure_reason_.empty() ? "its own error is in its output" : failure_reason_;
      hb_store_->set(key("failed", env_.rank), std::vector<uint8_t>(why.begin(), why.end()));
      // The store's host lingers so the others read "failed" rather than find the store gone.
      if (env_.rank == 0) std::this_thread::sleep_for(std::chrono::duration<double>(2 * kHeartbeatInterval));
    } catch (...) {
    }
  }
  stop_ = true;
  if (watchdog_.joinable()) watchdog_.join();
}

int64_t World::counter(const std::string& k) { return hb_store_->add(k, 0); }

void World::watchdog_loop() {
  std::vector<int64_t> last(env_.world_size, -1);
  std::vector<std::chrono::steady_clock::time_point> changed(env_.world_size, std::chrono::steady_clock::now());
  while (!stop_) {
    try {
      hb_store_->add(key("hb", env_.rank), 1);
      const int64_t progress[2] = {step_.load(), entered_.load()};
      hb_store_->set(key("progress", env_.rank), std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(progress),
                                                                      reinterpret_cast<const uint8_t*>(progress) + 16));
      const auto now = std::chrono::steady_clock::now();
      for (int r = 0; r < env_.world_size && !finished_; ++r) {
        if (r == env_.rank) continue;
        if (hb_store_->check({key("failed", r)})) {
          const std::vector<uint8_t> why = hb_store_->get(key("failed", r));
          std::fprintf(stderr, "[rank %d] rank %d failed (%s); stopping\n", env_.rank, r,
                       std::string(why.begin(), why.end()).c_str());
          std::fflush(stderr);
          std::_Exit(1);
        }
        if (hb_store_->check({key("done", r)})) continue;
        const int64_t v = counter(key("hb", r));
        const bool silent = v == last[r] && std::chrono::duration<double>(now - changed[r]).count() > heartbeat_timeout_s_;
        if (v != last[r]) {
          last[r] = v;
          changed[r] = now;
        }
        if (silent || hb_store_->check({key("gone", r)})) {
          std::fprintf(stderr, "[rank %d] rank %d has not been heard from for %.0f s (dead, stopped or wedged); stopping\n",
                       env_.rank, r, heartbeat_timeout_s_);
          std::fflush(stderr);
          // Leave the verdict in the store for the others; its host lingers so they can read it.
          hb_store_->set(key("gone", r), std::vector<uint8_t>{1});
          if (env_.rank == 0) std::this_thread::sleep_for(std::chrono::duration<double>(3 * kHeartbeatInterval));
          std::_Exit(1);
        }
      }
    } catch (const std::exception& e) {
      if (stop_ || (finished_ && env_.rank != 0)) return;
      std::fprintf(stderr, "[rank %d] lost the rendezvous store on rank 0 (%s:%d): rank 0 is gone (%s); stopping\n",
                   env_.rank, env_.master_addr.c_str(), env_.master_port, e.what());
      std::fflush(stderr);
      std::_Exit(1);
    }
    for (int i = 0; i < 10 && !stop_; ++i)
      std::this_thread::sleep_for(std::chrono::duration<double>(kHeartbeatInterval / 10));
  }
}

void World::mark_progress(int64_t step) {
  entered_ = 0;
  step_ = step;
}

World::Culprits World::culprits(double window_s) {
  Culprits c;
  try {
    std::vector<int64_t> before(env_.world_size);
    for (int r = 0; r < env_.world_size; ++r) before[r] = counter(key("hb", r));
    std::this_thread::sleep_for(std::chrono::duration<double>(window_s));
    for (int r = 0; r < env_.world_size; ++r) {
      if (r == env_.rank) continue;
      if (hb_store_->check({key("failed", r)})) c.failed.push_back(r);
      else if (hb_store_->check({key("gone", r)}) || counter(key("hb", r)) == before[r]) c.silent.push_back(r);
      else if (step_ >= 0 && hb_store_->check({key("progress", r)})) {
        int64_t theirs[2];
        std::memcpy(theirs, hb_store_->get(key("progress", r)).data(), 16);
        if (std::make_pair(theirs[0], theirs[1]) < std::make_pair(step_.load(), entered_.load()))
          c.behind.emplace_back(r, theirs[0]);
      }
    }
  } catch (const std::exception&) {
    c.silent = {0};  // the store is gone with its host
  }
  return c;
}

void World::rethrow_with_culprits(const std::exception& e, const std::string& what) {
  if (!hb_store_) throw std::runtime_error(e.what());  // one process: nobody else to blame
  const Culprits c = culprits(3 * kHeartbeatInterval);
  auto list = [](const std::vector<int>& v) {
    std::string s;
    for (int r : v) s += (s.empty() ? "rank " : ", rank ") + std::to_string(r);
    return s;
  };
  std::string who;
  if (!c.failed.empty()) who = list(c.failed) + " failed (its own error is in its output)";
  if (!c.silent.empty()) who += (who.empty() ? "" : "; ") + list(c.silent) + " stopped responding";
  for (const auto& [r, step] : c.behind)
    who += (who.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " is alive but hangs (in step " +
           std::to_string(step) + ", short of the collective this rank waits in, in step " +
           std::to_string(step_.load()) + ")";
  failure_reason_ = who;  // what ~World tells the peers
  if (who.empty()) throw std::runtime_error("rank " + std::to_string(env_.rank) + ": " + e.what());
  throw std::runtime_error("rank " + std::to_string(env_.rank) + ": " + what + " failed: " + who + " (" + e.what() +
                           ")");
}

}  // namespace qlora::engine
