// What sits beside a model GGUF so that Ollama serves it as qlora does: a Modelfile with FROM the
// file and a `PARAMETER stop` for each id generation stops at (checkpoint/serving.h). Ollama takes
// the chat template from the GGUF's tokenizer.chat_template.
//
// And the GGUF files of an epoch's export (checkpoint.gguf): DIR/<name>-<type>.gguf plus its
// Modelfile for each type, written into the export's directory before it is committed.
#pragma once

#include <string>
#include <vector>

#include "qlora/gguf/ggml_types.h"

namespace qlora::gguf {

// The Modelfile text for `gguf_file` (a name relative to the Modelfile's directory) of checkpoint
// directory `dir`.
std::string modelfile_text(const std::string& dir, const std::string& gguf_file);

// Writes <gguf_path without .gguf>.Modelfile atomically; returns its path.
std::string write_modelfile(const std::string& dir, const std::string& gguf_path);

// For each type, DIR/<name>-<type>.gguf (from DIR's HF checkpoint) and its Modelfile; for a
// vision-language checkpoint also DIR/<name>-mmproj-<type>.gguf (mmproj.h) once, in the first float type
// of `types` (f16 where all are quantized), unless it is there already. Returns the GGUF paths written.
// `name` is general.name and the files' stem.
std::vector<std::string> write_gguf_files(const std::string& dir, const std::vector<GgmlType>& types,
                                          const std::string& name);

}  // namespace qlora::gguf
