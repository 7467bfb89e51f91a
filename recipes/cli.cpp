// The `qlora` command line: a subcommand per recipe (recipes/main.cpp is the binary's main; the
// test binary tests/tools/qlora_faults.cpp runs the same command line with a fault plan).
#include <cstdio>
#include <exception>
#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/config/config.h"
#include "qlora/engine/launcher.h"
#include "recipe_config.h"
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

// One entry per subcommand: its name and its usage, as `qlora --help` lists it and as
// `qlora CMD --help` (or an error in CMD's arguments) prints it.
struct Command {
  const char* name;
  const char* usage;
};

const Command kCommands[] = {
    {"run",
     "  run [--nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P]]\n"
     "      lora_finetune [--config FILE] [section.key=value ...]\n"
     "                          QLoRA fine-tuning; no --config: the embedded tiny default;\n"
     "                          N > 1: N ranks on this node, sharded FSDP-style\n"
     "      lora_dpo --config FILE [section.key=value ...]\n"
     "                          preference tuning (dpo.loss: sigmoid, ipo, hinge, orpo, simpo) on\n"
     "                          data.format = \"preference\" pairs; same ranks, resume and exports\n"
     "                          every key, its default and what it does: `qlora config`\n"},
    {"config",
     "  config [--config FILE] [lora_finetune|lora_dpo] [section.key=value ...]\n"
     "                          the complete resolved configuration: every key, its value, its\n"
     "                          default and one line of what it does\n"},
    {"data",
     "  data [--config FILE] [section.key=value ...] [-n N]\n"
     "                          the data as lora_finetune sees it, no model loaded: the first N\n"
     "                          samples (3) with trained text marked, token counts, truncated and\n"
     "                          untrained samples, packing efficiency, a length histogram\n"},
    {"generate",
     "  generate --checkpoint DIR (--prompt TEXT | --instruction TEXT [--input TEXT] |\n"
     "           [--system TEXT] --message TEXT [--message TEXT ...]) [--print-prompt]\n"
     "           [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--nf4]\n"
     "                          text from an exported epoch (out/.../epoch_N); --instruction and\n"
     "                          --message render the template the run trained with (qlora.json)\n"},
    {"plot",
     "  plot OUT_DIR [OUT_DIR ...] [-o FILE.svg]\n"
     "                          training/validation loss, lr and tokens/s over steps from each\n"
     "                          run's metrics.jsonl, runs overlaid, as one SVG (default\n"
     "                          OUT_DIR/plot.svg; ./plot.svg for several runs)\n"},
    {"ls", "  ls                      recipes and shipped configs\n"},
    {"tokenize",
     "  tokenize --tokenizer FILE_OR_MODEL_DIR (--text TEXT | --file FILE) [--decode]\n"
     "                          per input line, {\"ids\": [...]} as qlora tokenizes it; --decode:\n"
     "                          lines of id lists (JSON or comma-separated) to {\"text\": ...}\n"},
    {"quantize",
     "  quantize [IN OUT] [--out DIR]\n"
     "                          every 2-D float *_proj.weight of a safetensors file or HF\n"
     "                          checkpoint directory becomes NF4 (qlora-nf4-v1), the rest is\n"
     "                          copied; no arguments: the bundled tiny example\n"},
    {"dequantize",
     "  dequantize IN OUT [--dtype bf16|fp16|fp32]\n"
     "                          the inverse: NF4 tensors back to plain tensors\n"},
    {"gguf",
     "  gguf DIR [--type f32|f16|bf16|q8_0|q4_0|...] [-o FILE] [--name NAME]\n"
     "                          an HF checkpoint directory (an exported epoch) as one GGUF file\n"
     "                          for llama.cpp / Ollama (default DIR/<dir name>-<type>.gguf)\n"
     "  gguf DIR --adapter [--base BASE] [--type f32|f16|bf16|q8_0] [-o FILE]\n"
     "                          the PEFT adapter of an exported epoch as a GGUF LoRA\n"},
    {"help", "  help                    this text\n"},
};

std::string full_usage() {
  std::string u = "usage: qlora <command> [args]   (qlora <command> --help: that command's usage)\n\ncommands:\n";
  for (const Command& c : kCommands) u += c.usage;
  return u;
}

const Command* find_command(const std::string& name) {
  for (const Command& c : kCommands)
    if (name == c.name) return &c;
  return nullptr;
}

bool asks_for_help(const std::vector<std::string>& args) {
  return std::any_of(args.begin(), args.end(), [](const std::string& a) { return a == "--help" || a == "-h"; });
}

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

int ls_main(const std::vector<std::string>& args) {
  if (!args.empty()) throw std::invalid_argument("unknown option '" + args[0] + "'");
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

// `qlora config`: every key of the resolved configuration beside its default; a recipe name
// first is accepted (both recipes read the same schema).
int config_main(std::vector<std::string> args) {
  if (!args.empty() && (args[0] == "lora_finetune" || args[0] == "lora_dpo")) args.erase(args.begin());
  const auto values = qlora::config::key_values(qlora::recipes::load_recipe_config(args));
  const auto defaults = qlora::config::key_values(qlora::config::RecipeConfig{});
  size_t width = 0;
  for (const auto& [key, value] : values) width = std::max(width, key.size() + 3 + value.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const std::string line = values[i].first + " = " + values[i].second;
    std::printf("%-*s  # default: %s\n", static_cast<int>(width), line.c_str(), defaults[i].second.c_str());
    std::printf("%*s    %s\n", static_cast<int>(width), "", std::string(qlora::config::key_description(values[i].first)).c_str());
  }
  return 0;
}

int dispatch(const std::string& cmd, const std::vector<std::string>& args) {
  if (cmd == "run") return run_main(args);
  if (cmd == "config") return config_main(args);
  if (cmd == "generate") return qlora::recipes::generate_main(args);
  if (cmd == "ls") return ls_main(args);
  if (cmd == "quantize") return qlora::recipes::quantize_main(args);
  if (cmd == "dequantize") return qlora::recipes::dequantize_main(args);
  if (cmd == "tokenize") return qlora::recipes::tokenize_main(args);
  if (cmd == "plot") return qlora::recipes::plot_main(args);
  if (cmd == "data") return qlora::recipes::data_main(args);
  return qlora::recipes::gguf_main(args);
}

}  // namespace

namespace qlora::recipes {

int qlora_cli(int argc, char** argv) {
  qlora::io::tune_cpu_memory();
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    std::fputs(full_usage().c_str(), args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  const Command* command = find_command(cmd);
  if (!command || cmd == "help") {
    std::fprintf(stderr, "qlora: unknown command '%s'\n\n%s", cmd.c_str(), full_usage().c_str());
    return 2;
  }
  if (asks_for_help(args)) {
    std::printf("usage: qlora\n%s", command->usage);
    return 0;
  }
  try {
    return dispatch(cmd, args);
  } catch (const std::invalid_argument& e) {  // the command line itself: the command's usage follows
    const bool has_usage = std::string(e.what()).find("usage: ") != std::string::npos;  // plot's, generate's
    std::fprintf(stderr, "qlora %s: error: %s\n", cmd.c_str(), e.what());
    if (!has_usage) std::fprintf(stderr, "\nusage: qlora\n%s", command->usage);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qlora %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}

}  // namespace qlora::recipes
