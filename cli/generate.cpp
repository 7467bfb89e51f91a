// `qlora generate`: text from an exported epoch directory (a merged HF model: config.json,
// model.safetensors and the tokenizer.model copied beside it). Loads the base with no adapters
// (export merged them), tokenizes the prompt with BOS, decodes with the KV cache and prints the
// continuation on stdout; timing goes to stderr so stdout is the text alone.
//
//   qlora generate --checkpoint DIR (--prompt TEXT | --instruction TEXT [--input TEXT] |
//                  [--system TEXT] --message TEXT [--message TEXT ...]) [--print-prompt]
//                  [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--nf4]
//                  [--device auto|cpu|cuda[:N]]
//
// --prompt is fed as it is, with BOS where the tokenizer adds one (Tokenizer::adds_bos).
// --instruction/--input and --message render the prompt with the template the run trained with,
// as the export's qlora.json records it: the model's own chat template (recorded text and
// keyword arguments; --template-kwargs JSON overrides them) with add_generation_prompt, tokenized
// as apply_chat_template does, or a hand-written kind (data/templates.h: the prompt segments of
// the record with an empty answer, i.e. up to the opened answer turn), tokenized as the dataset
// did. A directory without qlora.json (a model that was never fine-tuned) uses the chat template
// it ships. --message alternates user, assistant, user, ...; the last is
// the user turn to answer. --print-prompt prints {"text", "ids"} of the prompt and stops.
// --image PATH (repeatable, with --message and the model's own chat template): the images go into the
// last user turn before its text, through the export's image processor (preprocessor_config.json beside
// it) and its vision tower (a vision-language model's export keeps it), their features at the image
// tokens as in training.
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/checkpoint/export.h"
#include "qlora/checkpoint/serving.h"
#include "qlora/data/chat_template.h"
#include "qlora/data/dataset.h"
#include "qlora/data/templates.h"
#include "qlora/data/sample_images.h"
#include "qlora/data/tokenizer.h"
#include "qlora/images/decode.h"
#include "qlora/models/generate.h"
#include "qlora/models/decoder.h"
#include "qlora/train/device.h"
#include "cli/cli.h"

