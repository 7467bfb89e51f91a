// Factories for c10d backends, each in its own file so the heavy (and, for Gloo, externally
// provided) headers stay out of everything else.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace qlora::engine {

// host: where this rank's Gloo device binds: an address or hostname, "iface:NAME" (a network
// interface), or "default" (this machine's hostname, as torch does).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout,
                                                    const std::string& host);
// Only in CUDA builds (QLORA_WITH_CUDA).
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout, c10::Device device);

}  // namespace qlora::engine
