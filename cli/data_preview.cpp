// `qlora data`: what a lora_finetune config's training sees of its data, before any model is
// loaded (only the tokenizer and the data files are read): the first N samples as rendered, the
// trained text marked apart from the masked text, each with its token counts; then for the
// training set (and the validation file or split, where the config has one) the samples, tokens,
// trained tokens, how many samples truncation cut and how many have no trained token left, the
// packing efficiency and a histogram of sample lengths. For preference pairs (data.format =
// "preference", lora_dpo): the first N pairs as prompt, chosen and rejected response, and per set the
// pairs, their prompt and response tokens, and how many truncation cut (the rule stated). For GRPO's
// prompts (data.format = "prompt", lora_grpo): the rewards configured, the first N prompts as the
// model reads them with the fields the rewards read, and the prompts' token counts; every record is
// checked against the rewards (an answer reward's field).
//
//   qlora data [--config FILE] [section.key=value ...] [-n N | --samples N]
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/config/builders.h"
#include "qlora/data/dataset.h"
#include "qlora/data/preference.h"
#include "qlora/data/prompts.h"
#include "qlora/data/split.h"
#include "qlora/data/stats.h"
#include "qlora/data/tokenizer.h"
#include "qlora/train/tiny_default.h"
#include "cli/cli.h"

namespace qlora::cli {
namespace {

// Plain-text markers (wdiff's), kept when colour is on so that copied output keeps its meaning.
struct Marker {
  const char* open;
  const char* close;
};
constexpr Marker kMasked{"[-", "-]"}, kTrained{"{+", "+}"};
constexpr int kHistogramWidth = 40;  // characters of the longest bar
constexpr size_t kUntrainedShown = 5;

struct PreviewArgs {
  ConfigArgs config;
  int64_t samples = 3;
};

// The embedded default's tokenizer lives in the tiny base its first run writes (a copy of the
// bundled one): before that run, the bundled file itself, so that nothing has to be written here.
std::string preview_tokenizer(const config::RecipeConfig& cfg) {
  const std::string base = base_model_dir(cfg);
  if (cfg.model.checkpoint_dir.empty() && cfg.model.tokenizer.empty() && !std::filesystem::exists(base))
    return train::bundled_tokenizer_path();
  return find_tokenizer(cfg, base);
}

// A data set as the preview reports it: each sample with the file and line it came from.
struct DataSet {
  std::string title, path;
  std::vector<std::string> origins;
  std::vector<data::Sample> samples;

  DataSet subset(const std::string& name, const std::vector<int64_t>& picked) const {
    DataSet d{name, path, {}, {}};
    for (const int64_t i : picked) {
      d.origins.push_back(origins[static_cast<size_t>(i)]);
      d.samples.push_back(samples[static_cast<size_t>(i)]);
    }
    return d;
  }
};

DataSet load_set(const std::string& title, const std::string& path, const data::Tokenizer& tok,
                 const data::DatasetOptions& options) {
  const auto records = data::read_records(path, options);
  DataSet d{title, path, {}, data::tokenize_records(records, tok, options)};
  for (const auto& r : records) d.origins.push_back(r.origin);
  return d;
}

// ---------------------------------------------------------------- one sample

struct Run {
  bool trained = false;
  std::string text;
};

// The sample as runs of masked and trained text. A token is trained when it is a target after
// collate's shift (stats.h). Each stretch's text is what it adds to the decoded prefix, so
// sentencepiece's word-initial spaces stay where they are; BOS/EOS, which sentencepiece decodes to
// nothing, show as their pieces.
std::vector<Run> sample_runs(const data::Sample& s, const data::Tokenizer& tok) {
  const auto trained_at = [&](size_t i) { return i > 0 && s.labels[i] != data::kIgnoreIndex; };
  const auto special = [&](size_t i) { return s.tokens[i] == tok.bos_id() || s.tokens[i] == tok.eos_id(); };
  std::vector<Run> runs;
  std::string before;  // the text of tokens [0, start)
  for (size_t start = 0; start < s.tokens.size();) {
    size_t end = start + 1;
    if (!special(start))
      while (end < s.tokens.size() && !special(end) && trained_at(end) == trained_at(start)) ++end;
    const auto at = [&](size_t k) { return s.tokens.begin() + static_cast<std::ptrdiff_t>(k); };
    std::string upto = tok.decode(std::vector<int64_t>(at(0), at(end)));
    // A stretch ending inside a multi-byte character decodes to U+FFFD: then the stretch alone.
    std::string text = upto.compare(0, before.size(), before) == 0 ? upto.substr(before.size())
                                                                   : tok.decode(std::vector<int64_t>(at(start), at(end)));
    if (text.empty() && special(start)) text = tok.id_to_piece(s.tokens[start]);
    if (runs.empty() || runs.back().trained != trained_at(start)) runs.push_back(Run{trained_at(start), ""});
    runs.back().text += text;
    before = std::move(upto);
    start = end;
  }
  return runs;
}

// `text` with each run of `token` shown once with its count ("<|image_pad|> x 64"): an image's tokens.
std::string collapse_runs(const std::string& text, const std::string& token) {
  if (token.empty()) return text;
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = text.find(token, at)) != std::string::npos;) {
    out += text.substr(at, hit - at);
    size_t n = 0;
    for (at = hit; text.compare(at, token.size(), token) == 0; at += token.size()) ++n;
    out += token + (n > 1 ? " x " + std::to_string(n) : "");
  }
  return out + text.substr(at);
}

