// The only file that includes ProcessGroupGloo.hpp: it needs gloo's own headers, which the torch
// wheel does not ship (Debian's libgloo-dev provides them; its library is never linked — the gloo
// inside libtorch_cpu is the one that runs).
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "qlora/engine/backends.h"

namespace qlora::engine {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout,
                                                    const std::string& host) {
  using PGG = c10d::ProcessGroupGloo;
  auto opts = PGG::Options::create(timeout);
  if (host.rfind("iface:", 0) == 0) opts->devices.push_back(PGG::createDeviceForInterface(host.substr(6)));
  else if (host == "default") opts->devices.push_back(PGG::createDefaultDevice());
  else opts->devices.push_back(PGG::createDeviceForHostname(host));
  // Worker threads = collectives in flight at once: a prefetch all-gather beside a gradient
  // reduce-scatter.
  opts->threads = 2;
  return c10::make_intrusive<PGG>(store, rank, size, opts);
}

}  // namespace qlora::engine
