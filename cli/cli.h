// The `qlora` command line is one CLI11 app (cli/cli.cpp) with a subcommand per command. Each
// command's file adds its options to its subcommand and returns what runs it once they are parsed;
// CLI11 answers --help/-h with the subcommand's usage and refuses unknown options; cli.cpp prints
// every error, and the usage of the command it came from after an error in the command line only
// (CLI11's, or a UsageError a command throws), never after one in a file the command read.
#pragma once

#include <functional>
#include <stdexcept>

#include <CLI/CLI.hpp>

#include "recipes/recipe_config.h"

namespace qlora::cli {

// What every command that reads a recipe config shares (recipes/recipe_config.h).
using recipes::add_config_args;
using recipes::base_model_dir;
using recipes::base_model_name;
using recipes::ConfigArgs;
using recipes::find_tokenizer;
using recipes::load_grpo_prompts;
using recipes::load_recipe_config;
using recipes::train_data_path;
using recipes::val_data_path;

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

// The binary's main (cli/main.cpp, tests/tools/qlora_faults.cpp).
int qlora_cli(int argc, char** argv);

}  // namespace qlora::cli