int64_t image_tokens(const data::Sample& s) {
  int64_t n = 0;
  for (const data::SampleImage& img : s.images) n += img.num_image_tokens;
  return n;
}

void print_images(const data::Sample& s) {
  for (size_t k = 0; k < s.images.size(); ++k) {
    const data::SampleImage& img = s.images[k];
    std::string grid;
    if (img.grid.defined() && img.grid.dim() == 1)
      for (int64_t g = 0; g < img.grid.size(0); ++g) grid += (grid.empty() ? "grid " : " x ") + std::to_string(img.grid[g].item<int64_t>());
    std::printf("  image %zu: %s: %lld image tokens%s\n", k + 1, img.source.name.c_str(),
                static_cast<long long>(img.num_image_tokens), grid.empty() ? "" : (" (" + grid + " patches)").c_str());
  }
}

void print_sample(const DataSet& d, size_t i, const data::Tokenizer& tok, bool color, const std::string& image_token) {
  const auto& s = d.samples[i];
  std::printf("--- sample %zu/%zu (%s): %zu tokens, %lld trained%s%s\n", i + 1, d.samples.size(), d.origins[i].c_str(),
              s.tokens.size(), static_cast<long long>(data::trained_token_count(s)),
              s.images.empty() ? "" : (", " + std::to_string(image_tokens(s)) + " of them image tokens").c_str(),
              s.truncated ? ", truncated to data.max_seq_len" : "");
  print_images(s);
  for (const auto& run : sample_runs(s, tok)) {
    if (color) std::fputs(run.trained ? "\033[1;32m" : "\033[2m", stdout);
    const Marker& m = run.trained ? kTrained : kMasked;
    std::printf("%s%s%s", m.open, collapse_runs(run.text, image_token).c_str(), m.close);
    if (color) std::fputs("\033[0m", stdout);
  }
  std::fputs("\n\n", stdout);
}

// ---------------------------------------------------------------- a data set's figures

void print_histogram(const std::vector<data::LengthBin>& bins) {
  int64_t most = 1;
  for (const auto& b : bins) most = std::max(most, b.count);
  std::printf("  length histogram (tokens per sample: samples)\n");
  for (const auto& b : bins) {
    const int64_t bar = b.count == 0 ? 0 : std::max<int64_t>(1, b.count * kHistogramWidth / most);
    const std::string range = b.lo == b.hi ? std::to_string(b.lo) : std::to_string(b.lo) + "-" + std::to_string(b.hi);
    std::printf("    %11s | %-*s %lld\n", range.c_str(), kHistogramWidth, std::string(static_cast<size_t>(bar), '#').c_str(),
                static_cast<long long>(b.count));
  }
}

