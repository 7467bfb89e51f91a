// `qlora tokenize`: the ids qlora's tokenizer gives each line of a text, or the text of lists of
// ids (--decode); what to reach for when a template or a tokenizer looks wrong, and what the
// tokenizer conformance tests drive.
//
//   qlora tokenize --tokenizer FILE_OR_MODEL_DIR (--text TEXT | --file FILE) [--decode]
//
// Encoding prints {"ids": [...]} per input line (ids without BOS/EOS; the line without its "\n").
// Decoding reads per line a JSON list of ids or comma-separated ids and prints {"text": "..."}.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/tokenizer.h"
#include "cli/cli.h"

namespace qlora::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer, text, file;
  bool has_text = false, decode = false;
};

// "[1, 2]" or "1,2" (or "1, 2"); `where` names the file and line for errors.
std::vector<int64_t> parse_ids(const std::string& line, const std::string& where) {
  const size_t first = line.find_first_not_of(" \t\r");
  nlohmann::json j;
  if (first != std::string::npos && line[first] == '[') {
    j = nlohmann::json::parse(line, nullptr, false);
  } else {
    j = nlohmann::json::parse("[" + line + "]", nullptr, false);
  }
  if (j.is_discarded() || !j.is_array()) throw std::invalid_argument(where + ": expected a JSON list of ids or comma-separated ids");
  std::vector<int64_t> ids;
  for (const auto& v : j) {
    if (!v.is_number_integer()) throw std::invalid_argument(where + ": " + v.dump() + " is not an integer id");
    ids.push_back(v.get<int64_t>());
  }
  return ids;
}

int tokenize(const TokenizeArgs& a) {
  if (a.has_text == !a.file.empty()) throw UsageError("give exactly one of --text TEXT and --file FILE");
  const auto tok = data::Tokenizer::open(a.tokenizer);
  std::string input = a.text;
  const std::string source = a.has_text ? std::string("--text") : a.file;
  if (!a.has_text) {
    std::ifstream in(a.file, std::ios::binary);
    if (!in) throw std::invalid_argument(a.file + ": cannot open");
    std::ostringstream ss;
    ss << in.rdbuf();
    input = ss.str();
  }
  // Lines are cut at "\n" only; a final "\n" ends the last line rather than starting an empty one.
  std::vector<std::string> lines;
  for (size_t pos = 0;;) {
    const size_t nl = input.find('\n', pos);
    if (nl == std::string::npos) {
      if (pos < input.size() || lines.empty()) lines.push_back(input.substr(pos));
      break;
    }
    lines.push_back(input.substr(pos, nl - pos));
    pos = nl + 1;
  }
  for (size_t n = 0; n < lines.size(); ++n) {
    nlohmann::json out;
    if (a.decode) {
      const std::string where = source + ": line " + std::to_string(n + 1);
      try {
        out["text"] = tok.decode(parse_ids(lines[n], where));
      } catch (const std::out_of_range& e) {
        throw std::invalid_argument(where + ": " + e.what());
      }
    } else {
      out["ids"] = tok.encode(lines[n]);
    }
    // Ill-formed UTF-8 (none is produced; input may hold some) is printed as U+FFFD.
    std::puts(out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  return 0;
}

}  // namespace

Command tokenize_command(CLI::App& cmd) {
  auto a = std::make_shared<TokenizeArgs>();
  cmd.add_option("--tokenizer", a->tokenizer, "tokenizer.model, tokenizer.json or a model directory holding one")
      ->type_name("FILE_OR_MODEL_DIR")->required();
  const CLI::Option* text = cmd.add_option("--text", a->text, "the input, its lines tokenized one by one");
  cmd.add_option("--file", a->file, "the input, from a file")->type_name("FILE");
  cmd.add_flag("--decode", a->decode, "input lines are id lists (JSON or comma-separated): print their text");
  return [a, text] {
    a->has_text = text->count() > 0;
    return tokenize(*a);
  };
}

}  // namespace qlora::cli
