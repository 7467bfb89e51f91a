#include "qlora/io/cpu_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <malloc.h>
#include <sys/resource.h>

#include <fstream>
#include <string>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace qlora::io {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kMmapThreshold = kMiB;    // from here up, a tensor is a mapping of its own
constexpr size_t kMaxKept = 32 * kMiB;     // larger ones (a 7B's dequantized weights) are unmapped when freed
constexpr size_t kKeptCap = 512 * kMiB;    // at most this much freed memory is kept

// Wraps the default CPU allocator; blocks of [kMmapThreshold, kMaxKept] bytes go to a free list
// of their exact size when freed, up to kKeptCap in all.
class KeepingAllocator final : public c10::Allocator {
 public:
  static KeepingAllocator& get() {
    static KeepingAllocator* self = new KeepingAllocator(c10::GetCPUAllocator());  // never destroyed
    return *self;
  }

  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (keeps(n)) {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.find(n);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        kept_ -= n;
      }
    }
    if (!p && n) {
      p = inner_->raw_allocate(n);
      if (keeps(n)) {
        std::lock_guard<std::mutex> g(mu_);
        size_of_[p] = n;
      }
    }
    return {p, p, &KeepingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &KeepingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  size_t kept() {
    std::lock_guard<std::mutex> g(mu_);
    return kept_;
  }
  void drop_kept() {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& [n, ps] : free_)
        for (void* p : ps) {
          blocks.push_back(p);
          size_of_.erase(p);
        }
      free_.clear();
      kept_ = 0;
    }
    for (void* p : blocks) inner_free_(p);
  }

 private:
  explicit KeepingAllocator(c10::Allocator* inner) : inner_(inner), inner_free_(inner->raw_deleter()) {
    TORCH_CHECK(inner_free_, "tune_cpu_memory: the CPU allocator has no raw deleter");
  }
  static bool keeps(size_t n) { return n >= kMmapThreshold && n <= kMaxKept; }

  static void release(void* p) {
    if (!p) return;
    KeepingAllocator& a = get();
    {
      std::lock_guard<std::mutex> g(a.mu_);
      auto it = a.size_of_.find(p);
      if (it != a.size_of_.end()) {
        const size_t n = it->second;
        if (a.kept_ + n <= kKeptCap) {
          a.free_[n].push_back(p);
          a.kept_ += n;
          return;
        }
        a.size_of_.erase(it);
      }
    }
    a.inner_free_(p);
  }

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_free_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> size_of_;            // every block in the kept range, live or kept
  std::unordered_map<size_t, std::vector<void*>> free_;  // kept blocks by size
  size_t kept_ = 0;
};

}  // namespace

void tune_cpu_memory() {
  static const bool once = [] {
    mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold));  // fixed: no longer rises
    c10::SetCPUAllocator(&KeepingAllocator::get(), /*priority=*/50);
    return true;
  }();
  (void)once;
}

void release_free_cpu_memory() {
  KeepingAllocator::get().drop_kept();
  malloc_trim(0);
}

size_t cpu_memory_kept_bytes() { return KeepingAllocator::get().kept(); }

int64_t proc_status_bytes(std::string_view field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.size() > field.size() && line.compare(0, field.size(), field) == 0 && line[field.size()] == ':')
      return std::stoll(line.substr(field.size() + 1)) * 1024;  // "VmHWM:   123456 kB"
  return -1;
}

int64_t peak_rss_bytes() {
  const int64_t hwm = proc_status_bytes("VmHWM");
  if (hwm >= 0) return hwm;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // kB
}

}  // namespace qlora::io