void print_stats(const DataSet& d, const config::DataConfig& cfg, const data::Tokenizer& tok) {
  const data::DatasetStats st = data::dataset_stats(d.samples, cfg.packing ? cfg.max_seq_len : 0);
  const auto pct = [](int64_t part, int64_t whole) { return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0; };
  std::printf("%s: %s\n", d.title.c_str(), d.path.c_str());
  std::printf("  samples           %lld\n", static_cast<long long>(st.samples));
  std::printf("  tokens            %lld (per sample: min %lld, mean %.1f, max %lld)\n", static_cast<long long>(st.tokens),
              static_cast<long long>(st.min_tokens), st.samples ? static_cast<double>(st.tokens) / static_cast<double>(st.samples) : 0.0,
              static_cast<long long>(st.max_tokens));
  std::printf("  trained tokens    %lld (%.1f%% of tokens)\n", static_cast<long long>(st.trained_tokens), pct(st.trained_tokens, st.tokens));
  int64_t images = 0, image_toks = 0;
  for (const data::Sample& s : d.samples) images += static_cast<int64_t>(s.images.size()), image_toks += image_tokens(s);
  if (images > 0)
    std::printf("  image tokens      %lld in %lld images (%.1f%% of tokens; text tokens %lld); packing and "
                "data.max_seq_len count them\n", static_cast<long long>(image_toks), static_cast<long long>(images),
                pct(image_toks, st.tokens), static_cast<long long>(st.tokens - image_toks));
  std::printf("  truncated         %lld (longer than data.max_seq_len = %lld, cut to it)\n", static_cast<long long>(st.truncated),
              static_cast<long long>(cfg.max_seq_len));
  if (const int64_t eos = tok.eos_id(); eos >= 0)
    std::printf("  trained EOS       %lld of %lld samples end with a trained EOS (id %lld)%s\n",
                static_cast<long long>(data::samples_ending_trained(d.samples, eos)), static_cast<long long>(st.samples),
                static_cast<long long>(eos),
                tok.pad_id() == eos ? "; the pad token is the EOS: padding is never trained, this EOS is" : "");
  std::printf("  no trained token  %lld (these train on nothing)\n", static_cast<long long>(st.untrained.size()));
  for (size_t k = 0; k < std::min(st.untrained.size(), kUntrainedShown); ++k)
    std::printf("    %s\n", d.origins[static_cast<size_t>(st.untrained[k])].c_str());
  if (st.untrained.size() > kUntrainedShown) std::printf("    ...\n");
  if (cfg.packing)
    std::printf("  packing           %lld rows of %lld tokens, %.1f%% real tokens (the rest padding)\n",
                static_cast<long long>(st.packed_rows), static_cast<long long>(cfg.max_seq_len), 100.0 * st.packing_efficiency);
  else
    std::printf("  packing           off (data.packing = false)\n");
  print_histogram(st.histogram);
  std::printf("\n");
}

// ---------------------------------------------------------------- preference pairs

void print_runs(const char* label, const std::vector<Run>& runs, size_t first, bool color) {
  std::printf("%-9s ", label);
  for (size_t k = first; k < runs.size(); ++k) {
    if (color) std::fputs(runs[k].trained ? "\033[1;32m" : "\033[2m", stdout);
    const Marker& m = runs[k].trained ? kTrained : kMasked;
    std::printf("%s%s%s", m.open, runs[k].text.c_str(), m.close);
    if (color) std::fputs("\033[0m", stdout);
  }
  std::fputs("\n", stdout);
}

// The prompt once (the chosen row's leading masked text), then each response's scored text.
void print_pair(const std::vector<data::PreferencePair>& pairs, size_t i, const data::Tokenizer& tok, bool color) {
  const data::PreferencePair& p = pairs[i];
  std::printf("--- pair %zu/%zu (%s): prompt %lld tokens%s; chosen %lld, rejected %lld scored tokens%s\n", i + 1,
              pairs.size(), p.origin.c_str(), static_cast<long long>(p.prompt_tokens),
              p.prompt_truncated ? " (its start cut)" : "", static_cast<long long>(data::trained_token_count(p.chosen)),
              static_cast<long long>(data::trained_token_count(p.rejected)), p.response_truncated ? ", responses cut" : "");
  const std::vector<Run> chosen = sample_runs(p.chosen, tok), rejected = sample_runs(p.rejected, tok);
  const auto prompt_runs = [](const std::vector<Run>& r) { return !r.empty() && !r[0].trained ? size_t{1} : size_t{0}; };
  if (prompt_runs(chosen)) print_runs("prompt", {chosen[0]}, 0, color);
  print_runs("chosen", chosen, prompt_runs(chosen), color);
  print_runs("rejected", rejected, prompt_runs(rejected), color);
  std::fputs("\n", stdout);
}

