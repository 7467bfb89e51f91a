// The `qlora` command line: one CLI11 app with a subcommand per command (cli.h); cli/main.cpp is
// the binary's main, and tests/tools/qlora_faults.cpp runs the same command line with a fault plan.
#include "cli/cli.h"
#include "recipes/recipes.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "qlora/config/config.h"
#include "qlora/engine/launcher.h"
#include "qlora/io/cpu_memory.h"

namespace qlora::cli {
namespace {

using recipes::lora_dpo_main;
using recipes::lora_finetune_main;
using recipes::lora_grpo_main;

struct Recipe {
  const char* name;
  const char* about;  // one line, as `qlora ls` and `qlora run --help` list it
  int (*main)(const ConfigArgs&);
};

const Recipe kRecipes[] = {
    {"lora_finetune", "QLoRA fine-tuning (one process, or N ranks with --nproc-per-node)", lora_finetune_main},
    {"lora_dpo", "preference tuning: DPO, IPO, hinge, ORPO, SimPO (data.format = \"preference\")", lora_dpo_main},
    {"lora_grpo", "RL with verifiable rewards: GRPO, DAPO, Dr. GRPO, GSPO, CISPO (data.format = \"prompt\")",
     lora_grpo_main},
};

// `qlora run [launcher options] RECIPE ...`: this process runs the recipe, or starts this node's ranks
// of it (engine/launcher.h), each running `qlora run RECIPE` with the same config arguments.
int launch_recipe(const engine::LaunchOptions& launch, const Recipe& recipe, const ConfigArgs& config) {
  engine::check_launch_options(launch);
  if (launch.nproc_per_node * launch.nnodes == 1) return recipe.main(config);
  if (engine::launched_as_rank())
    throw UsageError("--nproc-per-node inside a job that already has ranks (WORLD_SIZE > 1, set by "
                                "torchrun, Slurm or `qlora run --nproc-per-node`): run `qlora run <recipe> ...` "
                                "in each rank instead");
  std::vector<std::string> args = {"run", recipe.name};
  if (!config.path.empty()) args.insert(args.end(), {"--config", config.path});
  args.insert(args.end(), config.overrides.begin(), config.overrides.end());
  return engine::launch(launch, std::filesystem::read_symlink("/proc/self/exe").string(), args);
}

Command run_command(CLI::App& run) {
  auto launch = std::make_shared<engine::LaunchOptions>();
  run.add_option("--nproc-per-node", launch->nproc_per_node, "N ranks on this node (N > 1: sharded FSDP-style)")
      ->type_name("N")->check(CLI::Range(1, 1024));
  run.add_option("--nnodes", launch->nnodes, "M nodes, each running this command")->type_name("M")->check(CLI::Range(1, 65536));
  run.add_option("--node-rank", launch->node_rank, "this node's rank K (0 <= K < M)")->type_name("K")->check(CLI::Range(0, 65535));
  run.add_option("--master-addr", launch->master_addr, "node 0's address")->type_name("A");
  run.add_option("--master-port", launch->master_port, "node 0's port, the same on every node (needed for M > 1)")
      ->type_name("P")->check(CLI::Range(1, 65535))->default_str("");  // 0: a free port (one node)
  auto config = std::make_shared<ConfigArgs>();
  std::vector<std::pair<const CLI::App*, const Recipe*>> recipes;
  for (const Recipe& r : kRecipes) {
    CLI::App* sub = run.add_subcommand(r.name, r.about);
    add_config_args(*sub, *config);
    recipes.emplace_back(sub, &r);
  }
  run.require_subcommand(0, 1);
  run.footer("qlora run RECIPE [--config FILE] [section.key=value ...]: no --config runs the embedded\n"
             "tiny default; every key, its default and what it does: `qlora config`");
  return [launch, config, recipes] {
    const auto it = std::find_if(recipes.begin(), recipes.end(), [](const auto& r) { return r.first->parsed(); });
    if (it == recipes.end()) throw UsageError("qlora run needs a recipe (see `qlora ls`)");
    return launch_recipe(*launch, *it->second, *config);
  };
}

Command ls_command(CLI::App&) {
  return [] {
    std::printf("recipes:\n");
    for (const Recipe& r : kRecipes) std::printf("  %-16s %s\n", r.name, r.about);
    std::printf("\nconfigs (%s/configs):\n", QLORA_SOURCE_DIR);
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(QLORA_SOURCE_DIR "/configs"))
      if (e.path().extension() == ".toml") names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    for (const auto& n : names) std::printf("  configs/%s\n", n.c_str());
    return 0;
  };
}

// `qlora config`: every key of the resolved configuration beside its default; a recipe name
// first is accepted (both recipes read the same schema).
int print_config(ConfigArgs a) {
  if (!a.overrides.empty() && std::any_of(std::begin(kRecipes), std::end(kRecipes),
                                          [&](const Recipe& r) { return a.overrides[0] == r.name; }))
    a.overrides.erase(a.overrides.begin());
  const auto values = config::key_values(load_recipe_config(a));
  const auto defaults = config::key_values(config::RecipeConfig{});
  size_t width = 0;
  for (const auto& [key, value] : values) width = std::max(width, key.size() + 3 + value.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const std::string line = values[i].first + " = " + values[i].second;
    std::printf("%-*s  # default: %s\n", static_cast<int>(width), line.c_str(), defaults[i].second.c_str());
    std::printf("%*s    %s\n", static_cast<int>(width), "", std::string(config::key_description(values[i].first)).c_str());
  }
  return 0;
}

Command config_command(CLI::App& cmd) {
  auto a = std::make_shared<ConfigArgs>();
  add_config_args(cmd, *a);
  return [a] { return print_config(*a); };
}

// Each command, in the order `qlora --help` lists them; "help" has no command of its own.
struct Entry {
  const char* name;
  const char* about;
  Command (*add)(CLI::App&);
};

const Entry kCommands[] = {
    {"run", "a recipe (lora_finetune, lora_dpo, lora_grpo) from a TOML config, on one process or N ranks", run_command},
    {"config", "the complete resolved configuration of --config FILE and overrides (a recipe\n"
               "name first is accepted): every key, its value, its default and what it does", config_command},
    {"data", "the data as lora_finetune sees it, no model loaded: the first N samples with\n"
             "trained text marked, token counts, truncated and untrained samples, packing\n"
             "efficiency, a length histogram", data_command},
    {"generate", "text from an exported epoch (out/.../epoch_N); --instruction and --message\n"
                 "render the template the run trained with (qlora.json)", generate_command},
    {"plot", "training/validation loss, lr and tokens/s over steps from each run's\n"
             "metrics.jsonl, runs overlaid, as one SVG", plot_command},
    {"ls", "recipes and shipped configs", ls_command},
    {"tokenize", "per input line, {\"ids\": [...]} as qlora tokenizes it; --decode: lines of\n"
                 "id lists to {\"text\": ...}", tokenize_command},
    {"quantize", "every 2-D float *_proj.weight of a safetensors file or HF checkpoint\n"
                 "directory becomes NF4 (qlora-nf4-v1), the rest is copied", quantize_command},
    {"dequantize", "the inverse: NF4 tensors back to plain tensors", dequantize_command},
    {"gguf", "an HF checkpoint directory (an exported epoch) as one GGUF file for\n"
             "llama.cpp / Ollama, or with --adapter its PEFT adapter as a GGUF LoRA", gguf_command},
    {"help", "this text", nullptr},
};

std::string top_help(const CLI::App& app) {
  return app.get_formatter()->make_help(&app, app.get_name(), CLI::AppFormatMode::Normal);
}

// "qlora gguf" for `qlora gguf ...`: the chain of subcommands the command line selected.
std::string command_path(const CLI::App& app) {
  std::string path = app.get_name();
  for (const CLI::App* a = &app; !a->get_subcommands().empty();) {
    a = a->get_subcommands().front();
    path += " " + a->get_name();
  }
  return path;
}

// An error; one in the command line itself (`with_usage`) is followed by the command's usage.
int fail(const CLI::App& app, const char* what, bool with_usage) {
  std::fprintf(stderr, "%s: error: %s\n", command_path(app).c_str(), what);
  if (with_usage) std::fprintf(stderr, "\n%s", app.help().c_str());
  return 1;
}

}  // namespace

