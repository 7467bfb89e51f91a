// `qlora gguf DIR --type TYPE [-o FILE] [--name NAME]`: an HF checkpoint directory (an exported
// epoch, or a model of a family qlora writes) as one GGUF file for llama.cpp / Ollama
// (src/qlora/gguf/convert.h), and an Ollama Modelfile beside it (gguf/modelfile.h). Default
// output: DIR/<name>-<type>.gguf and DIR/<name>-<type>.Modelfile.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/gguf/convert.h"
#include "qlora/gguf/modelfile.h"
#include "qlora/io/cpu_memory.h"

namespace qlora::recipes {

int gguf_main(const std::vector<std::string>& args) {
  std::string dir, out, type = "f16", name;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) throw std::invalid_argument(args[i] + " needs a value");
      return args[++i];
    };
    if (args[i] == "--type") type = value();
    else if (args[i] == "-o" || args[i] == "--out") out = value();
    else if (args[i] == "--name") name = value();
    else if (!args[i].empty() && args[i][0] == '-') throw std::invalid_argument("unknown option " + args[i]);
    else if (dir.empty()) dir = args[i];
    else throw std::invalid_argument("one checkpoint directory, got '" + dir + "' and '" + args[i] + "'");
  }
  if (dir.empty()) throw std::invalid_argument("usage: qlora gguf DIR [--type " + gguf::type_names() + "] [-o FILE]");
  gguf::ConvertOptions o;
  o.type = gguf::type_from_name(type);
  o.name = name;
  if (out.empty()) {
    const std::string base = std::filesystem::path(dir).lexically_normal().filename().string();
    out = (std::filesystem::path(dir) / ((base.empty() ? std::string("model") : base) + "-" + type + ".gguf")).string();
  }
  const auto t0 = std::chrono::steady_clock::now();
  const size_t n = gguf::write_gguf(dir, out, o);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s: %zu tensors, %s, %.1f MB; %.2f s; peak RSS %.0f MiB\n", out.c_str(), n, type.c_str(),
              static_cast<double>(std::filesystem::file_size(out)) / 1e6, seconds, io::peak_rss_mib());
  const std::string modelfile = gguf::write_modelfile(dir, out);
  std::printf("%s: for Ollama, ollama create NAME -f %s\n", modelfile.c_str(), modelfile.c_str());
  return 0;
}

}  // namespace qlora::recipes
