// Templates, JSON/JSONL loading with line-precise errors, masking and truncation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "qlora/data/dataset.h"
#include "qlora/data/templates.h"

#include "fixtures.h"

namespace qlora::data {
namespace {

using test_fixtures::data_dir;
using test_fixtures::error_of;
using test_fixtures::fixture_tokenizer;

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "qlora_data_" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}


bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ---- templates -------------------------------------------------------------------------------

TEST(Templates, AlpacaWithAndWithoutInput) {
  const auto with = render_instruct(TemplateKind::kAlpaca, {"Add the numbers.", "12 + 7", "19"});
  ASSERT_EQ(with.size(), 2u);
  EXPECT_EQ(with[0].text,
            "Below is an instruction that describes a task, paired with an input that provides "
            "further context. Write a response that appropriately completes the request.\n\n"
            "### Instruction:\nAdd the numbers.\n\n### Input:\n12 + 7\n\n### Response:\n");
  EXPECT_TRUE(with[0].is_prompt);
  EXPECT_EQ(with[1].text, "19");
  EXPECT_FALSE(with[1].is_prompt);

  const auto without = render_instruct(TemplateKind::kAlpaca, {"Say hi.", "", "hi"});
  EXPECT_EQ(without[0].text,
            "Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.\n\n### Instruction:\nSay hi.\n\n### Response:\n");
  EXPECT_EQ(without[1].text, "hi");
}

TEST(Templates, Llama2ChatSystemAndTwoTurns) {
  const std::vector<Message> m = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"},
                                  {"user", "Bye"},         {"assistant", "Goodbye"}};
  const auto s = render_chat(TemplateKind::kLlama2Chat, m);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].text, "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]");
  EXPECT_TRUE(s[0].is_prompt);
  EXPECT_FALSE(s[0].bos_before);  // the first BOS is the dataset's add_bos
  EXPECT_EQ(s[1].text, " Hello ");
  EXPECT_FALSE(s[1].is_prompt);
  EXPECT_TRUE(s[1].eos_after);
  EXPECT_EQ(s[2].text, "[INST] Bye [/INST]");
  EXPECT_TRUE(s[2].bos_before);
  EXPECT_EQ(s[3].text, " Goodbye ");
  EXPECT_FALSE(s[3].eos_after);  // the last EOS is the dataset's add_eos
}

TEST(Templates, Llama3Chat) {
  const auto s = render_chat(TemplateKind::kLlama3Chat,
                             {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}});
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].text,
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_TRUE(s[0].is_prompt);
  EXPECT_EQ(s[1].text, "Hello<|eot_id|>");
  EXPECT_FALSE(s[1].is_prompt);
}

TEST(Templates, ChatMLFromInstructRecord) {
  const auto s = render_instruct(TemplateKind::kChatML, {"Add the numbers.", "1 + 2", "3"});
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].text,
            "<|im_start|>user\nAdd the numbers.\n\n1 + 2<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(s[1].text, "3<|im_end|>\n");
  EXPECT_FALSE(s[1].is_prompt);
}

TEST(Templates, NamesAndBadRoles) {
  EXPECT_EQ(template_kind_from_name("llama3-chat"), TemplateKind::kLlama3Chat);
  EXPECT_EQ(template_name(TemplateKind::kChatML), "chatml");
  EXPECT_TRUE(contains(error_of([] { template_kind_from_name("vicuna"); }), "vicuna"));
  EXPECT_TRUE(contains(error_of([] { template_kind_from_name("vicuna"); }),
                       "expected one of auto, alpaca, llama2-chat, llama3-chat, llama3.1-chat, chatml, qwen2.5, "
                       "qwen3, gemma, mistral-v0.3"));
  EXPECT_TRUE(contains(error_of([] { validate_messages({{"user", "a"}, {"bot", "b"}}); }),
                       "role 'bot'"));
  EXPECT_TRUE(contains(error_of([] { validate_messages({{"user", "a"}, {"user", "b"}}); }),
                       "message 2"));
  EXPECT_TRUE(contains(error_of([] { validate_messages({{"user", "a"}}); }), "assistant"));
  EXPECT_FALSE(
      error_of([] { render_chat(TemplateKind::kAlpaca,
                                {{"user", "a"}, {"assistant", "b"}, {"user", "c"}, {"assistant", "d"}}); })
          .empty());
}

