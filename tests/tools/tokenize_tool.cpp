// Runs qlora's Tokenizer on what a conformance script asks and writes the answers as JSON, so
// the script can compare them with a Python reference (tiktoken) on texts it generates:
//
//   tokenize_tool MODEL REQUESTS.json ANSWERS.json
//
// REQUESTS: {"encode": [text, ...], "decode": [[id, ...], ...],
//            "llama3_chat": [[{"role", "content"}, ...], ...]}   (every key optional)
// ANSWERS:  {"vocab_size", "bos_id", "eos_id", "pad_id", "eot_id", "encode": [[id, ...], ...],
//            "decode": [text, ...], "llama3_chat": [{"tokens", "labels"}, ...],
//            "encode_seconds", "encode_bytes"}
// llama3_chat renders each conversation with the llama3-chat template and tokenizes it as the
// dataset does by default (BOS, segments, EOS). encode_seconds times the encode calls alone.
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

int main(int argc, char** argv) {
  using nlohmann::json;
  namespace data = qlora::data;
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

    json chats = json::array();
    for (const auto& conversation : req.value("llama3_chat", json::array())) {
      std::vector<data::Message> messages;
      for (const auto& m : conversation) messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
      const auto sample = data::tokenize_segments(data::render_chat(data::TemplateKind::kLlama3Chat, messages), tok,
                                                  data::DatasetOptions{});
      chats.push_back({{"tokens", sample.tokens}, {"labels", sample.labels}});
    }
    out["llama3_chat"] = chats;

    std::ofstream(argv[3]) << out.dump();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenize_tool: %s\n", e.what());
    return 1;
  }
  return 0;
}
