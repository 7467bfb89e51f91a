// Where a run computes: the config's model.device resolved against what this process can see, the
// device's random generator state (for exact resume) and its peak memory (for metrics).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace qlora::train {

// "auto" -> cuda:0 when a CUDA device is visible, else cpu; "cpu"; "cuda" -> cuda:0; "cuda:N".
// Throws std::invalid_argument naming `key` when CUDA is asked for and this build or machine has
// none, or N is past the last device.
c10::Device resolve_device(const std::string& name, const std::string& key = "model.device");

// The default generator's state of `device` as a uint8 tensor (CPU), and its inverse. Dropout on
// a CUDA device draws from the CUDA generator; a resumed run must continue that stream too.
at::Tensor generator_state(c10::Device device);
void set_generator_state(c10::Device device, const at::Tensor& state);

// Peak memory for metrics: on a CUDA device the caching allocator's peak of allocated bytes
// since the last reset (what torch.cuda.max_memory_allocated reports); on the CPU the process's
// peak resident set (VmHWM).
int64_t peak_memory_bytes(c10::Device device);

// A CUDA device's caching-allocator peaks since the last reset: the most bytes held by tensors
// (torch.cuda.max_memory_allocated) and the most reserved from the driver (max_memory_reserved,
// what the process holds of the GPU). Both -1 on the CPU.
struct DeviceMemoryPeaks {
  int64_t allocated = -1;
  int64_t reserved = -1;
};
DeviceMemoryPeaks device_memory_peaks(c10::Device device);
void reset_device_memory_peaks(c10::Device device);
// Gives the caching allocator's unused blocks back to the driver (torch.cuda.empty_cache), so that
// the next max reserved counts what is allocated from here on; nothing on the CPU.
void release_cached_device_memory(c10::Device device);

// Returns when every kernel queued on `device` has finished (at once on the CPU): what a wall
// clock around GPU work needs.
void synchronize_device(c10::Device device);

// The device as its driver names it ("NVIDIA H100 80GB HBM3"); "cpu" on the CPU.
std::string device_name(c10::Device device);

}  // namespace qlora::train
