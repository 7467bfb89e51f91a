// Tokenizer against python sentencepiece: tokenizer/expected_ids.json was written by
// make_fixtures.py with sentencepiece's own Python package, so equality here is conformance.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <string>

#include "qlora/data/tokenizer.h"

namespace qlora::data {
namespace {

std::string data_dir() {
  const char* dir = std::getenv("QLORA_TEST_DATA");
  if (dir == nullptr) throw std::runtime_error("QLORA_TEST_DATA is not set (ctest sets it)");
  return dir;
}

Tokenizer fixture_tokenizer() { return Tokenizer::open(data_dir() + "/tokenizer/tokenizer.model"); }

nlohmann::json expected() {
  std::ifstream in(data_dir() + "/tokenizer/expected_ids.json");
  return nlohmann::json::parse(in);
}

TEST(Tokenizer, SpecialIdsMatchPython) {
  const auto tok = fixture_tokenizer();
  const auto exp = expected();
  EXPECT_EQ(tok.vocab_size(), exp["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok.bos_id(), exp["bos_id"].get<int64_t>());
  EXPECT_EQ(tok.eos_id(), exp["eos_id"].get<int64_t>());
  EXPECT_EQ(tok.unk_id(), exp["unk_id"].get<int64_t>());
  EXPECT_EQ(exp["pad_id"].get<int64_t>(), -1);  // Llama-like: no pad piece ...
  EXPECT_EQ(tok.pad_id(), tok.eos_id());         // ... so pad falls back to EOS
}

TEST(Tokenizer, IdsAndDecodeMatchPythonSentencepiece) {
  const auto tok = fixture_tokenizer();
  const auto cases = expected()["cases"];
  ASSERT_GE(cases.size(), 50u);
  for (const auto& c : cases) {
    const auto text = c["text"].get<std::string>();
    const auto want = c["ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(tok.encode(text), want) << "text: '" << text << "'";
    EXPECT_EQ(tok.decode(want), c["decoded"].get<std::string>()) << "text: '" << text << "'";
    EXPECT_EQ(tok.decode(tok.encode(text)), text) << "round trip of '" << text << "'";
  }
}

TEST(Tokenizer, EncodeWithSpecialAddsBosEos) {
  const auto tok = fixture_tokenizer();
  const auto body = tok.encode("Add the numbers.");
  auto both = tok.encode_with_special("Add the numbers.", true, true);
  ASSERT_EQ(both.size(), body.size() + 2);
  EXPECT_EQ(both.front(), tok.bos_id());
  EXPECT_EQ(both.back(), tok.eos_id());
  EXPECT_EQ(std::vector<int64_t>(both.begin() + 1, both.end() - 1), body);
  EXPECT_EQ(tok.encode_with_special("hi", false, false), tok.encode("hi"));
  EXPECT_EQ(tok.encode_with_special("hi", false, true).back(), tok.eos_id());
  EXPECT_EQ(tok.decode(both), "Add the numbers.");  // control ids decode to nothing
}

TEST(Tokenizer, ContinuationHasNoDummyPrefix) {
  const auto tok = fixture_tokenizer();
  const std::pair<std::string, std::string> pairs[] = {
      {"### Response:\n", "19"}, {"Hello", " world"}, {"Hello", "world"}, {"a", "\n\nb"},
      {"12 + ", "7"},            {"x", "café"},       {"[/INST]", " answer "}};
  for (const auto& [a, b] : pairs) {
    auto ids = tok.encode(a);
    const auto rest = tok.encode_continuation(b);
    ids.insert(ids.end(), rest.begin(), rest.end());
    EXPECT_EQ(tok.decode(ids), a + b) << "'" << a << "' + '" << b << "'";
  }
  // Why it exists: a plain encode of the second part carries the dummy-prefix space.
  auto naive = tok.encode("x");
  const auto second = tok.encode("19");
  naive.insert(naive.end(), second.begin(), second.end());
  EXPECT_EQ(tok.decode(naive), "x 19");
  EXPECT_EQ(tok.decode(tok.encode_continuation("19")), "19");
  EXPECT_TRUE(tok.encode_continuation("").empty());
}

TEST(Tokenizer, MissingModelNamesThePath) {
  try {
    Tokenizer::open("/nonexistent/dir/tokenizer.model");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/tokenizer.model"), std::string::npos)
        << e.what();
  }
}

TEST(Tokenizer, DecodeRejectsOutOfRangeIds) {
  const auto tok = fixture_tokenizer();
  EXPECT_THROW(tok.decode({5, tok.vocab_size()}), std::out_of_range);
  EXPECT_THROW(tok.decode({-1}), std::out_of_range);
  EXPECT_EQ(tok.id_to_piece(tok.bos_id()), "<s>");
}

}  // namespace
}  // namespace qlora::data
