// model.device resolution (errors name the key), generator state round trips, peak memory.
#include "qlora/train/device.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

using qlora::train::resolve_device;

namespace {

bool have_cuda() { return at::hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0; }

std::string resolve_error(const std::string& name, const std::string& key = "model.device") {
  try {
    resolve_device(name, key);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Device, CpuAndAuto) {
  EXPECT_EQ(resolve_device("cpu"), c10::Device(c10::kCPU));
  EXPECT_EQ(resolve_device("auto"), have_cuda() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU));
}

TEST(Device, CudaWithoutAGpuNamesTheKey) {
  if (have_cuda()) GTEST_SKIP() << "a CUDA device is visible";
  for (const char* name : {"cuda", "cuda:0", "cuda:3"}) {
    const std::string e = resolve_error(name, "--device");
    EXPECT_NE(e.find("--device = \"" + std::string(name) + "\""), std::string::npos) << e;
    EXPECT_NE(e.find("\"cpu\""), std::string::npos) << e;  // says what would work
  }
}

TEST(Device, CudaIndexPastTheLastDevice) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  EXPECT_NE(resolve_error("cuda:99").find("only"), std::string::npos);
  EXPECT_EQ(resolve_device("cuda"), c10::Device(c10::kCUDA, 0));
}

TEST(Device, GeneratorStateRoundTrips) {
  for (const c10::Device d : {c10::Device(c10::kCPU), c10::Device(c10::kCUDA, 0)}) {
    if (d.is_cuda() && !have_cuda()) continue;
    at::manual_seed(7);
    const at::Tensor state = qlora::train::generator_state(d);
    const at::Tensor a = at::rand({16}, at::TensorOptions().device(d));
    qlora::train::set_generator_state(d, state);
    const at::Tensor b = at::rand({16}, at::TensorOptions().device(d));
    EXPECT_TRUE(at::equal(a, b)) << d;
    EXPECT_EQ(state.scalar_type(), at::kByte);
    EXPECT_TRUE(state.device().is_cpu());
  }
}

TEST(Device, PeakMemoryIsPositive) { EXPECT_GT(qlora::train::peak_memory_bytes(c10::kCPU), 0); }

TEST(Device, CudaPeakMemoryCountsAnAllocation) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const at::Tensor t = at::empty({1 << 20}, at::TensorOptions().device(c10::kCUDA));
  EXPECT_GE(qlora::train::peak_memory_bytes(c10::Device(c10::kCUDA, 0)), int64_t{4} << 20);
}

TEST(Device, CudaMemoryPeaksFollowAllocationsAndResets) {
  const auto cpu = qlora::train::device_memory_peaks(c10::kCPU);
  EXPECT_EQ(cpu.allocated, -1);
  EXPECT_EQ(cpu.reserved, -1);
  qlora::train::synchronize_device(c10::kCPU);  // nothing to wait for
  EXPECT_EQ(qlora::train::device_name(c10::kCPU), "cpu");
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const c10::Device d(c10::kCUDA, 0);
  EXPECT_NE(qlora::train::device_name(d).find("NVIDIA"), std::string::npos) << qlora::train::device_name(d);
  constexpr int64_t kBytes = int64_t{64} << 20;
  {
    const at::Tensor t = at::ones({kBytes / 4}, at::TensorOptions().device(d));
    qlora::train::synchronize_device(d);
  }
  const auto after = qlora::train::device_memory_peaks(d);
  EXPECT_GE(after.allocated, kBytes);
  EXPECT_GE(after.reserved, after.allocated);
  qlora::train::reset_device_memory_peaks(d);  // the tensor is gone: the peak falls to what is held now
  EXPECT_LT(qlora::train::device_memory_peaks(d).allocated, kBytes);
}
