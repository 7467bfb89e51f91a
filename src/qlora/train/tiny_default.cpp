#include "qlora/train/tiny_default.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <stdexcept>

#include "qlora/checkpoint/resume.h"
#include "qlora/data/batching.h"
#include "qlora/data/tokenizer.h"
#include "qlora/io/durable_file.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/architecture.h"
#include "qlora/models/decoder.h"
#include "qlora/optim/adamw.h"
#include "qlora/optim/schedule.h"
#include "qlora/train/faults.h"

namespace qlora::train {
namespace fs = std::filesystem;

namespace {
// As small as still learns both tasks in a few minutes of pre-training on 2 CPU cores.
constexpr int64_t kHidden = 128, kInter = 352, kLayers = 4, kHeads = 4, kKvHeads = 2;
constexpr uint64_t kInitSeed = 20240611, kDataSeed = 12;
// Pre-training: steps x batch samples, 2 in 3 of them sums (they take longer to learn than
// reversals). Bump kBaseVersion with any change here: it names the cache directory.
// The base's bits depend on the CPU (MKL's and ATen's kernels differ by ISA), and so does how well it
// adds: after 2500 steps the fine-tuned default got 36/50 held-out sums on a Xeon (AVX-512) and 42/50
// with AVX2 kernels forced (ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2); after 4000 steps 43/50 in both.
constexpr int64_t kSteps = 4000, kBatch = 32, kWarmup = 50;
constexpr double kLr = 2e-3;
constexpr int kBaseVersion = 6;

bool is_complete(const fs::path& dir) {
  return fs::exists(dir / "model.safetensors") && fs::exists(dir / "config.json") && fs::exists(dir / "tokenizer.model");
}

models::DecoderConfig tiny_config(int64_t vocab) {
  models::DecoderConfig c;  // just the sizes the architecture table's shapes read
  c.hidden_size = kHidden;
  c.intermediate_size = kInter;
  c.num_attention_heads = kHeads;
  c.num_key_value_heads = kKvHeads;
  c.head_dim = kHidden / kHeads;
  c.vocab_size = vocab;
  return c;
}

// The initial base's tensors in checkpoint order (the order fixes the random draws).
std::vector<std::pair<std::string, at::Tensor>> random_tensors(int64_t vocab) {
  const models::DecoderConfig c = tiny_config(vocab);
  at::Generator gen = at::detail::createCPUGenerator(kInitSeed);
  auto w = [&](const std::vector<int64_t>& shape) {
    return (at::randn(shape, gen, at::kFloat) * 0.02).to(at::kBFloat16);
  };
  const auto ones = [] { return at::ones({kHidden}, at::kBFloat16); };
  const models::Architecture& arch = models::llama_architecture();
  std::vector<std::pair<std::string, at::Tensor>> t = {{arch.embed_key, w({vocab, kHidden})}};
  for (int64_t i = 0; i < kLayers; ++i) {
    for (const models::ProjectionRow& row : arch.projections)
      if (row.member) t.push_back({models::hf_key(row, i), w(models::projection_shape(row, c, i))});
    for (const models::NormRow& n : arch.layer_norms) t.push_back({models::hf_key(n, i), ones()});
  }
  t.push_back({arch.final_norm_key, ones()});
  const models::ProjectionRow& head = models::output_projection(arch);
  t.push_back({models::hf_key(head, 0), w(models::projection_shape(head, c, 0))});
  return t;
}

// A loaded dense model's weights under their HF keys, in checkpoint order (they alias the model).
std::vector<std::pair<std::string, at::Tensor>> model_tensors(const models::DecoderModel& m) {
  const models::Architecture& arch = m.architecture();
  std::vector<std::pair<std::string, at::Tensor>> t = {{arch.embed_key, m.embed_tokens}};
  for (int64_t i = 0; i < static_cast<int64_t>(m.layers.size()); ++i) {
    for (const models::ProjectionRow& row : arch.projections)
      if (row.member) t.push_back({models::hf_key(row, i), (m.layers[i].*row.member).base_dense});
    for (const models::NormRow& n : arch.layer_norms) t.push_back({models::hf_key(n, i), m.layers[i].*n.member});
  }
  t.push_back({arch.final_norm_key, m.norm});
  t.push_back({models::hf_key(models::output_projection(arch), 0), m.lm_head.base_dense});
  return t;
}

void write_base(const fs::path& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t vocab,
                const std::string& tokenizer) {
  io::save_safetensors((dir / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const nlohmann::json config = {
      {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", kHidden},
      {"intermediate_size", kInter}, {"num_hidden_layers", kLayers}, {"num_attention_heads", kHeads},
      {"num_key_value_heads", kKvHeads}, {"vocab_size", vocab}, {"max_position_embeddings", 256},
      {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false},
      {"bos_token_id", 1}, {"eos_token_id", 2}, {"hidden_act", "silu"}, {"torch_dtype", "bfloat16"}};
  io::write_file_atomic((dir / "config.json").string(), config.dump(2) + "\n");
  fs::copy_file(tokenizer, dir / "tokenizer.model", fs::copy_options::overwrite_existing);
  io::fsync_path((dir / "tokenizer.model").string());
}

// The held-out file's inputs ("35 + 4" also as "4 + 35"), which pre-training never shows.
std::set<std::string> heldout_inputs() {
  const std::string path = bundled_val_path();
  std::ifstream in(path);
  if (!in) throw std::runtime_error("bundled held-out file not found: " + path);
  std::set<std::string> inputs;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const std::string input = nlohmann::json::parse(line).at("input").get<std::string>();
    inputs.insert(input);
    const auto plus = input.find(" + ");
    if (plus != std::string::npos) inputs.insert(input.substr(plus + 3) + " + " + input.substr(0, plus));
  }
  return inputs;
}

// One task line pair: "Add the numbers.\n35 + 4\n" and "39", or "Reverse the word.\nkite\n" and
// "etik", never with a held-out input. rng() % n rather than std:: distributions, whose results
// differ between standard libraries.
std::pair<std::string, std::string> pretraining_example(std::mt19937_64& rng, const std::set<std::string>& heldout) {
  std::string input, answer;
  while (true) {
    const bool add = rng() % 3 != 0;
    if (add) {
      const int a = static_cast<int>(rng() % 100), b = static_cast<int>(rng() % 100);
      input = std::to_string(a) + " + " + std::to_string(b);
      answer = std::to_string(a + b);
    } else {
      input.clear();
      for (int n = 3 + static_cast<int>(rng() % 5); n > 0; --n) input += static_cast<char>('a' + rng() % 26);
      answer.assign(input.rbegin(), input.rend());
    }
    if (!heldout.count(input)) return {(add ? "Add the numbers.\n" : "Reverse the word.\n") + input + "\n", answer};
  }
}

// One pre-training text: one or two examples, newline-separated, only the answers (and the final
// EOS) trained. Task, input and answer come in the order and at the distances (one token apart)
// of an Alpaca prompt, whose headers are one token each in this tokenizer, and an example that
// follows other text teaches the model to answer after any prefix (the Alpaca preamble); what the
// fine-tune has to teach is then that layout, not new relative positions.
data::Sample pretraining_sample(std::mt19937_64& rng, const data::Tokenizer& tok, const std::set<std::string>& heldout) {
  data::Sample s;
  auto push = [&](const std::vector<int64_t>& ids, bool trained) {
    s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
    for (const int64_t id : ids) s.labels.push_back(trained ? id : data::kIgnoreIndex);
  };
  push({tok.bos_id()}, false);
  for (int64_t k = 0, n = 1 + static_cast<int64_t>(rng() % 2); k < n; ++k) {
    const auto [prompt, answer] = pretraining_example(rng, heldout);
    push(tok.encode_continuation(k == 0 ? prompt : "\n" + prompt), false);
    push(tok.encode_continuation(answer), true);
  }
  push({tok.eos_id()}, true);
  return s;
}

// Full-parameter AdamW on the model's dense weights, one thread (the same bits on a given machine).
void pretrain(const models::DecoderModel& m, const data::Tokenizer& tok) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  std::vector<at::Tensor> params;
  for (auto& [name, t] : model_tensors(m)) params.push_back(t.requires_grad_(true));
  optim::AdamWOptions o;
  o.lr = kLr;
  o.weight_decay = 0.01;
  optim::AdamW adamw(params, o);
  std::mt19937_64 rng(kDataSeed);
  const std::set<std::string> heldout = heldout_inputs();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<data::Sample> samples;
    for (int64_t i = 0; i < kBatch; ++i) samples.push_back(pretraining_sample(rng, tok, heldout));
    const data::Batch b = data::collate(samples, tok.pad_id());
    const at::Tensor logits = m.forward(b.tokens);  // [batch, seq, vocab]: a few KB at this size
    const at::Tensor loss = at::cross_entropy_loss(logits.view({-1, logits.size(-1)}), b.labels.view({-1}), {},
                                                   at::Reduction::Mean, data::kIgnoreIndex);
    loss.backward();
    optim::clip_grad_norm_(params, 1.0);
    adamw.set_lr(kLr * optim::cosine_with_warmup_factor(step, kWarmup, kSteps));
    adamw.step();
    adamw.zero_grad();
    const bool stop = fault_plan().stop_pretraining && fault_plan().stop_pretraining(step + 1);  // tests only
    if ((step + 1) % 500 == 0 || stop) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("  pre-training step %lld/%lld loss %.3f (%.0f s)\n", (long long)step + 1, (long long)kSteps,
                  loss.item<double>(), s);
      std::fflush(stdout);
    }
    if (stop) break;
  }
  for (at::Tensor& p : params) p.requires_grad_(false);
  at::set_num_threads(threads);
}

// Random init -> load -> pre-train -> save, into `dir` (a fresh directory).
void build_pretrained_base(const fs::path& dir) {
  const std::string tokenizer = bundled_tokenizer_path();
  if (!fs::exists(tokenizer)) throw std::runtime_error("bundled tokenizer not found: " + tokenizer);
  const data::Tokenizer tok = data::Tokenizer::open(tokenizer);
  write_random_tiny_base(dir.string(), tokenizer, tok.vocab_size());
  const models::DecoderModel m = models::load_decoder(dir.string(), models::DecoderLoadOptions{});
  pretrain(m, tok);
  std::vector<std::pair<std::string, at::Tensor>> trained;
  for (const auto& [name, t] : model_tensors(m)) trained.push_back({name, t.detach().to(at::kBFloat16)});
  write_base(dir, trained, tok.vocab_size(), tokenizer);
}

// Puts the finished `tmp` at `dir` durably, as the checkpoint and export commits do.
void commit_dir(const fs::path& tmp, const fs::path& dir) {
  io::fsync_path(tmp.string());
  checkpoint::commit_directory(tmp.string(), dir.string());
}

// An exclusive flock held for the object's life; another process pre-training waits here.
class DirLock {
 public:
  explicit DirLock(const std::string& path) : fd_(::open(path.c_str(), O_RDWR | O_CREAT, 0644)) {
    if (fd_ < 0 || ::flock(fd_, LOCK_EX) != 0) throw std::runtime_error("cannot lock " + path);
  }
  ~DirLock() { ::close(fd_); }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_;
};

// The pre-trained base shipped in the repository (src/qlora/train/tiny_base_v<kBaseVersion>/, made by
// scripts/make_tiny_base.sh), so that pre-training happens once per repository, not per machine.
// QLORA_NO_SHIPPED_BASE=1 ignores it (that script, to pre-train anew).
fs::path shipped_base() {
  if (const char* e = std::getenv("QLORA_NO_SHIPPED_BASE"); e && *e && std::string(e) != "0") return {};
  const fs::path dir = fs::path(QLORA_SOURCE_DIR) / "src/qlora/train" / ("tiny_base_v" + std::to_string(kBaseVersion));
  return is_complete(dir) ? dir : fs::path{};
}

// The pre-trained base: the shipped one, else (a binary away from its source tree, or
// QLORA_NO_SHIPPED_BASE) the per-machine cache, made first if missing. The shipped one comes first
// so that every machine fine-tunes the same bits, not a base its own CPU pre-trained earlier.
fs::path pretrained_base() {
  if (fs::path shipped = shipped_base(); !shipped.empty()) return shipped;
  const fs::path cache = tiny_base_cache_dir();
  if (is_complete(cache)) return cache;
  fs::create_directories(cache.parent_path());
  DirLock lock(cache.string() + ".lock");
  if (is_complete(cache)) return cache;  // another process made it while we waited
  std::printf("pre-training the tiny default base once (a few minutes on 2 cores), cached in %s\n",
              cache.c_str());
  std::fflush(stdout);
  const fs::path tmp = cache.string() + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  build_pretrained_base(tmp);
  commit_dir(tmp, cache);
  return cache;
}

}  // namespace

