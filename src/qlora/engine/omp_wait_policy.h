// OpenMP's wait policy of qlora's processes. libgomp (the torch wheel's OpenMP) spins an idle worker 300000 times
// (GOMP_SPINCOUNT; ~7 ms at ~25 ns per pause on an EPYC) before it sleeps; beside another busy
// process those spinning threads take its core and a step slows ~3x. Fully passive workers (sleep
// at once) are fair but slow alone: waking one costs ~90 us on a VM, more than most elementwise
// ops and skinny GEMMs of a step take (a 100M step: 1.80 s passive vs 1.66 s spinning). A short
// spin, 3000 pauses (~75 us), catches the next parallel region of the same step (1.66 s alone) and
// costs a competitor little (2.0x beside `yes`, passive 1.8x, 300000 spins 3.0x).
// qlora's processes therefore run with kOmpWaitPolicy unless the environment already sets
// OMP_WAIT_POLICY or GOMP_SPINCOUNT (the user's choice wins). libgomp
// reads them once, in its own initialiser before main, so setting them needs a fresh exec:
// QLORA_OMP_WAIT_POLICY_PREINIT, in the executable's main file, runs omp_wait_policy_preinit
// before any library initialiser, which re-executes /proc/self/exe with the same argv and the
// variable added (then set, so there is no second re-exec; when the exec fails the process simply
// goes on). Ranks started by launch() (launcher.h) inherit it with the environment.
#pragma once

namespace qlora::engine {

inline constexpr const char* kOmpWaitPolicy = "GOMP_SPINCOUNT=3000";
void omp_wait_policy_preinit(int argc, char** argv, char** envp);

}  // namespace qlora::engine

// Nothing of libc or the C++ runtime is initialised when it runs: it only reads envp and execs.
#define QLORA_OMP_WAIT_POLICY_PREINIT \
  [[gnu::section(".preinit_array"), gnu::used]] static auto* qlora_omp_wait_policy_preinit = \
      &qlora::engine::omp_wait_policy_preinit
