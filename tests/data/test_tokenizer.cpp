// Tokenizer against the Python references: tokenizer/expected_ids.json was written by
// make_fixtures.py with sentencepiece's own Python package, tokenizer_tiktoken/expected_ids.json
// with tiktoken's Encoding (Meta's Llama-3 pattern and special tokens), so equality here is
// conformance. Also: format detection, errors naming file and line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <string>

#include "qlora/data/tiktoken_bpe.h"
#include "qlora/data/tokenizer.h"

#include "fixtures.h"

namespace qlora::data {
namespace {

using test_fixtures::data_dir;
using test_fixtures::fixture_tokenizer;
using test_fixtures::open_error;
using test_fixtures::write_temp;

nlohmann::json expected(const std::string& dir = "tokenizer") {
  std::ifstream in(data_dir() + "/" + dir + "/expected_ids.json");
  return nlohmann::json::parse(in);
}

// Each {"text", "ids", "decoded"} case: encode gives the reference's ids, decode of those ids the
// reference's text, and the text round-trips.
void expect_cases_match(const Tokenizer& tok, const nlohmann::json& cases) {
  for (const auto& c : cases) {
    const auto text = c["text"].get<std::string>();
    const auto want = c["ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(tok.encode(text), want) << "text: '" << text << "'";
    EXPECT_EQ(tok.decode(want), c["decoded"].get<std::string>()) << "text: '" << text << "'";
    EXPECT_EQ(tok.decode(tok.encode(text)), text) << "round trip of '" << text << "'";
  }
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
  expect_cases_match(tok, cases);
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

// ---- tiktoken (Llama-3) ------------------------------------------------------------------------

std::string tiktoken_path() { return data_dir() + "/tokenizer_tiktoken/tokenizer.model"; }

TEST(TiktokenTokenizer, DetectedByContentWithLlama3SpecialIds) {
  const auto tok = Tokenizer::open(tiktoken_path());
  const auto exp = expected("tokenizer_tiktoken");
  const int64_t n = exp["num_base_tokens"].get<int64_t>();
  EXPECT_EQ(tok.vocab_size(), n + 256);
  EXPECT_EQ(tok.vocab_size(), exp["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok.bos_id(), exp["bos_id"].get<int64_t>());
  EXPECT_EQ(tok.eos_id(), exp["eos_id"].get<int64_t>());
  EXPECT_EQ(tok.eot_id(), exp["eot_id"].get<int64_t>());
  EXPECT_EQ(tok.pad_id(), exp["pad_id"].get<int64_t>());  // <|finetune_right_pad_id|>
  EXPECT_EQ(tok.unk_id(), -1);
  // Offsets within the 256 specials, as in Meta's and torchtune's tables (128000 + k).
  EXPECT_EQ(tok.bos_id(), n);
  EXPECT_EQ(tok.eos_id(), n + 1);
  EXPECT_EQ(tok.pad_id(), n + 4);
  EXPECT_EQ(tok.eot_id(), n + 9);
  EXPECT_EQ(tok.id_to_piece(n + 6), "<|start_header_id|>");
  EXPECT_EQ(tok.id_to_piece(n + 10), "<|python_tag|>");
  EXPECT_EQ(tok.id_to_piece(n + 11), "<|reserved_special_token_2|>");
  EXPECT_EQ(tok.id_to_piece(n + 255), "<|reserved_special_token_246|>");
  EXPECT_EQ(tok.id_to_piece('a'), "a");  // the first 256 ranks are the single bytes here
  EXPECT_THROW(tok.id_to_piece(tok.vocab_size()), std::out_of_range);
  // The sentencepiece fixture is still read as sentencepiece.
  const auto sp = fixture_tokenizer();
  EXPECT_EQ(sp.id_to_piece(sp.bos_id()), "<s>");
  EXPECT_EQ(sp.eot_id(), -1);
}

TEST(TiktokenTokenizer, IdsAndDecodeMatchPythonTiktoken) {
  const auto tok = Tokenizer::open(tiktoken_path());
  const auto cases = expected("tokenizer_tiktoken")["cases"];
  ASSERT_GE(cases.size(), 80u);
  expect_cases_match(tok, cases);
}

TEST(TiktokenTokenizer, SpecialStringsBosEosAndNoDummyPrefix) {
  const auto tok = Tokenizer::open(tiktoken_path());
  const int64_t sh = tok.vocab_size() - 256 + 6, eh = sh + 1;
  auto want = std::vector<int64_t>{sh};
  const auto user = tok.encode("user");
  want.insert(want.end(), user.begin(), user.end());
  want.push_back(eh);
  EXPECT_EQ(tok.encode("<|start_header_id|>user<|end_header_id|>"), want);
  EXPECT_EQ(tok.encode("<|eot_id|>"), std::vector<int64_t>{tok.eot_id()});
  EXPECT_EQ(tok.encode("<|eot_id").size(), 8u);  // not closed: plain bytes

  const auto both = tok.encode_with_special("hi", true, true);
  ASSERT_EQ(both.size(), tok.encode("hi").size() + 2);
  EXPECT_EQ(both.front(), tok.bos_id());
  EXPECT_EQ(both.back(), tok.eos_id());
  EXPECT_EQ(tok.decode(both), "<|begin_of_text|>hi<|end_of_text|>");  // as tiktoken decodes
  for (const char* s : {"19", " world", "\n\nb", "café", "<|eot_id|>x"}) {
    EXPECT_EQ(tok.encode_continuation(s), tok.encode(s)) << s;
  }
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(TiktokenTokenizer, Utf8RepairLikePython) {
  // Expected values are Python's bytes.decode("utf-8", errors="replace").
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8_replace_invalid("a\xFF" "b"), "a" + r + "b");
  EXPECT_EQ(utf8_replace_invalid("\xE6\x97"), r);              // truncated 3-byte: one U+FFFD
  EXPECT_EQ(utf8_replace_invalid("\xF0\x9F\x98" "x"), r + "x");  // truncated 4-byte
  EXPECT_EQ(utf8_replace_invalid("\xED\xA0\x80"), r + r + r);  // a surrogate: three
  EXPECT_EQ(utf8_replace_invalid("\xC0\xAF"), r + r);          // overlong
  EXPECT_EQ(utf8_replace_invalid("\xF4\x90\x80\x80"), r + r + r + r);  // past U+10FFFF
  EXPECT_EQ(utf8_replace_invalid("caf\xC3\xA9 \xF0\x9F\x98\x80"), "caf\xC3\xA9 \xF0\x9F\x98\x80");

  const auto tok = Tokenizer::open(tiktoken_path());
  EXPECT_EQ(tok.encode("a\xFF" "b"), tok.encode("a" + r + "b"));
  // Ids that split a character decode to U+FFFD, as tiktoken's decode does.
  const auto ids = tok.encode("\xF0\x9F\x98\x80");  // an emoji: several byte tokens here
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(tok.decode({ids[0]}), r);
  EXPECT_THROW(tok.decode({1, tok.vocab_size()}), std::out_of_range);
  EXPECT_THROW(tok.decode({-1}), std::out_of_range);
}

TEST(TiktokenTokenizer, HugeRunsRoundTrip) {
  // One pre-token of 1 MB (a letter run) and 1 MB of spaces: the merge must not be quadratic and
  // the regex must not run out of JIT stack.
  const auto tok = Tokenizer::open(tiktoken_path());
  const std::string letters(1 << 20, 'e'), spaces(1 << 20, ' ');
  for (const auto* s : {&letters, &spaces}) {
    const auto ids = tok.encode(*s + "x");
    EXPECT_LT(ids.size(), s->size());
    EXPECT_EQ(tok.decode(ids), *s + "x");
  }
}

// ---- malformed files ---------------------------------------------------------------------------

std::string byte_lines() {  // a valid file: the 256 single bytes, ranks 0..255
  static const char* b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (int b = 0; b < 256; ++b) {
    out += {b64[b >> 2], b64[(b & 3) << 4], '=', '='};
    out += " " + std::to_string(b) + "\n";
  }
  return out;
}

TEST(TiktokenTokenizer, MalformedFilesNameFileAndLine) {
  const std::string ok = byte_lines();
  // CRLF line ends and blank lines are accepted, as tiktoken's loader accepts them.
  EXPECT_EQ(Tokenizer::open(write_temp("ok", ok + "YWI= 256\r\n\n")).vocab_size(), 257 + 256);
  const auto has = [](const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; };
  std::string e = open_error("b64", ok + "YW*= 256\n");
  EXPECT_TRUE(has(e, "line 257") && has(e, "bad base64")) << e;
  e = open_error("rank", ok + "YWI= 25x\n");
  EXPECT_TRUE(has(e, "line 257") && has(e, "bad rank")) << e;
  e = open_error("gap", ok + "YWI= 300\n");
  EXPECT_TRUE(has(e, "line 257") && has(e, "where 256 was expected")) << e;
  e = open_error("dup", ok + "YWI= 256\nYWI= 257\n");
  EXPECT_TRUE(has(e, "line 258") && has(e, "line 257")) << e;
  e = open_error("shape", ok + "YWI=256\n");
  EXPECT_TRUE(has(e, "line 257") && has(e, "expected '<base64 token> <rank>'")) << e;
  e = open_error("bytes", ok.substr(0, ok.find("YA== 96")));  // only bytes 0..95
  EXPECT_TRUE(has(e, "single byte 96")) << e;
}

}  // namespace
}  // namespace qlora::data