namespace qlora::cli {

namespace {

// What the command line asks to feed the model: a raw prompt, or a record for the recorded template.
struct PromptRequest {
  std::optional<std::string> raw;                       // --prompt
  std::optional<std::string> instruction, input;        // --instruction, --input
  std::optional<std::string> system;                    // --system
  std::vector<std::string> messages;                    // --message, alternating user / assistant
  std::vector<std::string> images;                      // --image, into the last user turn
  bool templated() const { return instruction || input || system || !messages.empty(); }
};

void check_request(const PromptRequest& r) {
  if (r.raw && r.templated())
    throw UsageError("--prompt is fed as it is; it does not combine with --instruction, --input, --system or "
                                "--message, which render the run's template");
  if (!r.raw && !r.templated()) throw UsageError("give --prompt TEXT, --instruction TEXT or --message TEXT");
  if (!r.images.empty() && r.messages.empty())
    throw UsageError("--image goes into a conversation's last user turn: give --message TEXT");
  if (r.input && !r.instruction) throw UsageError("--input needs --instruction");
  if (r.instruction && (r.system || !r.messages.empty()))
    throw UsageError("--instruction renders an instruct record; --system and --message render a conversation: "
                                "give one or the other");
  if (r.system && r.messages.empty()) throw UsageError("--system needs --message");
  if (!r.messages.empty() && r.messages.size() % 2 == 0)
    throw UsageError("--message alternates user, assistant, user, ...: give an odd number, the last being the "
                                "user turn the model answers (got " + std::to_string(r.messages.size()) + ")");
}

// The template the export recorded; errors say why it cannot render (none recorded, plain text).
data::TemplateKind recorded_template(const std::string& dir, const std::optional<checkpoint::PromptFormat>& pf) {
  const std::string file = (std::filesystem::path(dir) / "qlora.json").string();
  if (!pf)
    throw std::invalid_argument("--checkpoint " + dir + " has no qlora.json, so the template it was trained with is "
                                "unknown (an export of an earlier qlora release?): give the whole prompt with --prompt");
  if (pf->template_name.empty())
    throw std::invalid_argument(file + ": the run trained on data.format = \"" + pf->format +
                                "\" without a template: give the text with --prompt");
  try {
    return data::template_kind_from_name(pf->template_name);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(file + ": prompt.template: " + e.what());
  }
}

// The record rendered by the template up to the opened answer turn, and the template's end of turn.
std::pair<std::vector<data::Segment>, std::string> render_prompt(data::TemplateKind kind, const PromptRequest& r) {
  const std::string stand_in(data::kAnswerStandIn);
  if (r.instruction) return data::cut_at_answer(data::render_instruct(kind, {*r.instruction, r.input.value_or(""), stand_in}));
  if (kind == data::TemplateKind::kAlpaca && (r.system || r.messages.size() > 1))
    throw UsageError("the alpaca template renders one instruction: give one --message (no --system and "
                                "no earlier turns), or --instruction [--input]");
  if (r.system && kind == data::TemplateKind::kMistralV03)
    throw UsageError("--system: the run's template mistral-v0.3 drops system messages from what it trains "
                                "on (as Mistral's own template does), so the model never saw one");
  std::vector<data::Message> m;
  if (r.system) m.push_back({"system", *r.system});
  for (size_t k = 0; k < r.messages.size(); ++k) m.push_back({k % 2 == 0 ? "user" : "assistant", r.messages[k]});
  m.push_back({"assistant", stand_in});
  return data::cut_at_answer(data::render_chat(kind, m));
}

// The model's own template: the one the run recorded (template "auto"), else the one the
// directory ships (a base or instruct model that was never fine-tuned); --template-kwargs
// overrides the recorded keyword arguments key by key.
std::optional<data::ChatTemplate> model_template(const std::string& dir, const std::optional<checkpoint::PromptFormat>& pf,
                                                 const data::Tokenizer& tok, const nlohmann::ordered_json& overrides) {
  nlohmann::ordered_json kwargs = pf ? pf->template_kwargs : nlohmann::ordered_json::object();
  for (const auto& [k, v] : overrides.items()) kwargs[k] = v;
  if (pf && !pf->chat_template.empty())
    return data::ChatTemplate::from_source(pf->chat_template, dir + "/qlora.json (prompt.chat_template)", tok, kwargs);
  if (pf) return std::nullopt;
  return data::ChatTemplate::find(tok, kwargs);
}

// Surrounding ASCII whitespace off, enough for end-of-turn markers ("<|im_end|>\n").
std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

struct Prompt {
  std::string text;
  std::vector<int64_t> ids;
  std::string end_of_turn;  // the template's end of an answer ("" for --prompt): generation stops there
  std::vector<images::ProcessedImage> images;  // --image, in the order of their tokens
};

// The request as the conversation a chat template renders, up to the opened answer turn.
nlohmann::ordered_json request_messages(const PromptRequest& r) {
  std::vector<data::Message> m;
  if (r.instruction) {
    m = data::instruct_messages({*r.instruction, r.input.value_or(""), ""});
    m.pop_back();
  } else {
    if (r.system) m.push_back({"system", *r.system});
    for (size_t k = 0; k < r.messages.size(); ++k) m.push_back({k % 2 == 0 ? "user" : "assistant", r.messages[k]});
    if (!r.images.empty()) {  // the images, then the text, as parts of the last user turn
      data::Message& last = m.back();
      for (size_t k = 0; k < r.images.size(); ++k) last.parts.push_back({"", true});
      last.parts.push_back({last.content, false});
    }
  }
  return data::messages_json(m);
}

// The rendered prompt with each image's placeholder expanded by the export's image processor.
std::string with_images(const std::string& text, const std::vector<std::string>& files, const std::string& dir,
                        std::vector<images::ProcessedImage>& processed) {
  const images::ImageProcessor processor = images::processor_from_dir(dir);
  for (const std::string& f : files) processed.push_back(processor.process(images::load_image(f), f));
  return data::join_segments(data::expand_image_placeholders({data::Segment{text, true}}, processor, processed));
}

Prompt build_prompt(const PromptRequest& r, const std::string& dir, const data::Tokenizer& tok,
                    const nlohmann::ordered_json& template_kwargs) {
  // As transformers' tokenizer(prompt): BOS where the tokenizer adds one. Never EOS: a prompt
  // that ends the text would ask for nothing.
  if (r.raw) return {*r.raw, tok.encode_with_special(*r.raw, tok.adds_bos(), /*add_eos=*/false), "", {}};
  const auto pf = checkpoint::read_prompt_format(dir);
  if (const auto t = model_template(dir, pf, tok, template_kwargs)) {
    std::vector<images::ProcessedImage> processed;
    std::string text = t->render(request_messages(r), /*add_generation_prompt=*/true);
    if (!r.images.empty()) text = with_images(text, r.images, dir, processed);
    // apply_chat_template's ids; a run that forced BOS (data.add_bos = true) gets it here too.
    std::vector<int64_t> ids = tok.encode(text);
    if (pf && pf->add_bos && tok.bos_id() >= 0 && (ids.empty() || ids.front() != tok.bos_id()))
      ids.insert(ids.begin(), tok.bos_id());
    return {text, std::move(ids), t->end_of_turn(), std::move(processed)};
  }
  if (!template_kwargs.empty()) throw UsageError("--template-kwargs needs the model's own chat template");
  if (!r.images.empty()) throw UsageError("--image needs the model's own chat template (it renders the images)");
  const data::TemplateKind kind = recorded_template(dir, pf);
  std::pair<std::vector<data::Segment>, std::string> rendered;
  try {
    rendered = render_prompt(kind, r);
  } catch (const UsageError& e) {  // flags this template cannot render
    throw UsageError(dir + "/qlora.json records template '" + pf->template_name + "': " + e.what());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(dir + "/qlora.json records template '" + pf->template_name + "': " + e.what());
  }
  data::DatasetOptions o;  // tokenized as the dataset tokenized the run's samples, without the answer's EOS
  o.add_bos = pf->add_bos;
  o.add_eos = false;
  o.max_seq_len = 0;
  return {data::join_segments(rendered.first), data::tokenize_segments(rendered.first, tok, o).tokens,
          trim(rendered.second), {}};
}

struct GenerateArgs {
  std::string dir, device = "auto", template_kwargs;
  bool nf4 = false, print_prompt = false;
  models::GenerateOptions opt;
  PromptRequest prompt;
};

// What the options' own checks leave: how they combine, --top-p's open end; the --template-kwargs object.
nlohmann::ordered_json checked_template_kwargs(const GenerateArgs& g) {
  check_request(g.prompt);
  if (!(g.opt.top_p > 0 && g.opt.top_p <= 1)) throw UsageError("--top-p must be in (0, 1]");
  const auto kwargs = nlohmann::ordered_json::parse(g.template_kwargs.empty() ? "{}" : g.template_kwargs, nullptr, false);
  if (!kwargs.is_object())
    throw UsageError("--template-kwargs expects a JSON object, e.g. '{\"enable_thinking\": false}'");
  return kwargs;
}

int generate(GenerateArgs& g) {
  namespace fs = std::filesystem;
  const nlohmann::ordered_json template_kwargs = checked_template_kwargs(g);
  const std::string& dir = g.dir;
  models::GenerateOptions& opt = g.opt;

  if (!fs::is_directory(dir)) {
    throw UsageError("--checkpoint " + dir + ": no such directory (expected an exported epoch dir)");
  }
  if (!fs::is_regular_file(fs::path(dir) / "config.json")) {
    throw UsageError("--checkpoint " + dir + ": no config.json (expected an exported HF model dir)");
  }
  // tokenizer.model, original/tokenizer.model or tokenizer.json, as a run picks them; errors name
  // what was looked for (an export copies the run's tokenizer beside the model).
  const std::string tok_path = data::Tokenizer::find_file(dir);
  const data::Tokenizer tok = data::Tokenizer::open(tok_path);
  const Prompt prompt = build_prompt(g.prompt, dir, tok, template_kwargs);
  if (g.print_prompt) {
    std::printf("%s\n", nlohmann::json{{"text", prompt.text}, {"ids", prompt.ids}}.dump().c_str());
    return 0;
  }

  const auto t0 = std::chrono::steady_clock::now();
  models::DecoderLoadOptions lo;
  lo.base_in_nf4 = g.nf4;  // no lora_targets: an exported model has its adapters merged
  lo.device = train::resolve_device(g.device, "--device");
  const models::DecoderModel model = models::load_decoder(dir, lo);
  if (tok.vocab_size() > model.config.vocab_size) {
    throw std::invalid_argument(tok_path + ": tokenizer has " + std::to_string(tok.vocab_size()) +
                                " pieces but " + dir + "/config.json says vocab_size " +
                                std::to_string(model.config.vocab_size));
  }

  const std::vector<int64_t>& ids = prompt.ids;
  // Stop where the export's GGUF and Modelfile stop too (checkpoint/serving.h).
  opt.stop_ids = checkpoint::stop_ids(dir, tok, prompt.end_of_turn);

  std::optional<models::ImageInputs> images;
  if (!prompt.images.empty()) {
    models::vision::TowerLoadOptions to;
    to.base_in_nf4 = g.nf4;
    to.compute_dtype = model.compute_dtype;
    to.device = lo.device;
    const auto tower = models::vision::load_tower(dir, to);
    at::NoGradGuard no_grad;
    const at::Tensor tokens = at::tensor(ids, at::kLong).view({1, -1}).to(lo.device);
    images = models::image_inputs(*tower, prompt.images, tokens, at::arange(tokens.size(1), tokens.options()).view({1, -1}),
                                  model.config);
  }
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int64_t> out = models::generate(model, ids, opt, images ? &*images : nullptr);
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
  std::string text = tok.decode(text_ids);
  // An end of turn of several tokens cannot stop generation; the answer still ends there.
  if (!prompt.end_of_turn.empty() && text.find(prompt.end_of_turn) != std::string::npos)
    text.erase(text.find(prompt.end_of_turn));
  std::printf("%s\n", text.c_str());
  const double load_s = std::chrono::duration<double>(t1 - t0).count();
  const double gen_s = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "qlora generate: %zu prompt tokens, %zu new tokens in %.2f s (%.1f tok/s), load %.2f s\n",
               ids.size(), out.size(), gen_s, gen_s > 0 ? out.size() / gen_s : 0.0, load_s);
  return 0;
}

}  // namespace

