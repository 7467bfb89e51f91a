// Runs qlora's Tokenizer on what a conformance script asks and writes the answers as JSON, so
// the script can compare them with a Python reference (tiktoken, transformers) on texts it generates:
//
//   tokenize_tool MODEL REQUESTS.json ANSWERS.json
//
// REQUESTS: {"encode": [text, ...], "decode": [[id, ...], ...],
//            "llama3_chat": [[{"role", "content"}, ...], ...],
//            "chat": [{"template": NAME, "messages": [{"role", "content"}, ...]}
//                     or {"template": NAME, "instruct": {"instruction", "input", "output"}}, ...]}
//           (every key optional). NAME "auto": the model's own chat template beside MODEL, or
//           the request's "chat_template" text; "template_kwargs" are its keyword arguments.
// ANSWERS:  {"vocab_size", "bos_id", "eos_id", "pad_id", "eot_id", "adds_bos", "adds_eos",
//            "encode": [[id, ...], ...],
//            "decode": [text, ...], "llama3_chat": [SAMPLE, ...], "chat": [SAMPLE, ...],
//            "encode_seconds", "encode_bytes"}
// SAMPLE:   {"segments": [{"text", "prompt", "bos_before", "eos_after"}, ...], "tokens", "labels"},
//           or {"error": message} when the template refuses the record.
// A chat request is rendered with the named template (llama3_chat: llama3-chat) and tokenized as
// the dataset does by default (BOS, segments, EOS), without truncation. encode_seconds times the
// encode calls alone.
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/chat_template.h"
#include "qlora/data/dataset.h"
#include "qlora/data/templates.h"
#include "qlora/data/tokenizer.h"

namespace {

using nlohmann::json;
namespace data = qlora::data;

// The options for the request's template: a hand-written kind with BOS and EOS (what the
// conformance of those kinds pins), "auto" as a run resolves it for this tokenizer.
data::DatasetOptions request_options(const data::Tokenizer& tok, const json& request) {
  data::DatasetOptions options;
  options.max_seq_len = 0;
  options.kind = data::DatasetKind::kChat;
  options.prompt_template = data::template_kind_from_name(request.at("template").get<std::string>());
  if (options.prompt_template != data::TemplateKind::kAuto) return options;
  const auto kwargs = nlohmann::ordered_json::parse(request.value("template_kwargs", json::object()).dump());
  if (!request.contains("chat_template")) data::resolve_dataset_options(options, tok, std::nullopt, std::nullopt, kwargs);
  if (request.contains("chat_template")) {
    options.chat_template = std::make_shared<const data::ChatTemplate>(data::ChatTemplate::from_source(
        request["chat_template"].get<std::string>(), "request", tok, kwargs));
    options.add_bos = options.add_eos = false;
  }
  return options;
}

// One chat request rendered and tokenized (see SAMPLE above).
json render_sample(const data::Tokenizer& tok, const json& request) {
  std::vector<data::Segment> segments;
  data::DatasetOptions options;
  try {
    options = request_options(tok, request);
    std::vector<data::Message> messages;
    if (request.contains("instruct")) {
      const auto& r = request["instruct"];
      const data::InstructRecord record{r.at("instruction").get<std::string>(), r.value("input", std::string()),
                                        r.at("output").get<std::string>()};
      if (options.chat_template) segments = options.chat_template->render_training(data::instruct_messages(record));
      else segments = data::render_instruct(options.prompt_template, record);
    } else {
      for (const auto& m : request.at("messages")) {
        messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
      }
      if (options.chat_template) segments = options.chat_template->render_training(messages);
      else segments = data::render_chat(options.prompt_template, messages);
    }
  } catch (const std::invalid_argument& e) {
    return {{"error", e.what()}};
  }
  json segs = json::array();
  for (const auto& s : segments) {
    segs.push_back({{"text", s.text}, {"prompt", s.is_prompt}, {"bos_before", s.bos_before}, {"eos_after", s.eos_after}});
  }
  const auto sample = data::tokenize_segments(segments, tok, options);
  return {{"segments", segs}, {"tokens", sample.tokens}, {"labels", sample.labels}};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: tokenize_tool MODEL REQUESTS.json ANSWERS.json\n");
    return 2;
  }
  try {
    const auto tok = data::Tokenizer::open(argv[1]);
    std::ifstream in(argv[2]);
    const json req = json::parse(in);
    json out = {{"vocab_size", tok.vocab_size()}, {"bos_id", tok.bos_id()}, {"eos_id", tok.eos_id()},
                {"pad_id", tok.pad_id()},         {"eot_id", tok.eot_id()},
                {"adds_bos", tok.adds_bos()},     {"adds_eos", tok.adds_eos()}};

    std::vector<std::string> texts = req.value("encode", std::vector<std::string>{});
    std::vector<std::vector<int64_t>> ids(texts.size());
    size_t bytes = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < texts.size(); ++i) {
      ids[i] = tok.encode(texts[i]);
      bytes += texts[i].size();
    }
    const auto t1 = std::chrono::steady_clock::now();
    out["encode"] = ids;
    out["encode_seconds"] = std::chrono::duration<double>(t1 - t0).count();
    out["encode_bytes"] = bytes;

    json decoded = json::array();
    for (const auto& d : req.value("decode", json::array())) decoded.push_back(tok.decode(d.get<std::vector<int64_t>>()));
    out["decode"] = decoded;

    json llama3 = json::array(), chats = json::array();
    for (const auto& conversation : req.value("llama3_chat", json::array())) {
      llama3.push_back(render_sample(tok, {{"template", "llama3-chat"}, {"messages", conversation}}));
    }
    for (const auto& request : req.value("chat", json::array())) chats.push_back(render_sample(tok, request));
    out["llama3_chat"] = llama3;
    out["chat"] = chats;

    std::ofstream(argv[3]) << out.dump();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenize_tool: %s\n", e.what());
    return 1;
  }
  return 0;
}
