// The `qlora` command line is one CLI11 app (recipes/cli.cpp) with a subcommand per command. Each
// command's file adds its options to its subcommand and returns what runs it once they are parsed;
// CLI11 answers --help/-h with the subcommand's usage and refuses unknown options; cli.cpp prints
// every error, and the usage of the command it came from after an error in the command line only
// (CLI11's, or a UsageError a command throws), never after one in a file the command read.
#pragma once

#include <functional>
#include <stdexcept>

#include <CLI/CLI.hpp>

#include "recipe_config.h"

namespace qlora::recipes {

// An error in the command line itself (options that do not combine, a missing or malformed value):
// cli.cpp prints the command's usage after it. Errors in what the command reads (a model's files,
// a config, a template) are any other exception, printed alone.
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

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
