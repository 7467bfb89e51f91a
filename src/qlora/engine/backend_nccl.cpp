// ProcessGroupNCCL for CUDA tensors (built only with CUDA; it cannot run without a GPU).
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "qlora/engine/backends.h"

namespace qlora::engine {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout, c10::Device device) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  pg->setBoundDeviceId(device);
  return pg;
}

}  // namespace qlora::engine
