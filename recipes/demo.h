// The end of a run on the embedded default: the exported model answers held-out prompts, so the
// run shows what it learned rather than only a falling loss.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qlora/data/templates.h"

namespace qlora::recipes {

struct HeldoutExample {
  std::string input, prompt, answer, expected;
};

struct HeldoutScore {
  std::string instruction;
  int64_t correct = 0, total = 0;
  HeldoutExample first{};  // the instruction's first record
};

struct HeldoutResult {
  std::vector<HeldoutScore> scores;  // one per instruction, in the file's order
  HeldoutExample example;            // the first record
};

// Greedy answers (at most max_new_tokens, ending at EOS) of the merged HF model in export_dir,
// with the tokenizer exported beside it, to the first max_records records of the JSONL instruct
// file val_path ({"instruction", "input", "output"}), each prompt rendered by `kind` and encoded
// with BOS as `qlora generate` does; an answer counts when its text equals "output" exactly.
// Errors name the file and line.
HeldoutResult score_heldout(const std::string& export_dir, const std::string& val_path, data::TemplateKind kind,
                            int64_t max_records = 200, int64_t max_new_tokens = 16);

// Prints the exact-match count per instruction, each one's first input and answer, then the first
// record's whole prompt and answer.
void print_heldout(const HeldoutResult& result, const std::string& val_path, const std::string& export_dir);

}  // namespace qlora::recipes
