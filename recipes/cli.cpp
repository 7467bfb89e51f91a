// The `qlora` command line: a subcommand per recipe (recipes/main.cpp is the binary's main; the
// test binary tests/tools/qlora_faults.cpp runs the same command line with a fault plan).
#include <cstdio>
#include <exception>
#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/engine/launcher.h"
#include "qlora/io/cpu_memory.h"

namespace qlora::recipes {
int quantize_main(const std::vector<std::string>& args);
int dequantize_main(const std::vector<std::string>& args);
int lora_finetune_main(const std::vector<std::string>& args);
int lora_dpo_main(const std::vector<std::string>& args);
int generate_main(const std::vector<std::string>& args);
int tokenize_main(const std::vector<std::string>& args);
int plot_main(const std::vector<std::string>& args);
int data_main(const std::vector<std::string>& args);
int gguf_main(const std::vector<std::string>& args);
int qlora_cli(int argc, char** argv);
}  // namespace qlora::recipes

namespace {

constexpr const char* kUsage =
    "usage: qlora <command> [args]\n"
    "\n"
    "commands:\n"
    "  run [--nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P]]\n"
    "      lora_finetune [--config FILE] [section.key=value ...]\n"
    "                          QLoRA fine-tuning; no --config: the embedded tiny default;\n"
    "                          N > 1: N ranks on this node, sharded FSDP-style\n"
    "      lora_dpo --config FILE [section.key=value ...]\n"
    "                          preference tuning (dpo.loss: sigmoid, ipo, hinge, orpo, simpo) on\n"
    "                          data.format = \"preference\" pairs; same ranks, resume and exports\n"
    "  data [--config FILE] [section.key=value ...] [-n N]\n"
    "                          the data as lora_finetune sees it, no model loaded: the first N\n"
    "                          samples (3) with trained text marked, token counts, truncated and\n"
    "                          untrained samples, packing efficiency, a length histogram\n"
    "  generate --checkpoint DIR (--prompt TEXT | --instruction TEXT [--input TEXT] |\n"
    "           [--system TEXT] --message TEXT [--message TEXT ...]) [--print-prompt]\n"
    "           [--max-new-tokens N] [--temperature T] [--top-p P]\n"
    "                          text from an exported epoch (out/.../epoch_N); --instruction and\n"
    "                          --message render the template the run trained with (qlora.json)\n"
    "  plot OUT_DIR [OUT_DIR ...] [-o FILE.svg]\n"
    "                          training/validation loss, lr and tokens/s over steps from each\n"
    "                          run's metrics.jsonl, runs overlaid, as one SVG (default\n"
    "                          OUT_DIR/plot.svg; ./plot.svg for several runs)\n"
    "  ls                      recipes and shipped configs\n"
    "  tokenize --tokenizer FILE_OR_MODEL_DIR (--text TEXT | --file FILE) [--decode]\n"
    "                          per input line, {\"ids\": [...]} as qlora tokenizes it; --decode:\n"
    "                          lines of id lists (JSON or comma-separated) to {\"text\": ...}\n"
    "  quantize [IN OUT]       every 2-D float *_proj.weight of a safetensors file or HF\n"
    "                          checkpoint directory becomes NF4 (qlora-nf4-v1), the rest is\n"
    "                          copied; no arguments: the bundled tiny example\n"
    "  dequantize IN OUT [--dtype bf16|fp16|fp32]\n"
    "                          the inverse: NF4 tensors back to plain tensors\n"
    "  gguf DIR [--type f32|f16|bf16|q8_0|q4_0] [-o FILE] [--name NAME]\n"
    "                          an HF checkpoint directory (an exported epoch) as one GGUF file\n"
    "                          for llama.cpp / Ollama (default DIR/<dir name>-<type>.gguf)\n"
    "  help                    this text\n";

int run_main(std::vector<std::string> args) {
  const qlora::engine::LaunchOptions launch = qlora::engine::parse_launch_args(args);
  if (args.empty()) throw std::invalid_argument("qlora run needs a recipe name (see `qlora ls`)");
  if (launch.nproc_per_node * launch.nnodes > 1) {
    if (qlora::engine::launched_as_rank())
      throw std::invalid_argument("--nproc-per-node inside a job that already has ranks (WORLD_SIZE > 1, set by "
                                  "torchrun, Slurm or `qlora run --nproc-per-node`): run `qlora run <recipe> ...` "
                                  "in each rank instead");
    if (args[0] != "lora_finetune" && args[0] != "lora_dpo") throw std::invalid_argument("unknown recipe '" + args[0] + "' (see `qlora ls`)");
    args.insert(args.begin(), "run");
    return qlora::engine::launch(launch, std::filesystem::read_symlink("/proc/self/exe").string(), args);
  }
  const std::string recipe = args[0];
  args.erase(args.begin());
  if (recipe == "lora_finetune") return qlora::recipes::lora_finetune_main(args);
  if (recipe == "lora_dpo") return qlora::recipes::lora_dpo_main(args);
  throw std::invalid_argument("unknown recipe '" + recipe + "' (see `qlora ls`)");
}

int ls_main() {
  std::printf("recipes:\n  lora_finetune    QLoRA fine-tuning (one process, or N ranks with --nproc-per-node)\n"
              "  lora_dpo         preference tuning: DPO, IPO, hinge, ORPO, SimPO (data.format = \"preference\")\n"
              "\nconfigs (%s/configs):\n",
              QLORA_SOURCE_DIR);
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(QLORA_SOURCE_DIR "/configs"))
    if (e.path().extension() == ".toml") names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const auto& n : names) std::printf("  configs/%s\n", n.c_str());
  return 0;
}

}  // namespace

namespace qlora::recipes {

int qlora_cli(int argc, char** argv) {
  qlora::io::tune_cpu_memory();
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  try {
    if (cmd == "run") return run_main(args);
    if (cmd == "generate") return qlora::recipes::generate_main(args);
    if (cmd == "ls") return ls_main();
    if (cmd == "quantize") return qlora::recipes::quantize_main(args);
    if (cmd == "dequantize") return qlora::recipes::dequantize_main(args);
    if (cmd == "tokenize") return qlora::recipes::tokenize_main(args);
    if (cmd == "plot") return qlora::recipes::plot_main(args);
    if (cmd == "data") return qlora::recipes::data_main(args);
    if (cmd == "gguf") return qlora::recipes::gguf_main(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qlora %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "qlora: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return 2;
}

}  // namespace qlora::recipes
