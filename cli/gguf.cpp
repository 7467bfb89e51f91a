// `qlora gguf DIR --type TYPE [-o FILE] [--name NAME]`: an HF checkpoint directory (an exported
// epoch, or a model of a family qlora writes) as one GGUF file for llama.cpp / Ollama
// (src/qlora/gguf/convert.h), and an Ollama Modelfile beside it (gguf/modelfile.h). Default
// output: DIR/<name>-<type>.gguf and DIR/<name>-<type>.Modelfile.
// `qlora gguf DIR --mmproj [--type f16] [-o FILE]`: a vision-language checkpoint's tower and projector
// as the mmproj GGUF llama.cpp's multimodal tools read beside the model's GGUF (gguf/mmproj.h).
// `qlora gguf DIR --adapter [--base BASE] [--type f16] [-o FILE]`: the PEFT adapter of an exported
// epoch (DIR/adapter/) or a PEFT adapter directory as a GGUF LoRA adapter (gguf/adapter.h), for
// llama.cpp's --lora and Ollama's ADAPTER on the base model's GGUF.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/gguf/adapter.h"
#include "qlora/gguf/convert.h"
#include "qlora/gguf/mmproj.h"
#include "qlora/gguf/modelfile.h"
#include "qlora/io/cpu_memory.h"
#include "cli/cli.h"

namespace qlora::cli {
namespace {
namespace fs = std::filesystem;

struct GgufArgs {
  std::string dir, out, type = "f16", name, base;
  bool adapter = false, mmproj = false;
};

std::string dir_name(const std::string& dir) {
  const std::string base = fs::path(dir).lexically_normal().filename().string();
  return base.empty() || base == "." ? "model" : base;
}

void report(const std::string& out, size_t tensors, const std::string& type, double seconds) {
  std::printf("%s: %zu tensors, %s, %.1f MB; %.2f s; peak RSS %.0f MiB\n", out.c_str(), tensors, type.c_str(),
              static_cast<double>(fs::file_size(out)) / 1e6, seconds, io::peak_rss_bytes() / 1048576.0);
}

// The adapter directory and the checkpoint whose config and key layout it was trained on: an
// epoch's adapter/ with the epoch's merged model, or a PEFT directory with the base it names.
std::pair<std::string, std::string> adapter_and_base(const GgufArgs& a) {
  const bool epoch = fs::exists(fs::path(a.dir) / "adapter" / "adapter_config.json");
  const std::string adapter = epoch ? (fs::path(a.dir) / "adapter").string() : a.dir;
  const std::string config = (fs::path(adapter) / "adapter_config.json").string();
  if (!fs::exists(config))
    throw std::invalid_argument(a.dir + ": no adapter/adapter_config.json or adapter_config.json (a PEFT adapter)");
  if (!a.base.empty()) return {adapter, a.base};
  if (epoch && fs::exists(fs::path(a.dir) / "config.json")) return {adapter, a.dir};  // the merged export beside it
  std::ifstream f(config);
  const nlohmann::json c = nlohmann::json::parse(f, nullptr, false);
  const std::string named = c.is_object() && c.value("base_model_name_or_path", nlohmann::json()).is_string()
                                ? c["base_model_name_or_path"].get<std::string>() : "";
  if (named.empty() || !fs::exists(fs::path(named) / "config.json"))
    throw std::invalid_argument(config + ": base_model_name_or_path '" + named +
                                "' is not a local checkpoint directory; give the base with --base DIR");
  return {adapter, named};
}

int adapter_main(const GgufArgs& a) {
  const auto [adapter, base] = adapter_and_base(a);
  gguf::AdapterOptions o;
  o.type = gguf::type_from_name(a.type);
  o.name = a.name;
  const std::string out =
      a.out.empty() ? (fs::path(a.dir) / (dir_name(base) + "-lora-" + a.type + ".gguf")).string() : a.out;
  const auto t0 = std::chrono::steady_clock::now();
  const size_t n = gguf::write_adapter_gguf(adapter, base, out, o);
  report(out, n, a.type, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("apply it to the base model's GGUF: llama-cli -m BASE.gguf --lora %s (Ollama: ADAPTER %s)\n",
              out.c_str(), out.c_str());
  return 0;
}

int mmproj_main(const GgufArgs& a) {
  gguf::ConvertOptions o;
  o.type = gguf::type_from_name(a.type);
  o.name = a.name;
  const std::string out =
      a.out.empty() ? (fs::path(a.dir) / (dir_name(a.dir) + "-mmproj-" + a.type + ".gguf")).string() : a.out;
  const auto t0 = std::chrono::steady_clock::now();
  const size_t n = gguf::write_mmproj(a.dir, out, o);
  report(out, n, a.type, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("use it beside the model's GGUF: llama-mtmd-cli -m MODEL.gguf --mmproj %s --image IMAGE\n", out.c_str());
  return 0;
}

int model_main(const GgufArgs& a) {
  gguf::ConvertOptions o;
  o.type = gguf::type_from_name(a.type);
  o.name = a.name;
  const std::string out = a.out.empty() ? (fs::path(a.dir) / (dir_name(a.dir) + "-" + a.type + ".gguf")).string() : a.out;
  const auto t0 = std::chrono::steady_clock::now();
  const size_t n = gguf::write_gguf(a.dir, out, o);
  report(out, n, a.type, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  const std::string modelfile = gguf::write_modelfile(a.dir, out);
  std::printf("%s: for Ollama, ollama create NAME -f %s\n", modelfile.c_str(), modelfile.c_str());
  return 0;
}

}  // namespace

Command gguf_command(CLI::App& cmd) {
  auto a = std::make_shared<GgufArgs>();
  cmd.add_option("DIR", a->dir, "an HF checkpoint directory (an exported epoch); with --adapter, an\n"
                                "exported epoch or a PEFT adapter directory")->required();
  cmd.add_option("--type", a->type, "the tensors' type: " + gguf::type_names() + "\n(--adapter: f32|f16|bf16|q8_0)");
  cmd.add_option("-o,--out", a->out, "the GGUF file (default DIR/<dir name>-<type>.gguf, with an Ollama\n"
                                     "Modelfile beside it; --adapter: DIR/<base name>-lora-<type>.gguf;\n"
                                     "--mmproj: DIR/<dir name>-mmproj-<type>.gguf)")->type_name("FILE");
  cmd.add_option("--name", a->name, "general.name (default: the directory's name)");
  CLI::Option* adapter = cmd.add_flag("--adapter", a->adapter, "the PEFT adapter of DIR, as a GGUF LoRA for\n"
                                            "llama.cpp's --lora and Ollama's ADAPTER");
  cmd.add_option("--base", a->base, "the checkpoint the adapter was trained on (default: the epoch's\n"
                                    "merged model, else the adapter's base_model_name_or_path)")->type_name("BASE")->needs(adapter);
  cmd.add_flag("--mmproj", a->mmproj, "the vision tower and projector of DIR (Qwen3.5, Gemma 3, Gemma 4)\n"
                                      "as llama.cpp's mmproj file (--type f32|f16|bf16)")->excludes(adapter);
  return [a] { return a->adapter ? adapter_main(*a) : a->mmproj ? mmproj_main(*a) : model_main(*a); };
}

}  // namespace qlora::cli
