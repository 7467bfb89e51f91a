// The `qlora` command: one binary, a subcommand per recipe.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace qlora::recipes {
int quantize_main(const std::vector<std::string>& args);
int dequantize_main(const std::vector<std::string>& args);
}  // namespace qlora::recipes

namespace {

constexpr const char* kUsage =
    "usage: qlora <command> [args]\n"
    "\n"
    "commands:\n"
    "  quantize [IN OUT]       every 2-D float *_proj.weight of a safetensors file or HF\n"
    "                          checkpoint directory becomes NF4 (qlora-nf4-v1), the rest is\n"
    "                          copied; no arguments: the bundled tiny example\n"
    "  dequantize IN OUT [--dtype bf16|fp16|fp32]\n"
    "                          the inverse: NF4 tensors back to plain tensors\n"
    "  help                    this text\n";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  try {
    if (cmd == "quantize") return qlora::recipes::quantize_main(args);
    if (cmd == "dequantize") return qlora::recipes::dequantize_main(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qlora %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "qlora: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return 2;
}