void print_pair_stats(const std::string& title, const std::string& path, const std::vector<data::PreferencePair>& pairs) {
  int64_t prompt = 0, chosen = 0, rejected = 0, prompt_cut = 0, response_cut = 0;
  for (const data::PreferencePair& p : pairs) {
    prompt += p.prompt_tokens;
    chosen += data::trained_token_count(p.chosen);
    rejected += data::trained_token_count(p.rejected);
    prompt_cut += p.prompt_truncated;
    response_cut += p.response_truncated;
  }
  const double n = std::max<double>(1.0, static_cast<double>(pairs.size()));
  std::printf("%s: %s\n", title.c_str(), path.c_str());
  std::printf("  pairs             %zu\n", pairs.size());
  std::printf("  prompt tokens     %lld (mean %.1f per pair)\n", static_cast<long long>(prompt), static_cast<double>(prompt) / n);
  std::printf("  scored tokens     chosen %lld (mean %.1f), rejected %lld (mean %.1f)\n", static_cast<long long>(chosen),
              static_cast<double>(chosen) / n, static_cast<long long>(rejected), static_cast<double>(rejected) / n);
  std::printf("  truncated         %lld prompts cut at their start, %lld pairs' responses cut at their end\n\n",
              static_cast<long long>(prompt_cut), static_cast<long long>(response_cut));
}

// lora_dpo's data: pairs, previewed and counted per set (train, and the validation file or split).
void preview_pairs(const config::RecipeConfig& cfg, const data::Tokenizer& tok, const data::DatasetOptions& options,
                   int64_t samples, bool color) {
  const data::PreferenceOptions limits = config::preference_options(cfg);
  std::printf("truncation: a pair longer than data.max_seq_len = %lld keeps the prompt's last %lld tokens "
              "(dpo.max_prompt_len) and cuts the responses' ends; only the responses are scored\n\n",
              static_cast<long long>(limits.max_seq_len), static_cast<long long>(limits.max_prompt_len));
  std::vector<data::PreferencePair> train = data::load_preference_pairs(train_data_path(cfg), tok, options, limits);
  std::printf("%s prompt (context, not scored) %s  %s scored response %s\n\n", kMasked.open, kMasked.close,
              kTrained.open, kTrained.close);
  for (size_t i = 0; i < std::min(train.size(), static_cast<size_t>(samples)); ++i) print_pair(train, i, tok, color);
  if (const std::string val = val_data_path(cfg); !val.empty()) {
    print_pair_stats("train", train_data_path(cfg), train);
    print_pair_stats("validation", val, data::load_preference_pairs(val, tok, options, limits));
  } else if (cfg.data.val_fraction > 0) {
    const auto split = data::split_validation(static_cast<int64_t>(train.size()), cfg.data.val_fraction,
                                              static_cast<uint64_t>(cfg.training.seed));
    const auto subset = [&](const std::vector<int64_t>& picked) {
      std::vector<data::PreferencePair> out;
      for (int64_t i : picked) out.push_back(train[static_cast<size_t>(i)]);
      return out;
    };
    print_pair_stats("train (data.val_fraction held out)", train_data_path(cfg), subset(split.train));
    print_pair_stats("validation (data.val_fraction, training.seed)", train_data_path(cfg), subset(split.val));
  } else {
    print_pair_stats("train", train_data_path(cfg), train);
  }
}

// ---------------------------------------------------------------- GRPO prompts

std::string rewards_line(const config::GrpoConfig& grpo) {
  const std::vector<std::string> names = config::grpo_rewards(grpo).names();
  std::string out;
  char weight[32];
  for (size_t k = 0; k < names.size(); ++k) {
    const double w = k < grpo.rewards.size() ? grpo.rewards[k].weight : grpo.reward_command_weight;
    std::snprintf(weight, sizeof weight, "%g", w);
    out += (out.empty() ? "" : " + ") + std::string(weight) + " x " + names[k];
  }
  if (!grpo.reward_command.empty()) out += " (command: " + grpo.reward_command + ")";
  return out.empty() ? "none set (grpo.rewards, grpo.reward_command)" : out;
}

void print_prompt(const data::PromptRecord& p, size_t i, size_t n, bool color) {
  std::printf("--- prompt %zu/%zu (%s): %zu tokens\n", i + 1, n, p.origin.c_str(), p.tokens.size());
  if (color) std::fputs("\033[2m", stdout);
  std::printf("%s%s%s", kMasked.open, p.text.c_str(), kMasked.close);
  if (color) std::fputs("\033[0m", stdout);
  nlohmann::json fields = p.record;
  fields.erase("prompt");
  std::string text = fields.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 200) text = text.substr(0, 200) + "...";
  std::printf("\nfields    %s\n\n", text.c_str());
}

