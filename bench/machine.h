// What every bench JSON says about the machine: the CPU model and the load average around the run
// (the process's memory figures: io/cpu_memory.h, proc_status_bytes and peak_rss_bytes).
#pragma once

#include <nlohmann/json.hpp>

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

// Starts this process's VmHWM again from its current RSS (/proc/self/clear_refs "5", Linux >= 4.0), so
// that the peak of what follows can be read (io/cpu_memory.h's peak_rss_bytes); false where refused.
inline bool restart_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

// The machine object of a bench's JSON: {"cpu": ..., "load_average": ...} (a bench adds its
// "load_average_after" when it ends, and what else it knows, e.g. the ISA).
inline nlohmann::json machine_json() { return {{"cpu", cpu_model()}, {"load_average", load_average()}}; }

}  // namespace qlora::bench
