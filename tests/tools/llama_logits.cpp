// llama_logits: runs our Llama forward on given token ids and writes the logits, so Python
// conformance tests can compare them with transformers.
//   llama_logits --checkpoint DIR --tokens 1,2,3[;4,5,6] [--nf4] [--dtype fp32|bf16] --out FILE
// Writes FILE (safetensors) with "logits": float32 [batch, seq, vocab].
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "qlora/io/safetensors.h"
#include "qlora/models/llama.h"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "llama_logits: " << why << "\n"
            << "usage: llama_logits --checkpoint DIR --tokens 1,2,3[;4,5,6] [--nf4] [--dtype fp32|bf16] --out FILE\n";
  std::exit(2);
}

// "1,2,3;4,5,6" -> rows of equal length.
at::Tensor parse_tokens(const std::string& text) {
  std::vector<int64_t> flat;
  int64_t rows = 0, cols = -1;
  std::stringstream rs(text);
  std::string row;
  while (std::getline(rs, row, ';')) {
    std::stringstream cs(row);
    std::string item;
    int64_t n = 0;
    while (std::getline(cs, item, ',')) {
      try {
        size_t used = 0;
        flat.push_back(std::stoll(item, &used));
        if (used != item.size()) throw std::invalid_argument(item);
      } catch (const std::exception&) {
        usage("--tokens: '" + item + "' is not an integer");
      }
      ++n;
    }
    if (n == 0) usage("--tokens: empty row");
    if (cols >= 0 && n != cols) usage("--tokens: rows must have equal length");
    cols = n;
    ++rows;
  }
  if (rows == 0) usage("--tokens: no tokens");
  return at::tensor(flat, at::TensorOptions().dtype(at::kLong)).view({rows, cols});
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, tokens, out;
  qlora::models::LlamaLoadOptions opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--checkpoint") checkpoint = value();
    else if (a == "--tokens") tokens = value();
    else if (a == "--out") out = value();
    else if (a == "--nf4") opt.base_in_nf4 = true;
    else if (a == "--dtype") {
      const std::string d = value();
      if (d == "fp32") opt.compute_dtype = at::kFloat;
      else if (d == "bf16") opt.compute_dtype = at::kBFloat16;
      else usage("--dtype must be fp32 or bf16");
    } else {
      usage("unknown argument '" + a + "'");
    }
  }
  if (checkpoint.empty() || tokens.empty() || out.empty()) usage("--checkpoint, --tokens and --out are required");
  try {
    const at::Tensor ids = parse_tokens(tokens);  // [batch, seq]
    const qlora::models::LlamaModel model = qlora::models::load_llama(checkpoint, opt);
    at::NoGradGuard no_grad;
    const at::Tensor logits = model.forward(ids).contiguous();  // [batch, seq, vocab] fp32
    qlora::io::save_safetensors(out, {{"logits", logits}});
  } catch (const std::exception& e) {
    std::cerr << "llama_logits: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
