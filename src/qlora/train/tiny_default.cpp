#include "qlora/train/tiny_default.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "qlora/io/safetensors.h"
#include "qlora/models/architecture.h"

namespace qlora::train {
namespace fs = std::filesystem;

namespace {
// Vocab matches the bundled tokenizer; the rest is as small as still shows learning in a minute.
constexpr int64_t kVocab = 512, kHidden = 128, kInter = 352, kLayers = 4, kHeads = 4, kKvHeads = 2;

// The base's tensors in checkpoint order (the order fixes the random draws, hence the base).
std::vector<std::pair<std::string, at::Tensor>> tiny_tensors() {
  models::LlamaConfig c;  // just the sizes the architecture table's shapes read
  c.hidden_size = kHidden;
  c.intermediate_size = kInter;
  c.num_attention_heads = kHeads;
  c.num_key_value_heads = kKvHeads;
  c.head_dim = kHidden / kHeads;
  c.vocab_size = kVocab;
  at::Generator gen = at::detail::createCPUGenerator(20240611);
  auto w = [&](const std::vector<int64_t>& shape) {
    return (at::randn(shape, gen, at::kFloat) * 0.02).to(at::kBFloat16);
  };
  const auto ones = [] { return at::ones({kHidden}, at::kBFloat16); };
  const models::Architecture& arch = models::llama_architecture();
  std::vector<std::pair<std::string, at::Tensor>> t = {{arch.embed_key, w({kVocab, kHidden})}};
  for (int64_t i = 0; i < kLayers; ++i) {
    for (const models::ProjectionRow& row : arch.projections)
      if (row.member) t.push_back({models::hf_key(row, i), w(models::projection_shape(row, c))});
    for (const models::NormRow& n : arch.layer_norms) t.push_back({models::hf_key(n, i), ones()});
  }
  t.push_back({arch.final_norm_key, ones()});
  const models::ProjectionRow& head = models::output_projection(arch);
  t.push_back({models::hf_key(head, 0), w(models::projection_shape(head, c))});
  return t;
}

}  // namespace

std::string bundled_data_dir() {
  if (const char* d = std::getenv("QLORA_DATA_DIR")) return d;
  return QLORA_SOURCE_DIR "/tests/data";
}

std::string ensure_tiny_base(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "model.safetensors") && fs::exists(fs::path(dir) / "config.json")) return dir;
  const std::string tokenizer = bundled_data_dir() + "/tokenizer/tokenizer.model";
  if (!fs::exists(tokenizer)) throw std::runtime_error("bundled tokenizer not found: " + tokenizer);
  const fs::path tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  io::save_safetensors((tmp / "model.safetensors").string(), tiny_tensors(), {{"format", "pt"}});

  const nlohmann::json config = {
      {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", kHidden},
      {"intermediate_size", kInter}, {"num_hidden_layers", kLayers}, {"num_attention_heads", kHeads},
      {"num_key_value_heads", kKvHeads}, {"vocab_size", kVocab}, {"max_position_embeddings", 256},
      {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false},
      {"bos_token_id", 1}, {"eos_token_id", 2}, {"hidden_act", "silu"}, {"torch_dtype", "bfloat16"}};
  io::write_file_atomic((tmp / "config.json").string(), config.dump(2) + "\n");
  fs::copy_file(tokenizer, tmp / "tokenizer.model", fs::copy_options::overwrite_existing);
  // The other two files were fsynced by their writers; without this a power loss after the
  // rename could leave a complete-looking base with an empty or torn tokenizer.
  io::fsync_path((tmp / "tokenizer.model").string());
  io::fsync_path(tmp.string());
  fs::remove_all(dir);
  fs::rename(tmp, dir);
  const fs::path parent = fs::path(dir).parent_path();
  io::fsync_path(parent.empty() ? "." : parent.string());  // makes the rename itself durable
  return dir;
}

}  // namespace qlora::train
