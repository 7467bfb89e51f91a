// A JSONL data file from untrusted bytes, read as every data.format reads one: the first byte
// picks instruct, chat, text, preference or prompt (pairs tokenized with the bundled character tokenizer,
// truncated to a short max_seq_len so the cutting paths run too); the rest is the file.
#include <cstdint>
#include <cstdlib>
#include <exception>

#include "qlora/data/dataset.h"
#include "qlora/data/preference.h"
#include "qlora/data/prompts.h"
#include "qlora/data/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

namespace {
const qlora::data::Tokenizer& tokenizer() {
  static const qlora::data::Tokenizer tok = [] {
    const char* d = std::getenv("QLORA_TEST_DATA");
    return qlora::data::Tokenizer::open(std::string(d ? d : "tests/data") + "/tokenizer_chars");
  }();
  return tok;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using qlora::data::DatasetKind;
  const DatasetKind kinds[] = {DatasetKind::kInstruct, DatasetKind::kChat, DatasetKind::kText, DatasetKind::kPreference,
                               DatasetKind::kPrompt};
  qlora::data::DatasetOptions o;
  o.kind = kinds[data[0] % 5];
  o.max_seq_len = 24;
  const std::string path = qlora::fuzz::input_file(data + 1, size - 1, "data.jsonl");
  try {
    if (o.kind == DatasetKind::kPreference) (void)qlora::data::load_preference_pairs(path, tokenizer(), o, {24, 8});
    else if (o.kind == DatasetKind::kPrompt) (void)qlora::data::load_prompts(path, tokenizer(), o);
    else (void)qlora::data::load_dataset(path, tokenizer(), o);
  } catch (const std::exception&) {
  }
  return 0;
}
