// `qlora quantize` and `qlora dequantize`: argument handling, the bundled default, and a
// report of what was done. The work is in src/qlora/checkpoint/quantize_checkpoint.cpp.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/io/cpu_memory.h"
#include "qlora/io/quantize_checkpoint.h"
#include "cli/cli.h"

namespace qlora::cli {

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

struct ConvertArgs {
  std::string in, out, out_option, dtype;
};

int quantize(ConvertArgs a) {
  if (!a.out_option.empty() && !a.out.empty())
    throw UsageError("give OUT either as an argument or with --out, not both");
  if (a.out.empty()) a.out = a.out_option;
  if (a.in.empty()) {
    a.in = data_dir() + "/tiny_llama";
    if (a.out.empty()) a.out = "out/tiny_llama_nf4";
    std::printf("No input given: quantizing the bundled example checkpoint %s\n", a.in.c_str());
  } else if (a.out.empty()) {
    throw UsageError("expected IN and OUT, or nothing for the bundled example");
  }
  std::printf("qlora quantize: %s -> %s\n", a.in.c_str(), a.out.c_str());
  const auto t0 = std::chrono::steady_clock::now();
  const auto report = io::quantize_checkpoint(a.in, a.out, log_line);
  print_report("quantized to NF4:", report,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("wrote %s\n", a.out.c_str());
  return 0;
}

int dequantize(const ConvertArgs& a) {
  std::optional<at::ScalarType> dtype;  // none: each tensor's stored dtype
  if (a.dtype == "bf16") dtype = at::kBFloat16;
  if (a.dtype == "fp16") dtype = at::kHalf;
  if (a.dtype == "fp32") dtype = at::kFloat;
  std::printf("qlora dequantize: %s -> %s\n", a.in.c_str(), a.out.c_str());
  const auto t0 = std::chrono::steady_clock::now();
  const auto report = io::dequantize_checkpoint(a.in, a.out, dtype, log_line);
  print_report("dequantized", report,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace

Command quantize_command(CLI::App& cmd) {
  auto a = std::make_shared<ConvertArgs>();
  cmd.add_option("IN", a->in, "a safetensors file or HF checkpoint directory");
  cmd.add_option("OUT", a->out, "the NF4 copy (a file or directory, as IN)");
  cmd.add_option("--out", a->out_option, "OUT, as an option")->type_name("DIR");
  cmd.footer("no IN OUT: the bundled tiny example, to out/tiny_llama_nf4 (or --out DIR)");
  return [a] { return quantize(*a); };
}

Command dequantize_command(CLI::App& cmd) {
  auto a = std::make_shared<ConvertArgs>();
  cmd.add_option("IN", a->in, "a checkpoint with NF4 tensors (qlora quantize's)")->required();
  cmd.add_option("OUT", a->out, "the plain copy")->required();
  cmd.add_option("--dtype", a->dtype, "the plain tensors' dtype (default: each tensor's stored dtype)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  return [a] { return dequantize(*a); };
}

}  // namespace qlora::cli
