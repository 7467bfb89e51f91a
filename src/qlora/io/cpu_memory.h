// The process's CPU memory, tuned for training steps. glibc's heap serves every tensor under its
// mmap threshold (which rises to 32 MiB as the program frees large blocks): activations kept for
// backward, checkpointed layer inputs and the step's short-lived tensors then share one heap, the
// short-lived ones leave holes between the kept ones, and the heap grows by every layer's holes
// (0.5 GB above the live tensors on the 100M bench shape, 0.8 GB on Llama-2-7B at seq 128).
// tune_cpu_memory() gives each tensor of 1 MiB or more its own mapping, so nothing is stranded
// between kept tensors, and keeps freed ones of 1-32 MiB by exact size for the next tensor of
// that size (the same shapes come back every layer and every step), so their pages are not
// faulted in and zeroed again on every allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace qlora::io {

// Call once, first thing in main (the allocator serves only tensors allocated after it).
void tune_cpu_memory();

// Returns what is free to the system: the freed tensors kept for reuse, and the free pages inside
// glibc's heap (malloc_trim). For after loading, whose temporaries no step allocates again.
void release_free_cpu_memory();

// Bytes of freed tensors kept for reuse now (0 before tune_cpu_memory()).
size_t cpu_memory_kept_bytes();

// A field of /proc/self/status in bytes ("VmRSS": resident now, "VmHWM": the peak so far), -1 if
// absent. The one reader of these figures, for the recipes, the training metrics and bench/.
int64_t proc_status_bytes(std::string_view field);

// The process's peak resident set so far, in bytes: VmHWM, which starts again at exec (getrusage's
// ru_maxrss, the fallback without /proc, would report a large parent's peak for a child it started).
int64_t peak_rss_bytes();

}  // namespace qlora::io
