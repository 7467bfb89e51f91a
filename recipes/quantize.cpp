// `qlora quantize` and `qlora dequantize`: argument handling, the bundled default, and a
// report of what was done. The work is in src/qlora/checkpoint/quantize_checkpoint.cpp.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/io/cpu_memory.h"
#include "qlora/io/quantize_checkpoint.h"

namespace qlora::recipes {

namespace {

// The bundled example lives in the source tree; QLORA_DATA_DIR overrides where to find it.
std::string data_dir() {
  if (const char* d = std::getenv("QLORA_DATA_DIR")) return d;
  return QLORA_SOURCE_DIR "/tests/data";
}

void print_report(const char* verb, const io::ConvertReport& r, double seconds) {
  std::printf("%s %lld tensors, copied %lld; tensor data %.1f MiB -> %.1f MiB; %.2f s; peak RSS %.0f MiB\n",
              verb, static_cast<long long>(r.converted), static_cast<long long>(r.copied),
              r.bytes_in / 1048576.0, r.bytes_out / 1048576.0, seconds, io::peak_rss_bytes() / 1048576.0);
}

void log_line(const std::string& line) { std::printf("%s\n", line.c_str()); std::fflush(stdout); }

[[noreturn]] void usage_error(const std::string& what) {
  throw std::invalid_argument(what + " (see `qlora help`)");
}

}  // namespace

int quantize_main(const std::vector<std::string>& args) {
  std::string in, out;
  std::vector<std::string> pos;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--out") {
      if (i + 1 >= args.size()) usage_error("--out needs a directory");
      out = args[++i];
    } else if (!args[i].empty() && args[i][0] == '-') {
      usage_error("unknown option '" + args[i] + "'");
    } else {
      pos.push_back(args[i]);
    }
  }
  if (pos.size() == 2) {
    in = pos[0];
    if (out.empty()) out = pos[1];
    else usage_error("give OUT either as an argument or with --out, not both");
  } else if (pos.empty()) {
    in = data_dir() + "/tiny_llama";
    if (out.empty()) out = "out/tiny_llama_nf4";
    std::printf("No input given: quantizing the bundled example checkpoint %s\n", in.c_str());
  } else {
    usage_error("expected IN and OUT, or nothing for the bundled example");
  }
  std::printf("qlora quantize: %s -> %s\n", in.c_str(), out.c_str());
  const auto t0 = std::chrono::steady_clock::now();
  const auto report = io::quantize_checkpoint(in, out, log_line);
  print_report("quantized to NF4:", report,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

int dequantize_main(const std::vector<std::string>& args) {
  std::vector<std::string> pos;
  std::optional<at::ScalarType> dtype;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--dtype") {
      if (i + 1 >= args.size()) usage_error("--dtype needs bf16, fp16 or fp32");
      const std::string d = args[++i];
      if (d == "bf16") dtype = at::kBFloat16;
      else if (d == "fp16") dtype = at::kHalf;
      else if (d == "fp32") dtype = at::kFloat;
      else usage_error("--dtype must be bf16, fp16 or fp32, got '" + d + "'");
    } else if (args[i].size() > 1 && args[i][0] == '-') {
      usage_error("unknown option '" + args[i] + "'");
    } else {
      pos.push_back(args[i]);
    }
  }
  if (pos.size() != 2) usage_error("expected IN and OUT");
  std::printf("qlora dequantize: %s -> %s\n", pos[0].c_str(), pos[1].c_str());
  const auto t0 = std::chrono::steady_clock::now();
  const auto report = io::dequantize_checkpoint(pos[0], pos[1], dtype, log_line);
  print_report("dequantized", report,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace qlora::recipes