Command generate_command(CLI::App& cmd) {
  auto g = std::make_shared<GenerateArgs>();
  const auto text = [&cmd](const char* name, std::optional<std::string>& to, const char* what) {
    cmd.add_option_function<std::string>(name, [&to](const std::string& v) { to = v; }, what)->type_name("TEXT");
  };
  cmd.add_option("--checkpoint", g->dir, "an exported epoch (out/.../epoch_N)")->type_name("DIR")->required();
  text("--prompt", g->prompt.raw, "the prompt as it is (BOS where the tokenizer adds one)");
  text("--instruction", g->prompt.instruction, "an instruct record, rendered by the run's template");
  text("--input", g->prompt.input, "the record's input (with --instruction)");
  text("--system", g->prompt.system, "the conversation's system message (with --message)");
  cmd.add_option("--message", g->prompt.messages, "a turn, alternating user, assistant, user, ...; the last is the\n"
                                                  "user turn to answer")->expected(1)->take_all()->allow_extra_args(false);
  cmd.add_option("--image", g->prompt.images, "an image file for the last user turn (repeatable; a vision-language\n"
                                              "model's export)")->type_name("PATH")->expected(1)->take_all()
      ->allow_extra_args(false);
  cmd.add_flag("--print-prompt", g->print_prompt, "print {\"text\", \"ids\"} of the prompt and stop");
  cmd.add_option("--max-new-tokens", g->opt.max_new_tokens, "tokens to generate at most")->type_name("N")
      ->check(kNotNegative);
  cmd.add_option("--temperature", g->opt.temperature, "0: greedy")->type_name("T")->check(kNotNegative);
  cmd.add_option("--top-p", g->opt.top_p, "nucleus mass in (0, 1]")->type_name("P");
  cmd.add_option("--seed", g->opt.seed, "seeds the sampling")->type_name("S");
  cmd.add_flag("--nf4", g->nf4, "the base weights in NF4, as training held them");
  cmd.add_option("--device", g->device, "auto|cpu|cuda[:N]");
  cmd.add_option("--template-kwargs", g->template_kwargs, "a JSON object overriding the chat template's recorded\n"
                                                          "keyword arguments")->type_name("JSON");
  return [g] { return generate(*g); };
}

}  // namespace qlora::cli
