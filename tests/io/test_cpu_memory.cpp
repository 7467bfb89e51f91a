#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "qlora/io/cpu_memory.h"

using qlora::io::cpu_memory_kept_bytes;
using qlora::io::tune_cpu_memory;

TEST(CpuMemory, KeepsFreedMidSizeTensorsForTheNextOfTheirSize) {
  tune_cpu_memory();
  tune_cpu_memory();  // once is enough; again changes nothing
  const size_t before = cpu_memory_kept_bytes();
  void* first = nullptr;
  {
    at::Tensor t = at::empty({3, 1 << 18});  // 3 MiB of fp32
    first = t.data_ptr();
    t.fill_(1.0f);
  }
  EXPECT_EQ(cpu_memory_kept_bytes(), before + (size_t{3} << 20));
  at::Tensor again = at::empty({3, 1 << 18});  // the same size: the kept block
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_EQ(cpu_memory_kept_bytes(), before);
  {
    at::Tensor big = at::empty({16, 1 << 20});  // 64 MiB: above what is kept
    at::Tensor small = at::empty({1024});       // 4 KiB: glibc's heap
  }
  EXPECT_EQ(cpu_memory_kept_bytes(), before);
  at::Tensor clone = again.fill_(2.0f).clone();  // raw allocate/deallocate and copies still work
  EXPECT_TRUE(at::equal(clone, again));
}

TEST(CpuMemory, PeakResidentSetIsAtLeastTheCurrentOne) {
  const int64_t rss = qlora::io::proc_status_bytes("VmRSS");
  EXPECT_GT(rss, 0);
  EXPECT_GE(qlora::io::peak_rss_bytes(), rss);
  EXPECT_EQ(qlora::io::proc_status_bytes("NoSuchField"), -1);
  EXPECT_EQ(qlora::io::proc_status_bytes("VmRS"), -1);  // a prefix of a field is not the field
}
