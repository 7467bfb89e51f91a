// GRPO prompt records (data/prompts.h): string prompts as written, conversations rendered up to the
// opened answer turn by a hand-written template and by the model's own, every field kept for the
// rewards, and bad records refused saying what is wrong.
#include "qlora/data/prompts.h"

#include <gtest/gtest.h>

#include "fixtures.h"
#include "qlora/data/chat_template.h"
#include "qlora/data/record_formats.h"
#include "qlora/io/read_file.h"

namespace qlora::data {
namespace {
using namespace test_fixtures;
using json = nlohmann::json;

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

DatasetOptions prompt_options(TemplateKind kind) {
  DatasetOptions o;
  o.kind = DatasetKind::kPrompt;
  o.prompt_template = kind;
  o.add_bos = true;
  o.add_eos = true;  // never added to a prompt
  return o;
}

TEST(Prompts, StringPromptIsTheTextAsWritten) {
  const Tokenizer tok = fixture_tokenizer();
  const json rec = {{"prompt", "Add the numbers.\n35 + 4\n"}, {"answer", 39}, {"source", "tiny"}};
  const PromptRecord p = prompt_record(rec, "p.jsonl: line 1", tok, prompt_options(TemplateKind::kChatML));
  EXPECT_EQ(p.text, "Add the numbers.\n35 + 4\n");
  EXPECT_EQ(p.tokens, tok.encode_with_special(p.text, tok.adds_bos(), false));
  EXPECT_EQ(p.record, rec);  // every field, for the rewards
  EXPECT_EQ(p.end_of_turn, "");
  EXPECT_EQ(p.origin, "p.jsonl: line 1");
}

TEST(Prompts, ConversationRenderedUpToTheOpenedAnswer) {
  const Tokenizer tok = fixture_tokenizer();
  const json rec = json::parse(R"({"prompt": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": "2+2?"}], "answer": "4"})");
  const PromptRecord p = prompt_record(rec, "x", tok, prompt_options(TemplateKind::kChatML));
  EXPECT_EQ(p.text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(p.end_of_turn, "<|im_end|>\n");
  ASSERT_FALSE(p.tokens.empty());
  EXPECT_EQ(p.tokens.front(), tok.bos_id());  // data.add_bos
  EXPECT_NE(p.tokens.back(), tok.eos_id());   // never EOS
  // ShareGPT turns too; alpaca renders a single user turn as its instruction.
  const json share = json::parse(R"({"prompt": [{"from": "human", "value": "Reverse the word.\n\nkite"}]})");
  const PromptRecord a = prompt_record(share, "x", tok, prompt_options(TemplateKind::kAlpaca));
  const std::string response = "\n\n### Response:\n";
  EXPECT_EQ(a.text.substr(a.text.size() - response.size()), response);
  EXPECT_CONTAINS(a.text, "### Instruction:\nReverse the word.\n\nkite");
}

TEST(Prompts, ModelsOwnTemplateWithTheGenerationPrompt) {
  const Tokenizer tok = fixture_tokenizer();
  const std::string qwen3 = data_dir() + "/chat_templates/Qwen3-0.6B.jinja";
  DatasetOptions o = prompt_options(TemplateKind::kAuto);
  o.chat_template = std::make_shared<const ChatTemplate>(
      ChatTemplate::from_source(*io::read_file(qwen3), qwen3, tok, nlohmann::ordered_json{{"enable_thinking", false}}));
  o.add_bos = false;
  const json rec = json::parse(R"({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"})");
  const PromptRecord p = prompt_record(rec, "x", tok, o);
  EXPECT_EQ(p.text, "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(p.end_of_turn, o.chat_template->end_of_turn());
}

TEST(Prompts, BadRecordsSayWhatIsWrong) {
  const Tokenizer tok = fixture_tokenizer();
  const DatasetOptions o = prompt_options(TemplateKind::kChatML);
  auto error = [&](const std::string& text) {
    return error_of([&] { prompt_record(json::parse(text), "x", tok, o); });
  };
  EXPECT_CONTAINS(error(R"({"question": "2+2?", "answer": 4})"), "missing field \"prompt\"");
  EXPECT_CONTAINS(error(R"({"prompt": 3})"), "field \"prompt\" is number, expected a string or a list of messages");
  EXPECT_CONTAINS(error(R"({"prompt": []})"), "field \"prompt\" is an empty conversation");
  EXPECT_CONTAINS(error(R"({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})"),
                  "ends with a message of role \"assistant\"");
  EXPECT_CONTAINS(error(R"({"prompt": [{"role": "user"}]})"), "prompt[0]: missing field \"content\"");
  DatasetOptions short_len = o;
  short_len.max_seq_len = 4;
  EXPECT_CONTAINS(error_of([&] { prompt_record(json{{"prompt", "a long prompt"}}, "x", tok, short_len); }),
                  "data.max_seq_len = 4 (prompt + completion) leaves no room for a completion");
  // A prompt file read as training data says so, and a training file read as prompts is named.
  EXPECT_CONTAINS(error_of([&] { render_record(json{{"prompt", "a"}}, o); }), "prompt records have no answer to train on");
  const std::string path = write_temp("prompts.jsonl", "{\"prompt\": \"a\"}\n{\"instruction\": \"b\", \"output\": \"c\"}\n");
  const std::string e = error_of([&] { load_prompts(path, tok, o); });
  EXPECT_CONTAINS(e, path + ": line 2: missing field \"prompt\"");
  DatasetOptions instruct;
  EXPECT_CONTAINS(error_of([&] { load_dataset(path, tok, instruct); }),
                  "line 1: this looks like a prompt file (key 'prompt'); set data.format = \"prompt\"");
}

}  // namespace
}  // namespace qlora::data