std::string bundled_data_dir() {
  if (const char* d = std::getenv("QLORA_DATA_DIR")) return d;
  return QLORA_SOURCE_DIR "/tests/data";
}

std::string bundled_train_path() { return bundled_data_dir() + "/tiny_tasks.jsonl"; }
std::string bundled_val_path() { return bundled_data_dir() + "/tiny_tasks_heldout.jsonl"; }
std::string bundled_tokenizer_path() { return bundled_data_dir() + "/tokenizer_chars/tokenizer.model"; }

void write_random_tiny_base(const std::string& dir, const std::string& tokenizer, int64_t vocab) {
  write_base(dir, random_tensors(vocab), vocab, tokenizer);
}

std::string tiny_base_cache_dir() {
  fs::path root;
  if (const char* d = std::getenv("QLORA_CACHE_DIR"); d && *d) root = d;
  else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) root = fs::path(x) / "qlora";
  else if (const char* h = std::getenv("HOME"); h && *h) root = fs::path(h) / ".cache" / "qlora";
  else throw std::runtime_error("no cache directory for the tiny default base: set QLORA_CACHE_DIR or HOME");
  return (root / ("tiny_base_v" + std::to_string(kBaseVersion))).string();
}

std::string ensure_tiny_base(const std::string& dir) {
  if (is_complete(dir)) return dir;
  const fs::path cache = pretrained_base();
  const fs::path tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.model"}) {
    fs::copy_file(cache / f, tmp / f);
    io::fsync_path((tmp / f).string());
  }
  commit_dir(tmp, dir);
  return dir;
}

}  // namespace qlora::train
