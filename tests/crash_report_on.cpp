// Linked into every test binary that has qlora_io: a test that crashes prints its call stack
// (src/qlora/io/crash_report.h), which matters most where no debugger is at hand (the GPU machine).
#include "qlora/io/crash_report.h"

namespace {
const bool installed = (qlora::io::install_crash_report("qlora test"), true);
}  // namespace
