// Where a bench's peak memory goes: a c10 CPU allocator that wraps the default one, counts the
// bytes it has live, and remembers the live-bytes peak with the phase it happened in (the bench
// names its phases: load, forward, backward, optimizer, ...), how many of the bytes live then
// were allocated in each phase, and the largest allocations live then that were not made while
// loading (the step's transients: activations, dequantized weights). Beside the process's
// peak RSS (VmHWM) and its RSS before anything was built (libraries), that splits the peak into
// what tensors hold and what malloc keeps above them.
//
//   auto& acct = qlora::bench::MemoryAccount::install();  // first thing in the worker
//   acct.phase("load"); ... acct.phase("forward"); ...
//   json j = acct.report();
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <malloc.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "qlora/io/cpu_memory.h"
#include "bench/machine.h"
#include "qlora/models/architecture.h"
#include "qlora/models/decoder.h"

namespace qlora::bench {

class MemoryAccount final : public c10::Allocator {
 public:
  // Wraps the current CPU allocator (once); tensors allocated before are not counted.
  static MemoryAccount& install() {
    static MemoryAccount* self = [] {
      auto* a = new MemoryAccount(c10::GetCPUAllocator());
      c10::SetCPUAllocator(a, /*priority=*/100);
      return a;
    }();
    return *self;
  }

  // Later allocations belong to `label`; records the RSS figures as the previous phase ends.
  void phase(const std::string& label) {
    std::lock_guard<std::mutex> g(mu_);
    close_phase();
    auto it = std::find(labels_.begin(), labels_.end(), label);
    current_ = static_cast<size_t>(it - labels_.begin());
    if (it == labels_.end()) {
      labels_.push_back(label);
      phases_.push_back({});
      live_by_phase_.push_back(0);
    }
  }

  // The figures so far; `static_parts` (name -> bytes, computed by the caller from the model)
  // split the live peak into what was meant to be there and the transient rest.
  nlohmann::json report(const std::map<std::string, int64_t>& static_parts = {}) {
    std::lock_guard<std::mutex> g(mu_);
    close_phase();
    nlohmann::json by_phase = nlohmann::json::object(), phases = nlohmann::json::array();
    for (size_t i = 0; i < labels_.size(); ++i) {
      if (i < peak_by_phase_.size() && peak_by_phase_[i]) by_phase[labels_[i]] = peak_by_phase_[i];
      phases.push_back({{"phase", labels_[i]}, {"max_live_bytes", phases_[i].max_live},
                        {"vm_hwm_bytes_at_end", phases_[i].hwm}, {"vm_rss_bytes_at_end", phases_[i].rss},
                        {"malloc_heap_bytes_at_end", phases_[i].heap.arena},
                        {"malloc_heap_free_bytes_at_end", phases_[i].heap.fordblks},
                        {"malloc_mmapped_bytes_at_end", phases_[i].heap.hblkhd},
                        {"kept_for_reuse_bytes_at_end", phases_[i].kept}});
    }
    int64_t statics = 0;
    for (const auto& [name, bytes] : static_parts) statics += bytes;
    const int64_t hwm = io::peak_rss_bytes();
    return {{"process_baseline_rss_bytes", baseline_rss_},
            {"peak_rss_bytes", hwm},
            {"live_peak_bytes", peak_},
            {"live_peak_phase", peak_ < 0 || labels_.empty() ? "" : labels_[peak_phase_]},
            {"live_at_peak_by_phase_allocated", by_phase},
            {"largest_non_load_allocations_at_peak", peak_largest_},
            {"kept_for_reuse_at_live_peak_bytes", peak_kept_},
            {"static_bytes", static_parts},
            {"static_total_bytes", statics},
            {"transient_at_peak_bytes", peak_ - statics},
            // What RSS holds above the tensors at its own peak: malloc's free-but-kept memory
            // (fragmentation, arenas, trim thresholds) and everything not from this allocator.
            {"rss_above_live_peak_and_baseline_bytes", hwm - baseline_rss_ - peak_},
            {"phases", phases}};
  }

