// Command-line shape of a bench model, shared by bench_train_step and bench_dist: a Llama shape
// (written once as a random bf16 checkpoint by bench/peer_train_step.py) or a named real shape
// (--shape, bench/model_shapes.h; random NF4, in memory; --llama2-7b is --shape llama2-7b), and
// how many steps to time.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "bench/model_shapes.h"

namespace qlora::bench {

struct ShapeArgs {
  int64_t hidden = 768, inter = 2048, layers = 12, heads = 12, vocab = 32000;
  int64_t seq = 512, steps = 3;
  std::string workdir;  // the random checkpoint's directory; empty = one per shape under /tmp
  std::string shape;  // a name of bench/model_shapes.h; empty: the Llama shape of the flags above
  bool seq_given = false, steps_given = false, layers_given = false, vocab_given = false;

  // Consumes argv[i] (and its value) when it is a shape flag; false otherwise.
  bool parse(int argc, char** argv, int& i) {
    const std::string s = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
      return std::stoll(argv[++i]);
    };
    if (s == "--hidden") hidden = next();
    else if (s == "--inter") inter = next();
    else if (s == "--layers") { layers = next(); layers_given = true; }
    else if (s == "--heads") heads = next();
    else if (s == "--vocab") { vocab = next(); vocab_given = true; }
    else if (s == "--seq") { seq = next(); seq_given = true; }
    else if (s == "--steps") { steps = next(); steps_given = true; }
    else if (s == "--llama2-7b") shape = "llama2-7b";
    else if (s == "--shape") {
      if (i + 1 >= argc) throw std::invalid_argument("--shape needs a value (" + model_shape_names() + ")");
      shape = model_shape(argv[++i]).name;
    } else if (s == "--workdir") {
      if (i + 1 >= argc) throw std::invalid_argument("--workdir needs a value");
      workdir = argv[++i];
    } else return false;
    return true;
  }

  // A named shape runs at seq 128, one step, all its layers unless told otherwise: minutes on a
  // small CPU.
  void finish() {
    if (!shape.empty()) {
      if (!seq_given) seq = 128;
      if (!steps_given) steps = 1;
      if (!layers_given) layers = model_shape_config(shape).num_hidden_layers;
    }
    if (layers < 1) throw std::invalid_argument("--layers must be >= 1");
    if (steps < 1 || seq < 1) throw std::invalid_argument("--steps and --seq must be >= 1");
    if (workdir.empty())
      workdir = (std::filesystem::temp_directory_path() /
                 ("qlora_bench_train_step_h" + std::to_string(hidden) + "_l" + std::to_string(layers) + "_v" +
                  std::to_string(vocab) + "_i" + std::to_string(inter) + "_a" + std::to_string(heads)))
                    .string();
  }

  std::string flags() const {
    return " --hidden " + std::to_string(hidden) + " --inter " + std::to_string(inter) + " --layers " +
           std::to_string(layers) + " --heads " + std::to_string(heads) +
           (shape.empty() || vocab_given ? " --vocab " + std::to_string(vocab) : "") + " --seq " + std::to_string(seq) + " --steps " + std::to_string(steps) +
           (shape.empty() ? "" : " --shape " + shape);
  }

  // The named shape's config at the chosen depth (and --vocab, where given: a test's smaller head).
  models::DecoderConfig shape_config() const {
    models::DecoderConfig c = model_shape_config(shape, layers);
    if (vocab_given) c.vocab_size = vocab;
    return c;
  }

  // Writes the random bf16 checkpoint of this shape once (the peer script's --write-model).
  void ensure_checkpoint(const std::string& python, const std::string& source_dir) const {
    if (std::filesystem::exists(std::filesystem::path(workdir) / "model.safetensors") &&
        std::filesystem::exists(std::filesystem::path(workdir) / "config.json"))
      return;
    const std::string cmd = python + " " + source_dir + "/bench/peer_train_step.py --write-model " + workdir + flags();
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("could not write the bench checkpoint: " + cmd);
  }
};

}  // namespace qlora::bench
