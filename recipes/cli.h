// The `qlora` command line is one CLI11 app (recipes/cli.cpp) with a subcommand per command. Each
// command's file adds its options to its subcommand and returns what runs it once they are parsed;
// CLI11 answers --help/-h with the subcommand's usage and refuses unknown options, and cli.cpp
// prints every error with the usage of the command it came from.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

#include "recipe_config.h"

namespace qlora::recipes {

// Runs the command with the values its options were parsed into; returns the exit status.
using Command = std::function<int()>;

// A number option's check that it is not negative (CLI11's NonNegativeNumber prints DBL_MAX).
inline const CLI::Validator kNotNegative(
    [](std::string& v) { return v.rfind('-', 0) == 0 ? "must be 0 or more, got " + v : std::string(); }, "");

// `qlora CMD`'s options, added to `cmd` (whose name and description cli.cpp sets).
Command generate_command(CLI::App& cmd);
Command tokenize_command(CLI::App& cmd);
Command plot_command(CLI::App& cmd);
Command data_command(CLI::App& cmd);
Command gguf_command(CLI::App& cmd);
Command quantize_command(CLI::App& cmd);
Command dequantize_command(CLI::App& cmd);

int lora_finetune_main(const ConfigArgs& a);
int lora_dpo_main(const ConfigArgs& a);
int lora_grpo_main(const ConfigArgs& a);

// The binary's main (recipes/main.cpp, tests/tools/qlora_faults.cpp).
int qlora_cli(int argc, char** argv);

}  // namespace qlora::recipes
