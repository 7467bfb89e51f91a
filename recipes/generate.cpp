// `qlora generate`: text from an exported epoch directory (a merged HF model: config.json,
// model.safetensors and the tokenizer.model copied beside it). Loads the base with no adapters
// (export merged them), tokenizes the prompt with BOS, decodes with the KV cache and prints the
// continuation on stdout; timing goes to stderr so stdout is the text alone.
//
//   qlora generate --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
//                  [--top-p P] [--seed S] [--nf4] [--device auto|cpu|cuda[:N]]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/data/tokenizer.h"
#include "qlora/models/generate.h"
#include "qlora/models/llama.h"
#include "qlora/train/device.h"

namespace qlora::recipes {

namespace {

[[noreturn]] void generate_usage_error(const std::string& what) {
  throw std::invalid_argument(what +
                              "\nusage: qlora generate --checkpoint DIR --prompt TEXT [--max-new-tokens N]"
                              " [--temperature T] [--top-p P] [--seed S] [--nf4] [--device auto|cpu|cuda[:N]]");
}

// std::stoll/stod accept trailing junk ("12abc"); a CLI number should be all number.
template <typename T, typename F>
T parse_number(const std::string& flag, const std::string& s, F parse) {
  size_t used = 0;
  T v{};
  try {
    v = parse(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != s.size()) generate_usage_error(flag + " expects a number, got '" + s + "'");
  return v;
}

}  // namespace

int generate_main(const std::vector<std::string>& args) {
  namespace fs = std::filesystem;
  std::string dir, prompt, device_name = "auto";
  bool have_prompt = false, nf4 = false;
  models::GenerateOptions opt;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) generate_usage_error(a + " needs a value");
      return args[++i];
    };
    if (a == "--checkpoint") dir = value();
    else if (a == "--prompt") { prompt = value(); have_prompt = true; }
    else if (a == "--max-new-tokens")
      opt.max_new_tokens = parse_number<long long>(a, value(), [](const std::string& s, size_t* n) { return std::stoll(s, n); });
    else if (a == "--temperature")
      opt.temperature = parse_number<double>(a, value(), [](const std::string& s, size_t* n) { return std::stod(s, n); });
    else if (a == "--top-p")
      opt.top_p = parse_number<double>(a, value(), [](const std::string& s, size_t* n) { return std::stod(s, n); });
    else if (a == "--seed")
      opt.seed = parse_number<unsigned long long>(a, value(), [](const std::string& s, size_t* n) { return std::stoull(s, n); });
    else if (a == "--nf4") nf4 = true;
    else if (a == "--device") device_name = value();
    else generate_usage_error("unknown option '" + a + "'");
  }
  if (dir.empty()) generate_usage_error("--checkpoint DIR is required");
  if (!have_prompt) generate_usage_error("--prompt TEXT is required");
  if (opt.max_new_tokens < 0) generate_usage_error("--max-new-tokens must be >= 0");
  if (opt.temperature < 0) generate_usage_error("--temperature must be >= 0");
  if (!(opt.top_p > 0 && opt.top_p <= 1)) generate_usage_error("--top-p must be in (0, 1]");

  if (!fs::is_directory(dir)) {
    throw std::invalid_argument("--checkpoint " + dir + ": no such directory (expected an exported epoch dir)");
  }
  if (!fs::is_regular_file(fs::path(dir) / "config.json")) {
    throw std::invalid_argument("--checkpoint " + dir + ": no config.json (expected an exported HF model dir)");
  }
  // tokenizer.model, original/tokenizer.model or tokenizer.json, as a run picks them; errors name
  // what was looked for (an export copies the run's tokenizer beside the model).
  const std::string tok_path = data::Tokenizer::find_file(dir);
  const data::Tokenizer tok = data::Tokenizer::open(tok_path);

  const auto t0 = std::chrono::steady_clock::now();
  models::LlamaLoadOptions lo;
  lo.base_in_nf4 = nf4;  // no lora_targets: an exported model has its adapters merged
  lo.device = train::resolve_device(device_name, "--device");
  const models::LlamaModel model = models::load_llama(dir, lo);
  if (tok.vocab_size() > model.config.vocab_size) {
    throw std::invalid_argument(tok_path + ": tokenizer has " + std::to_string(tok.vocab_size()) +
                                " pieces but " + dir + "/config.json says vocab_size " +
                                std::to_string(model.config.vocab_size));
  }

  const std::vector<int64_t> ids = tok.encode_with_special(prompt, /*add_bos=*/true, /*add_eos=*/false);
  // Stop at the tokenizer's EOS and at any the config lists (Llama-3 has several), and at the end
  // of a Llama-3 chat turn, as Meta's generation does.
  if (tok.eos_id() >= 0) opt.stop_ids.push_back(tok.eos_id());
  if (tok.eot_id() >= 0) opt.stop_ids.push_back(tok.eot_id());
  for (const int64_t e : model.config.eos_token_ids) opt.stop_ids.push_back(e);

  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int64_t> out = models::generate(model, ids, opt);
  const auto t2 = std::chrono::steady_clock::now();
  // A model whose vocab is padded past the tokenizer's may emit ids the tokenizer cannot decode.
  for (const int64_t t : out) {
    if (t >= tok.vocab_size()) {
      throw std::runtime_error("generated id " + std::to_string(t) + " is outside the tokenizer's " +
                               std::to_string(tok.vocab_size()) + " pieces (" + tok_path + ")");
    }
  }
  // The stop id ends the text rather than belonging to it: sentencepiece decodes EOS to nothing,
  // but a tiktoken model would print "<|eot_id|>".
  std::vector<int64_t> text_ids = out;
  if (!text_ids.empty() &&
      std::find(opt.stop_ids.begin(), opt.stop_ids.end(), text_ids.back()) != opt.stop_ids.end()) {
    text_ids.pop_back();
  }
  std::printf("%s\n", tok.decode(text_ids).c_str());
  const double load_s = std::chrono::duration<double>(t1 - t0).count();
  const double gen_s = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "qlora generate: %zu prompt tokens, %zu new tokens in %.2f s (%.1f tok/s), load %.2f s\n",
               ids.size(), out.size(), gen_s, gen_s > 0 ? out.size() / gen_s : 0.0, load_s);
  return 0;
}

}  // namespace qlora::recipes
