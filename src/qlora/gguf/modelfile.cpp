#include "qlora/gguf/modelfile.h"

#include <filesystem>

#include "qlora/checkpoint/serving.h"
#include "qlora/data/tokenizer.h"
#include "qlora/gguf/convert.h"
#include "qlora/gguf/mmproj.h"
#include "qlora/io/durable_file.h"

namespace qlora::gguf {
namespace fs = std::filesystem;

std::string modelfile_text(const std::string& dir, const std::string& gguf_file) {
  const data::Tokenizer tok = data::Tokenizer::open(data::Tokenizer::find_file(dir));
  const checkpoint::Serving serving = checkpoint::serving_format(dir, tok);
  std::string text = "# Ollama: ollama create NAME -f THIS_FILE (written by qlora)\n";
  text += "FROM ./" + gguf_file + "\n";
  for (const int64_t id : serving.stop_ids) {
    const std::string piece = tok.id_to_piece(id);
    // Ollama's quoted values end at a quote and its lines at a newline: such a token cannot be
    // spelled, and stopping at its id is then llama.cpp's end-of-generation rule alone.
    if (piece.empty() || piece.find_first_of("\"\n\r") != std::string::npos) {
      text += "# stop id " + std::to_string(id) + " has no text Ollama can quote\n";
      continue;
    }
    text += "PARAMETER stop \"" + piece + "\"\n";
  }
  return text;
}

std::string write_modelfile(const std::string& dir, const std::string& gguf_path) {
  const fs::path p(gguf_path);
  const std::string out = (p.parent_path() / (p.stem().string() + ".Modelfile")).string();
  io::write_file_atomic(out, modelfile_text(dir, p.filename().string()));
  return out;
}

std::vector<std::string> write_gguf_files(const std::string& dir, const std::vector<GgmlType>& types,
                                          const std::string& name) {
  std::vector<std::string> paths;
  for (const GgmlType type : types) {
    ConvertOptions o;
    o.type = type;
    o.name = name;
    const std::string path = (fs::path(dir) / (name + "-" + type_info(type).option + ".gguf")).string();
    write_gguf(dir, path, o);
    write_modelfile(dir, path);
    paths.push_back(path);
  }
  if (!has_mmproj(dir)) return paths;
  // The vision tower once, in the first float type asked for (f16 beside quantized files).
  ConvertOptions o;
  o.type = GgmlType::F16;
  for (const GgmlType type : types)
    if (!is_quantized(type)) {
      o.type = type;
      break;
    }
  o.name = name;
  const std::string path = (fs::path(dir) / (name + "-mmproj-" + type_info(o.type).option + ".gguf")).string();
  if (!fs::exists(path)) {
    write_mmproj(dir, path, o);
    paths.push_back(path);
  }
  return paths;
}

}  // namespace qlora::gguf