// ---- tokenization and masking --------------------------------------------------------------

TEST(Dataset, PromptMaskedResponseTrained) {
  const auto tok = fixture_tokenizer();
  DatasetOptions o;
  const auto segs = render_instruct(TemplateKind::kAlpaca, {"Add the numbers.", "12 + 7", "19"});
  const auto s = tokenize_segments(segs, tok, o);
  ASSERT_EQ(s.tokens.size(), s.labels.size());
  const size_t prompt_len = 1 + tok.encode(segs[0].text).size();  // BOS + prompt
  EXPECT_EQ(s.tokens.front(), tok.bos_id());
  EXPECT_EQ(s.tokens.back(), tok.eos_id());
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    if (i < prompt_len) EXPECT_EQ(s.labels[i], kIgnoreIndex) << i;
    else EXPECT_EQ(s.labels[i], s.tokens[i]) << i;
  }
  EXPECT_GT(s.tokens.size(), prompt_len + 1);  // the answer has tokens of its own
  // Segment-wise tokenization loses no text and adds no space.
  EXPECT_EQ(tok.decode(s.tokens), join_segments(segs));
  const std::vector<int64_t> answer(s.tokens.begin() + prompt_len, s.tokens.end() - 1);
  EXPECT_EQ(tok.decode(answer), "19");
}

TEST(Dataset, TrainOnInputAndSpecialFlags) {
  const auto tok = fixture_tokenizer();
  DatasetOptions o;
  o.train_on_input = true;
  const auto segs = render_instruct(TemplateKind::kAlpaca, {"Reverse the word.", "cat", "tac"});
  const auto s = tokenize_segments(segs, tok, o);
  EXPECT_EQ(s.labels, s.tokens);

  o.add_bos = false;
  o.add_eos = false;
  const auto bare = tokenize_segments(segs, tok, o);
  EXPECT_EQ(bare.tokens.size(), s.tokens.size() - 2);
  EXPECT_NE(bare.tokens.front(), tok.bos_id());
  EXPECT_NE(bare.tokens.back(), tok.eos_id());
}

TEST(Dataset, Llama2InnerTurnsGetBosAndEos) {
  const auto tok = fixture_tokenizer();
  DatasetOptions o;
  const auto segs = render_chat(TemplateKind::kLlama2Chat,
                                {{"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}, {"assistant", "Ok"}});
  const auto s = tokenize_segments(segs, tok, o);
  int bos = 0, eos = 0;
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    if (s.tokens[i] == tok.bos_id()) {
      ++bos;
      EXPECT_EQ(s.labels[i], kIgnoreIndex);
    }
    if (s.tokens[i] == tok.eos_id()) {
      ++eos;
      EXPECT_EQ(s.labels[i], tok.eos_id());  // stopping after an answer is trained
    }
  }
  EXPECT_EQ(bos, 2);
  EXPECT_EQ(eos, 2);
}

// Meta's ChatFormat (and torchtune's Llama-3 tokenize_messages): one <|begin_of_text|>, then per
// message <|start_header_id|> role <|end_header_id|> "\n\n" content <|eot_id|>; torchtune ends a
// training sample with <|end_of_text|>.
TEST(Dataset, Llama3ChatHasOneBeginOfTextWithEitherTokenizer) {
  const std::vector<Message> m = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}};
  const auto segs = render_chat(TemplateKind::kLlama3Chat, m);
  const DatasetOptions o;
  const auto tt = Tokenizer::open(data_dir() + "/tokenizer_tiktoken/tokenizer.model");
  const auto special = [&](const char* name) {
    const auto ids = tt.encode(name);
    EXPECT_EQ(ids.size(), 1u) << name;
    return ids.at(0);
  };
  std::vector<int64_t> want = {tt.bos_id()};
  const auto append = [&](const std::vector<int64_t>& ids) { want.insert(want.end(), ids.begin(), ids.end()); };
  size_t answer_start = 0;
  for (const auto& msg : m) {
    want.push_back(special("<|start_header_id|>"));
    append(tt.encode(msg.role));
    want.push_back(special("<|end_header_id|>"));
    append(tt.encode("\n\n"));
    if (msg.role == "assistant") answer_start = want.size();
    append(tt.encode(msg.content));
    want.push_back(tt.eot_id());
  }
  want.push_back(tt.eos_id());
  const auto s = tokenize_segments(segs, tt, o);
  EXPECT_EQ(s.tokens, want);
  EXPECT_EQ(std::count(s.tokens.begin(), s.tokens.end(), tt.bos_id()), 1);
  for (size_t i = 0; i < s.labels.size(); ++i) {
    EXPECT_EQ(s.labels[i], i < answer_start ? kIgnoreIndex : s.tokens[i]) << i;
  }

  // Sentencepiece: its BOS once, and no "<|begin_of_text|>" spelled out as text.
  const auto sp = fixture_tokenizer();
  const auto s2 = tokenize_segments(segs, sp, o);
  EXPECT_EQ(s2.tokens.front(), sp.bos_id());
  EXPECT_EQ(std::count(s2.tokens.begin(), s2.tokens.end(), sp.bos_id()), 1);
  EXPECT_EQ(sp.decode(s2.tokens).find("begin_of_text"), std::string::npos);
}

