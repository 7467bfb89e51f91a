#include "demo.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>

#include "qlora/data/tokenizer.h"
#include "qlora/models/generate.h"
#include "qlora/models/decoder.h"

namespace qlora::recipes {

namespace {

data::InstructRecord read_record(const std::string& line, const std::string& where) {
  try {
    const nlohmann::json j = nlohmann::json::parse(line);
    return {j.at("instruction").get<std::string>(), j.value("input", std::string()), j.at("output").get<std::string>()};
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + ": expected a JSON object with string instruction, input and output (" +
                                e.what() + ")");
  }
}

// The prompt: every segment before the trained answer, joined.
std::string prompt_of(data::TemplateKind kind, const data::InstructRecord& r) {
  std::vector<data::Segment> segments = data::render_instruct(kind, r);
  while (!segments.empty() && !segments.back().is_prompt) segments.pop_back();
  return data::join_segments(segments);
}

HeldoutScore& score_for(std::vector<HeldoutScore>& scores, const std::string& instruction) {
  const auto it = std::find_if(scores.begin(), scores.end(), [&](const HeldoutScore& s) { return s.instruction == instruction; });
  if (it != scores.end()) return *it;
  scores.push_back({instruction, 0, 0});
  return scores.back();
}

}  // namespace

HeldoutResult score_heldout(const std::string& export_dir, const std::string& val_path, data::TemplateKind kind,
                            int64_t max_records, int64_t max_new_tokens) {
  std::ifstream in(val_path);
  if (!in) throw std::runtime_error("cannot read held-out file " + val_path);
  const data::Tokenizer tok = data::Tokenizer::open(data::Tokenizer::find_file(export_dir));
  const models::DecoderModel model = models::load_decoder(export_dir, models::DecoderLoadOptions{});
  models::GenerateOptions opt;
  opt.max_new_tokens = max_new_tokens;
  opt.stop_ids = {tok.eos_id()};

  HeldoutResult result;
  int64_t line_no = 0, used = 0;
  for (std::string line; used < max_records && std::getline(in, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++used;
    const data::InstructRecord r = read_record(line, val_path + ": line " + std::to_string(line_no));
    const std::string prompt = prompt_of(kind, r);
    std::vector<int64_t> out = models::generate(model, tok.encode_with_special(prompt, true, false), opt);
    if (!out.empty() && out.back() == tok.eos_id()) out.pop_back();
    const std::string answer = tok.decode(out);
    const HeldoutExample example{r.input, prompt, answer, r.output};
    if (used == 1) result.example = example;
    HeldoutScore& s = score_for(result.scores, r.instruction);
    if (s.total == 0) s.first = example;
    s.total += 1;
    s.correct += answer == r.output;
  }
  return result;
}

void print_heldout(const HeldoutResult& result, const std::string& val_path, const std::string& export_dir) {
  std::printf("held-out prompts (%s), greedy answers of %s:", val_path.c_str(), export_dir.c_str());
  for (const HeldoutScore& s : result.scores)
    std::printf(" \"%s\" %lld/%lld right;", s.instruction.c_str(), (long long)s.correct, (long long)s.total);
  std::printf("\n");
  for (const HeldoutScore& s : result.scores)
    std::printf("  e.g. %s %s -> %s (%s)\n", s.instruction.c_str(), s.first.input.c_str(), s.first.answer.c_str(),
                s.first.answer == s.first.expected ? "right" : ("expected " + s.first.expected).c_str());
  const HeldoutExample& e = result.example;
  std::printf("one of them, as the model saw it:\n%s\n-> the model answers: %s   (expected: %s)\n", e.prompt.c_str(),
              e.answer.c_str(), e.expected.c_str());
  std::fflush(stdout);
}

}  // namespace qlora::recipes
