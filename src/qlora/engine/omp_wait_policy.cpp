#include "qlora/engine/omp_wait_policy.h"

#include <alloca.h>
#include <unistd.h>

#include <cstring>

namespace qlora::engine {

// alloca, not a container: it runs before the C++ runtime is initialised (omp_wait_policy.h).
void omp_wait_policy_preinit(int, char** argv, char** envp) {
  size_t n = 0;
  for (; envp[n]; ++n)
    if (std::strncmp(envp[n], "OMP_WAIT_POLICY=", 16) == 0 || std::strncmp(envp[n], "GOMP_SPINCOUNT=", 15) == 0) return;
  char** env = static_cast<char**>(alloca((n + 2) * sizeof(char*)));
  std::memcpy(env, envp, n * sizeof(char*));
  env[n] = const_cast<char*>(kOmpWaitPolicy);
  env[n + 1] = nullptr;
  ::execve("/proc/self/exe", argv, env);  // returns only on failure: go on as we are
}

}  // namespace qlora::engine