// Mistral v0.3 ends every answer with EOS itself; add_eos adds none after the last.
TEST(Dataset, EosOnceAfterATemplateEndingWithIt) {
  const auto tok = fixture_tokenizer();
  const auto segs = render_chat(TemplateKind::kMistralV03,
                                {{"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}, {"assistant", "Ok"}});
  DatasetOptions o;
  const auto s = tokenize_segments(segs, tok, o);
  EXPECT_EQ(std::count(s.tokens.begin(), s.tokens.end(), tok.eos_id()), 2);
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    if (s.tokens[i] == tok.eos_id()) EXPECT_EQ(s.labels[i], tok.eos_id()) << i;  // trained
  }
  EXPECT_EQ(s.tokens.back(), tok.eos_id());
  o.add_eos = false;
  EXPECT_EQ(tokenize_segments(segs, tok, o).tokens, s.tokens);
}

// Qwen's tokenizer has no BOS (tokenizer_config.json: "bos_token": null): add_bos adds nothing.
TEST(Dataset, NoBosFromATokenizerWithoutOne) {
  const std::string dir = testing::TempDir() + "qlora_data_nobos";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << test_fixtures::spm_style().dump();
  std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": null, "eos_token": "</s>"})";
  const auto tok = Tokenizer::open(dir);
  ASSERT_EQ(tok.bos_id(), -1);
  const auto segs = render_chat(TemplateKind::kLlama2Chat,
                                {{"user", "ab"}, {"assistant", "ab"}, {"user", "b"}, {"assistant", "a"}});
  const auto s = tokenize_segments(segs, tok, DatasetOptions{});
  EXPECT_TRUE(std::all_of(s.tokens.begin(), s.tokens.end(), [](int64_t id) { return id >= 0; }));
  EXPECT_EQ(s.tokens.front(), tok.encode(segs[0].text).front());  // the first segment, no BOS before it
}

TEST(Dataset, TruncationKeepsStartAndEndsWithMaskedEos) {
  const auto tok = fixture_tokenizer();
  DatasetOptions o;
  const auto segs = render_instruct(TemplateKind::kAlpaca, {"Add the numbers.", "12 + 7", "19"});
  const auto full = tokenize_segments(segs, tok, o);
  o.max_seq_len = 10;
  const auto cut = tokenize_segments(segs, tok, o);
  ASSERT_EQ(cut.tokens.size(), 10u);
  EXPECT_TRUE(std::equal(cut.tokens.begin(), cut.tokens.end() - 1, full.tokens.begin()));
  EXPECT_EQ(cut.tokens.back(), tok.eos_id());
  EXPECT_EQ(cut.labels.back(), kIgnoreIndex);
  o.add_eos = false;
  const auto cut2 = tokenize_segments(segs, tok, o);
  EXPECT_TRUE(std::equal(cut2.tokens.begin(), cut2.tokens.end(), full.tokens.begin()));
  o.max_seq_len = static_cast<int64_t>(full.tokens.size()) + 5;  // no-op when it fits
  o.add_eos = true;
  EXPECT_EQ(tokenize_segments(segs, tok, o).tokens, full.tokens);
}

// ---- files -----------------------------------------------------------------------------------

TEST(Dataset, TinyTasksLoads) {
  // The embedded default's data with its tokenizer, which has the Alpaca scaffolding as whole
  // pieces: ~10 pieces of prompt, then a character each. Answers have 1 to 7 characters + EOS.
  const auto tok = Tokenizer::open(data_dir() + "/tokenizer_chars/tokenizer.model");
  for (const auto& [file, records] : {std::pair<std::string, size_t>{"tiny_tasks.jsonl", 2000},
                                      std::pair<std::string, size_t>{"tiny_tasks_heldout.jsonl", 100}}) {
    const auto samples = load_dataset(data_dir() + "/" + file, tok, DatasetOptions{});
    ASSERT_EQ(samples.size(), records) << file;
    for (const auto& s : samples) {
      ASSERT_LE(s.tokens.size(), 26u) << file;
      const auto trained = std::count_if(s.labels.begin(), s.labels.end(), [](int64_t l) { return l >= 0; });
      ASSERT_GE(trained, 2) << file;
      ASSERT_LE(trained, 8) << file;
    }
  }
}

TEST(Dataset, JsonlBadJsonOnLine3) {
  const auto path = write_temp("bad3.jsonl",
                               "{\"instruction\": \"a\", \"output\": \"b\"}\n"
                               "{\"instruction\": \"c\", \"output\": \"d\"}\n"
                               "{\"instruction\": \"e\", \"output\": }\n");
  const auto msg = error_of([&] { read_records(path, DatasetOptions{}); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "line 3")) << msg;
  EXPECT_TRUE(contains(msg, "bad JSON")) << msg;
}

TEST(Dataset, JsonlMissingFieldWrongTypeAndBlankLines) {
  const auto missing = write_temp("missing.jsonl",
                                  "{\"instruction\": \"a\", \"output\": \"b\"}\n\n"
                                  "{\"instruction\": \"c\"}\n");
  auto msg = error_of([&] { read_records(missing, DatasetOptions{}); });
  EXPECT_TRUE(contains(msg, missing + ": line 3")) << msg;  // blank line 2 still counts
  EXPECT_TRUE(contains(msg, "missing field \"output\"")) << msg;

  const auto typed = write_temp("typed.jsonl", "{\"instruction\": \"a\", \"output\": 19}\n");
  msg = error_of([&] { read_records(typed, DatasetOptions{}); });
  EXPECT_TRUE(contains(msg, "line 1")) << msg;
  EXPECT_TRUE(contains(msg, "\"output\" is number")) << msg;

  const auto not_object = write_temp("array_line.jsonl", "[1, 2]\n");
  EXPECT_TRUE(contains(error_of([&] { read_records(not_object, DatasetOptions{}); }),
                       "expected an object"));
}

TEST(Dataset, JsonArrayRecordErrorNamesIndexAndLine) {
  const auto path = write_temp("arr.json",
                               "[\n"
                               "  {\"instruction\": \"a\", \"output\": \"b\"},\n"
                               "  {\"instruction\": \"x, [y]\", \"input\": \"}{\", \"output\": \"z\"},\n"
                               "  {\n"
                               "    \"instruction\": \"c\"\n"
                               "  }\n"
                               "]\n");
  const auto msg = error_of([&] { read_records(path, DatasetOptions{}); });
  EXPECT_TRUE(contains(msg, path + ": record 3 (line 4)")) << msg;
  EXPECT_TRUE(contains(msg, "missing field \"output\"")) << msg;

  const auto bad = write_temp("badarr.json", "[\n  {\"instruction\": \"a\", \"output\": \"b\"},\n  {oops}\n]\n");
  const auto msg2 = error_of([&] { read_records(bad, DatasetOptions{}); });
  EXPECT_TRUE(contains(msg2, bad + ": line 3")) << msg2;

  const auto obj = write_temp("obj.json", "{\"instruction\": \"a\"}");
  EXPECT_TRUE(contains(error_of([&] { read_records(obj, DatasetOptions{}); }), "expected an array"));
}

TEST(Dataset, ChatRecordsAndBadRole) {
  const auto tok = fixture_tokenizer();
  DatasetOptions o;
  o.kind = DatasetKind::kChat;
  o.prompt_template = TemplateKind::kChatML;
  const auto good = write_temp("chat.jsonl",
                               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, "
                               "{\"role\": \"assistant\", \"content\": \"hello\"}]}\n");
  const auto samples = load_dataset(good, tok, o);
  ASSERT_EQ(samples.size(), 1u);
  std::vector<int64_t> trained;
  for (size_t i = 0; i < samples[0].labels.size(); ++i) {
    if (samples[0].labels[i] != kIgnoreIndex) trained.push_back(samples[0].tokens[i]);
  }
  EXPECT_EQ(tok.decode(trained), "hello<|im_end|>\n");

  const auto bad = write_temp("chatbad.jsonl",
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n"
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, "
                              "{\"role\": \"bot\", \"content\": \"hello\"}]}\n");
  const auto msg = error_of([&] { read_records(bad, o); });
  EXPECT_TRUE(contains(msg, bad + ": line 1")) << msg;  // ends with a user message
  const auto bad2 = write_temp("chatbad2.jsonl",
                               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, "
                               "{\"role\": \"bot\", \"content\": \"hello\"}]}\n");
  const auto msg2 = error_of([&] { read_records(bad2, o); });
  EXPECT_TRUE(contains(msg2, "line 1")) << msg2;
  EXPECT_TRUE(contains(msg2, "role 'bot'")) << msg2;
  const auto bad3 = write_temp("chatbad3.jsonl", "{\"messages\": [{\"role\": \"user\"}]}\n");
  EXPECT_TRUE(contains(error_of([&] { read_records(bad3, o); }), "messages[0]: missing field \"content\""));
}

TEST(Dataset, TextKindAndCustomFieldNames) {
  const auto tok = fixture_tokenizer();
  DatasetOptions o;
  o.kind = DatasetKind::kText;
  const auto text = write_temp("text.jsonl", "{\"text\": \"The quick brown fox.\"}\n");
  const auto s = load_dataset(text, tok, o)[0];
  EXPECT_EQ(s.labels[0], kIgnoreIndex);  // BOS
  EXPECT_EQ(std::vector<int64_t>(s.labels.begin() + 1, s.labels.end()),
            std::vector<int64_t>(s.tokens.begin() + 1, s.tokens.end()));

  DatasetOptions q;
  q.instruction_field = "question";
  q.output_field = "answer";
  const auto custom = write_temp("custom.jsonl", "{\"question\": \"Q?\", \"answer\": \"A.\"}\n");
  EXPECT_EQ(read_records(custom, q).size(), 1u);
  EXPECT_TRUE(contains(error_of([&] { read_records(custom, DatasetOptions{}); }),
                       "missing field \"instruction\""));
  EXPECT_TRUE(contains(error_of([] { read_records("/nonexistent.jsonl", DatasetOptions{}); }),
                       "/nonexistent.jsonl"));
  EXPECT_EQ(dataset_kind_from_name("chat"), DatasetKind::kChat);
  EXPECT_TRUE(contains(error_of([] { dataset_kind_from_name("csv"); }), "csv"));
  EXPECT_TRUE(contains(error_of([] { dataset_kind_from_name("csv"); }), "expected one of instruct, chat, text"));
  EXPECT_STREQ(dataset_kind_name(DatasetKind::kText), "text");
}

}  // namespace
}  // namespace qlora::data