int qlora_cli(int argc, char** argv) {
  io::tune_cpu_memory();
  CLI::App app("QLoRA fine-tuning of decoder LLMs (`qlora COMMAND --help`: that command's usage)", "qlora");
  app.get_formatter()->label("Usage", "usage");
  app.option_defaults()->always_capture_default();
  app.require_subcommand(0, 1);
  std::vector<std::pair<const CLI::App*, Command>> commands;
  for (const Entry& e : kCommands) {
    CLI::App* cmd = app.add_subcommand(e.name, e.about);
    commands.emplace_back(cmd, e.add ? e.add(*cmd) : Command());
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {  // --help or -h: the usage of the command it follows
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {  // an unknown argument is named first, before a missing one
    const std::vector<std::string> unknown = app.remaining(true);
    return fail(app, unknown.empty() ? e.what() : CLI::ExtrasError(unknown).what(), true);
  }
  const auto it = std::find_if(commands.begin(), commands.end(), [](const auto& c) { return c.first->parsed(); });
  if (it == commands.end() || !it->second) {  // no command: the usage on stderr; `qlora help`: on stdout
    std::fputs(top_help(app).c_str(), it == commands.end() ? stderr : stdout);
    return it == commands.end() ? 2 : 0;
  }
  try {
    return it->second();
  } catch (const UsageError& e) {  // the command line: its usage follows
    return fail(app, e.what(), true);
  } catch (const std::exception& e) {
    return fail(app, e.what(), false);
  }
}

}  // namespace qlora::cli
