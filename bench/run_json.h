// Runs a peer program (the Python side of a bench) and parses the JSON object on the last line
// of its stdout; on failure returns {"error": ..., "output": ...} so the bench still reports.
#pragma once

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <string>

namespace qlora::bench {

using json = nlohmann::json;

// This program's path (/proc/self/exe), for a bench that starts itself as a worker; `fallback` if unread.
inline std::string self_exe(const std::string& fallback) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : fallback;
}

inline json run_json(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {{"error", "could not start " + cmd}};
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  // The JSON is the last line (the peer may warn on stdout first).
  const size_t nl = out.find_last_of('\n', out.size() >= 2 ? out.size() - 2 : 0);
  const json j = json::parse(nl == std::string::npos ? out : out.substr(nl + 1), nullptr, false);
  if (rc != 0 || j.is_discarded()) return {{"error", "failed (rc " + std::to_string(rc) + "): " + cmd}, {"output", out}};
  return j;
}

}  // namespace qlora::bench

