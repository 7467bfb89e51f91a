// The `qlora` binary.
#include "qlora/engine/omp_wait_policy.h"
#include "qlora/io/crash_report.h"

namespace qlora::cli {
int qlora_cli(int argc, char** argv);
}

QLORA_OMP_WAIT_POLICY_PREINIT;  // OpenMP workers that sleep instead of spinning (omp_wait_policy.h)

int main(int argc, char** argv) {
  qlora::io::install_crash_report(argv[0]);
  return qlora::cli::qlora_cli(argc, argv);
}
