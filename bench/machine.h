// What every bench JSON says about the machine and the process: the CPU model, the load average
// around the run, and this process's memory figures from /proc/self/status.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace qlora::bench {

// /proc/cpuinfo's first "model name" ("AMD EPYC ..."), "unknown" if absent.
inline std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// /proc/loadavg's 1, 5 and 15 minute load ("0.52 1.10 2.03"): how busy the machine was.
inline std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string one, five, fifteen;
  f >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"), -1 if absent.
inline int64_t proc_status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  return -1;
}

}  // namespace qlora::bench