// lora_grpo's data: prompts the policy completes, checked against the rewards that score them.
void preview_prompts(const config::RecipeConfig& cfg, const data::Tokenizer& tok, const data::DatasetOptions& options,
                     int64_t samples, bool color) {
  std::printf("rewards: %s\n\n", rewards_line(cfg.grpo).c_str());
  const train::Rewards rewards = config::grpo_rewards(cfg.grpo);
  const std::string path = train_data_path(cfg);
  const std::vector<data::PromptRecord> prompts = load_grpo_prompts(path, tok, options, rewards);
  int64_t tokens = 0, longest = 0, shortest = INT64_MAX;
  for (const data::PromptRecord& p : prompts) {
    const auto n = static_cast<int64_t>(p.tokens.size());
    tokens += n, longest = std::max(longest, n), shortest = std::min(shortest, n);
  }
  std::printf("%s prompt, as the model reads it %s\n\n", kMasked.open, kMasked.close);
  for (size_t i = 0; i < std::min(prompts.size(), static_cast<size_t>(samples)); ++i)
    print_prompt(prompts[i], i, prompts.size(), color);
  std::printf("train: %s\n", path.c_str());
  std::printf("  prompts           %zu\n", prompts.size());
  std::printf("  prompt tokens     %lld (per prompt: min %lld, mean %.1f, max %lld)\n", static_cast<long long>(tokens),
              static_cast<long long>(shortest), static_cast<double>(tokens) / static_cast<double>(prompts.size()),
              static_cast<long long>(longest));
  std::printf("  completion room   %lld tokens for the longest prompt (data.max_seq_len = %lld); completions "
              "take up to grpo.max_completion_length = %lld\n\n",
              static_cast<long long>(cfg.data.max_seq_len - longest), static_cast<long long>(cfg.data.max_seq_len),
              static_cast<long long>(cfg.grpo.max_completion_length));
}

int preview(const PreviewArgs& a) {
  const config::RecipeConfig cfg = load_recipe_config(a.config);
  const std::string tokenizer_path = preview_tokenizer(cfg);
  const data::Tokenizer tok = data::Tokenizer::open(tokenizer_path);
  std::string note;
  const data::DatasetOptions options = config::dataset_options(cfg.data, tok, &note);
  if (!note.empty()) std::printf("%s\n", note.c_str());
  std::printf("data.format = \"%s\"", data::dataset_kind_name(options.kind));
  if (options.kind != data::DatasetKind::kText)
    std::printf(", data.template = \"%s\"", std::string(data::template_name(options.prompt_template)).c_str());
  std::printf("; tokenizer %s\n\n", tokenizer_path.c_str());

  const bool color = isatty(fileno(stdout)) && std::getenv("NO_COLOR") == nullptr;
  if (options.kind == data::DatasetKind::kPreference || options.kind == data::DatasetKind::kPrompt) {
    if (options.kind == data::DatasetKind::kPreference) preview_pairs(cfg, tok, options, a.samples, color);
    else preview_prompts(cfg, tok, options, a.samples, color);
    std::printf("no model loaded: qlora data reads only the tokenizer and the data\n");
    return 0;
  }
  DataSet train = load_set("train", train_data_path(cfg), tok, options);
  std::printf("%s masked (not trained) %s  %s trained %s\n\n", kMasked.open, kMasked.close, kTrained.open, kTrained.close);
  const std::string image_token = options.image_processor ? options.image_processor->rules().image_token : "";
  for (size_t i = 0; i < std::min(train.samples.size(), static_cast<size_t>(a.samples)); ++i)
    print_sample(train, i, tok, color, image_token);

  std::vector<DataSet> sets;
  if (const std::string val = val_data_path(cfg); !val.empty()) {
    sets.push_back(std::move(train));
    sets.push_back(load_set(cfg.data.val_path.empty() ? "validation (the bundled held-out file)" : "validation (data.val_path)",
                            val, tok, options));
  } else if (cfg.data.val_fraction > 0) {
    const auto split = data::split_validation(static_cast<int64_t>(train.samples.size()), cfg.data.val_fraction,
                                              static_cast<uint64_t>(cfg.training.seed));
    sets.push_back(train.subset("train (data.val_fraction held out)", split.train));
    sets.push_back(train.subset("validation (data.val_fraction, training.seed)", split.val));
  } else {
    sets.push_back(std::move(train));
  }
  for (const auto& d : sets) print_stats(d, cfg.data, tok);
  std::printf("no model loaded: qlora data reads only the tokenizer and the data\n");
  return 0;
}

}  // namespace

Command data_command(CLI::App& cmd) {
  auto a = std::make_shared<PreviewArgs>();
  add_config_args(cmd, a->config);
  cmd.add_option("-n,--samples", a->samples, "the first N samples to show")->type_name("N")->check(kNotNegative);
  return [a] { return preview(*a); };
}

}  // namespace qlora::cli
