// A report on stderr when the process dies of a fault or an abort, so that a crash on a machine
// without a debugger (the GPU machines have none) still says where it happened.
#pragma once

namespace qlora::io {

// From now on, a fatal SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT first writes to stderr:
//   qlora: fatal signal 11 (Segmentation fault), address 0x10, pid 4242, tid 4243, executable
//   /path/qlora; call stack (...):
//   /path/qlora(+0x1a2b3c)[0x55d0c81a2b3c]
//   /path/libtorch_cpu.so(_ZN2at6native...+0x4d)[0x7f...]
// one frame a line, innermost first, as glibc's backtrace() sees them (an exported function by
// name; the binary's own functions as module(+offset), which scripts/symbolize_crash.sh turns into
// function, file and line with addr2line). Then the signal's default action ends the process as
// before: the same exit status, a core file where enabled. The report runs on a stack of its own,
// so a stack overflow in the main thread is reported too. `program` names the process in the first
// line; a second call only renames it.
void install_crash_report(const char* program);

}  // namespace qlora::io
