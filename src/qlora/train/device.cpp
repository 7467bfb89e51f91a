#include "qlora/train/device.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#if QLORA_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

#include <stdexcept>

#include "qlora/io/cpu_memory.h"

namespace qlora::train {

c10::Device resolve_device(const std::string& name, const std::string& key) {
  const bool have_cuda = at::hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0;
  if (name == "auto") return have_cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  if (name == "cpu") return c10::kCPU;
  if (name.rfind("cuda", 0) != 0) throw std::invalid_argument(key + ": unknown device '" + name + "'");
#if !QLORA_WITH_CUDA
  throw std::invalid_argument(key + " = \"" + name + "\" but this qlora was built without CUDA kernels "
                              "(no nvcc at configure time); use \"cpu\" or rebuild with the CUDA toolkit");
#endif
  if (!have_cuda)
    throw std::invalid_argument(key + " = \"" + name + "\" but no CUDA device is visible to this process "
                                "(check CUDA_VISIBLE_DEVICES and the driver); use \"cpu\" or \"auto\"");
  const c10::Device d(name == "cuda" ? std::string("cuda:0") : name);
  const int64_t count = at::detail::getCUDAHooks().deviceCount();
  if (d.index() >= count)
    throw std::invalid_argument(key + " = \"" + name + "\" but only " + std::to_string(count) +
                                " CUDA device(s) are visible");
  return d;
}

at::Tensor generator_state(c10::Device device) {
  return at::globalContext().defaultGenerator(device).get_state();
}

void set_generator_state(c10::Device device, const at::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(device);  // a handle to the global one
  gen.set_state(state);
}

#if QLORA_WITH_CUDA
namespace {
// "cuda" (no index) means the current device, as torch.cuda's functions take it.
c10::DeviceIndex cuda_index(c10::Device device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}
}  // namespace
#endif

int64_t peak_memory_bytes(c10::Device device) {
  return device.is_cuda() ? device_memory_peaks(device).allocated : io::peak_rss_bytes();
}

DeviceMemoryPeaks device_memory_peaks(c10::Device device) {
  DeviceMemoryPeaks p;
#if QLORA_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    p.allocated = stats.allocated_bytes[all].peak;
    p.reserved = stats.reserved_bytes[all].peak;
  }
#endif
  (void)device;
  return p;
}

void reset_device_memory_peaks(c10::Device device) {
#if QLORA_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_index(device));
#endif
  (void)device;
}

void release_cached_device_memory(c10::Device device) {
#if QLORA_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  (void)device;
}

void synchronize_device(c10::Device device) {
  if (device.is_cpu()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  impl->synchronizeDevice(device.has_index() ? device.index() : impl->getDevice().index());
}

std::string device_name(c10::Device device) {
#if QLORA_WITH_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, cuda_index(device)) != cudaSuccess)
      throw std::runtime_error("cannot read the properties of " + device.str());
    return prop.name;
  }
#endif
  return device.str();
}

}  // namespace qlora::train
