// Runs qlora's Tokenizer on what a conformance script asks and writes the answers as JSON, so
// the script can compare them with a Python reference (tiktoken, transformers) on texts it generates:
//
//   tokenize_tool MODEL REQUESTS.json ANSWERS.json
//
// REQUESTS: {"encode": [text, ...], "decode": [[id, ...], ...],
//            "llama3_chat": [[{"role", "content"}, ...], ...],
//            "chat": [{"template": NAME, "messages": [{"role", "content"}, ...]}
//                     or {"template": NAME, "instruct": {"instruction", "input", "output"}}, ...]}
//           (every key optional)
// ANSWERS:  {"vocab_size", "bos_id", "eos_id", "pad_id", "eot_id", "encode": [[id, ...], ...],
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

#include "qlora/data/dataset.h"
#include "qlora/data/templates.h"
#include "qlora/data/tokenizer.h"

namespace {

using nlohmann::json;
namespace data = qlora::data;

// One chat request rendered and tokenized (see SAMPLE above).
json render_sample(const data::Tokenizer& tok, const json& request) {
  std::vector<data::Segment> segments;
  try {
    const auto kind = data::template_kind_from_name(request.at("template").get<std::string>());
    if (request.contains("instruct")) {
      const auto& r = request["instruct"];
      segments = data::render_instruct(kind, {r.at("instruction").get<std::string>(),
                                              r.value("input", std::string()), r.at("output").get<std::string>()});
    } else {
      std::vector<data::Message> messages;
      for (const auto& m : request.at("messages")) {
        messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
      }
      segments = data::render_chat(kind, messages);
    }
  } catch (const std::invalid_argument& e) {
    return {{"error", e.what()}};
  }
  json segs = json::array();
  for (const auto& s : segments) {
    segs.push_back({{"text", s.text}, {"prompt", s.is_prompt}, {"bos_before", s.bos_before}, {"eos_after", s.eos_after}});
  }
  data::DatasetOptions options;
  options.max_seq_len = 0;
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
                {"pad_id", tok.pad_id()},         {"eot_id", tok.eot_id()}};

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