  c10::DataPtr allocate(size_t n) override {
    void* p = n ? inner_->raw_allocate(n) : nullptr;
    if (p) on_alloc(p, static_cast<int64_t>(n));
    return {p, p, &MemoryAccount::free_raw, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &MemoryAccount::free_raw; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  struct Block {
    int64_t bytes;
    size_t phase;
  };
  struct Phase {
    int64_t max_live = 0, hwm = -1, rss = -1, kept = 0;  // kept: freed tensors held for reuse (io/cpu_memory.h)
    struct mallinfo2 heap {};  // glibc's view as the phase ends: its heap, what is free in it, mmapped chunks
  };

  explicit MemoryAccount(c10::Allocator* inner)
      : inner_(inner), inner_free_(inner->raw_deleter()), baseline_rss_(io::proc_status_bytes("VmRSS")) {
    TORCH_CHECK(inner_free_, "MemoryAccount: the CPU allocator has no raw deleter to wrap");
  }

  static void free_raw(void* p) {
    MemoryAccount& a = install();
    a.on_free(p);
    a.inner_free_(p);
  }

  void on_alloc(void* p, int64_t n) {
    std::lock_guard<std::mutex> g(mu_);
    live_ += n;
    blocks_[p] = {n, current_};
    if (!labels_.empty()) {
      live_by_phase_[current_] += n;
      phases_[current_].max_live = std::max(phases_[current_].max_live, live_);
    }
    if (live_ <= peak_) return;
    peak_ = live_;
    peak_phase_ = current_;
    peak_by_phase_ = live_by_phase_;
    peak_kept_ = static_cast<int64_t>(io::cpu_memory_kept_bytes());
    // The transients are few (activations and one layer's weights): a copy per new peak is cheap.
    if (!labels_.empty() && labels_[current_] != "load") {
      peak_largest_.clear();
      for (const auto& [ptr, b] : blocks_)
        if (labels_[b.phase] != "load") peak_largest_.push_back(b.bytes);
      std::sort(peak_largest_.rbegin(), peak_largest_.rend());
      if (peak_largest_.size() > kLargest) peak_largest_.resize(kLargest);
    }
  }

  void on_free(void* p) {
    if (!p) return;
    std::lock_guard<std::mutex> g(mu_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) return;
    live_ -= it->second.bytes;
    if (!labels_.empty()) live_by_phase_[it->second.phase] -= it->second.bytes;
    blocks_.erase(it);
  }

  void close_phase() {
    if (labels_.empty()) return;
    phases_[current_].hwm = io::peak_rss_bytes();
    phases_[current_].rss = io::proc_status_bytes("VmRSS");
    phases_[current_].heap = mallinfo2();
    phases_[current_].kept = static_cast<int64_t>(io::cpu_memory_kept_bytes());
  }

  static constexpr size_t kLargest = 12;
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_free_;
  int64_t baseline_rss_;
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  int64_t live_ = 0, peak_ = 0;
  size_t current_ = 0, peak_phase_ = 0;
  std::vector<std::string> labels_;
  std::vector<Phase> phases_;
  std::vector<int64_t> live_by_phase_, peak_by_phase_;
  std::vector<int64_t> peak_largest_;
  int64_t peak_kept_ = 0;
};

// What a QLoRA model holds throughout a step: its frozen base (NF4 projections; dense weights:
// embeddings, output head, norms, biases) and its LoRA state (fp32 params, their gradients and
// AdamW's two moments).
inline std::map<std::string, int64_t> model_static_bytes(const models::DecoderModel& m) {
  int64_t nf4 = 0, dense = m.embed_tokens.nbytes() + m.norm.nbytes(), lora = 0;
  auto add = [&](const modules::LoraLinear& l) {
    if (l.base_nf4.defined()) nf4 += l.base_nf4.nbytes();
    if (l.base_dense.defined() && !l.base_dense.is_same(m.embed_tokens)) dense += l.base_dense.nbytes();
    if (l.bias.defined()) dense += l.bias.nbytes();
  };
  const models::Architecture& arch = m.architecture();
  for (const modules::DecoderLayer& L : m.layers) {
    for (const modules::LoraLinear* p : models::layer_projections(arch, L)) add(*p);
    for (const models::NormRow& n : arch.layer_norms)
      if ((L.*n.member).defined()) dense += (L.*n.member).nbytes();
  }
  add(m.lm_head);
  for (const auto& [name, t] : m.lora_parameters()) lora += t.nbytes();
  return {{"nf4_base", nf4}, {"dense_frozen", dense}, {"lora_params", lora}, {"lora_grads", lora},
          {"adamw_moments", 2 * lora}};
}

}  // namespace qlora::bench
