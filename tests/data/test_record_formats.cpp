// data.format = "chat" reads OpenAI messages and ShareGPT conversations alike; mapped field names;
// a file of another format than the configured one is named with the key to set.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "qlora/data/chat_template.h"
#include "qlora/data/dataset.h"
#include "qlora/io/read_file.h"
#include "qlora/data/record_formats.h"

#include "fixtures.h"

namespace qlora::data {
namespace {

using test_fixtures::data_dir;
using test_fixtures::error_of;
using test_fixtures::fixture_tokenizer;

// In the test's temporary directory, apart from the other data tests' files.
std::string write_temp(const std::string& name, const std::string& text) {
  return test_fixtures::write_temp("formats_" + name, text);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

DatasetOptions chat_options(TemplateKind t = TemplateKind::kChatML) {
  DatasetOptions o;
  o.kind = DatasetKind::kChat;
  o.prompt_template = t;
  return o;
}

void expect_same_segments(const std::vector<Segment>& a, const std::vector<Segment>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].text, b[i].text) << i;
    EXPECT_EQ(a[i].is_prompt, b[i].is_prompt) << i;
    EXPECT_EQ(a[i].bos_before, b[i].bos_before) << i;
    EXPECT_EQ(a[i].eos_after, b[i].eos_after) << i;
  }
}

const char* kOpenAi =
    R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},)"
    R"( {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},)"
    R"( {"role": "assistant", "content": "Ok"}]})";
const char* kShareGpt =
    R"({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},)"
    R"( {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Ok"}]})";

TEST(RecordFormats, ShareGptAndOpenAiGiveTheSameSegments) {
  const auto openai = write_temp("openai.jsonl", std::string(kOpenAi) + "\n");
  const auto sharegpt = write_temp("sharegpt.jsonl", std::string(kShareGpt) + "\n");
  for (const auto t : {TemplateKind::kChatML, TemplateKind::kLlama2Chat, TemplateKind::kLlama3Chat, TemplateKind::kGemma}) {
    const auto a = read_records(openai, chat_options(t));
    const auto b = read_records(sharegpt, chat_options(t));
    ASSERT_EQ(a.size(), 1u);
    ASSERT_EQ(b.size(), 1u);
    expect_same_segments(a[0].segments, b[0].segments);
    EXPECT_GE(a[0].segments.size(), 2u);
  }
  // The turn keys decide, not the list's key: from/value turns under "messages" read the same.
  auto mixed = nlohmann::json::parse(kShareGpt);
  mixed["messages"] = mixed["conversations"];
  mixed.erase("conversations");
  expect_same_segments(render_record(mixed, chat_options()), render_record(nlohmann::json::parse(kOpenAi), chat_options()));
}

TEST(RecordFormats, ShareGptSpeakerNames) {
  for (const char* n : {"human", "user", "prompter"}) EXPECT_EQ(sharegpt_role(n), "user") << n;
  for (const char* n : {"gpt", "assistant", "model", "bot", "chatgpt"}) EXPECT_EQ(sharegpt_role(n), "assistant") << n;
  EXPECT_EQ(sharegpt_role("system"), "system");
  const auto msg = error_of([] { sharegpt_role("narrator"); });
  EXPECT_TRUE(contains(msg, "'narrator'")) << msg;
  EXPECT_TRUE(contains(msg, "human, user, prompter, gpt")) << msg;

  const auto bad = write_temp("narrator.jsonl",
                              R"({"conversations": [{"from": "human", "value": "a"}, {"from": "narrator", "value": "b"}]})"
                              "\n");
  const auto e = error_of([&] { read_records(bad, chat_options()); });
  EXPECT_TRUE(contains(e, bad + ": line 1: conversations[1]: \"from\" is 'narrator'")) << e;
  // OpenAI roles stay strict: "bot" is no OpenAI role.
  const auto strict = write_temp("bot.jsonl",
                                 R"({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})"
                                 "\n");
  EXPECT_TRUE(contains(error_of([&] { read_records(strict, chat_options()); }), "role 'bot'"));
}

TEST(RecordFormats, TurnWithoutSpeakerNamesBothConventions) {
  const auto msg = error_of([] { render_record(nlohmann::json::parse(R"({"conversations": [{"value": "a"}]})"), chat_options()); });
  EXPECT_TRUE(contains(msg, "conversations[0]: missing field \"role\"")) << msg;
  EXPECT_TRUE(contains(msg, "\"from\" (ShareGPT")) << msg;
  const auto value = error_of([] { render_record(nlohmann::json::parse(R"({"conversations": [{"from": "human"}]})"), chat_options()); });
  EXPECT_TRUE(contains(value, "conversations[0]: missing field \"value\"")) << value;
}

TEST(RecordFormats, MappedFieldNames) {
  auto o = chat_options();
  o.messages_field = "dialog";
  auto dialog = nlohmann::json::parse(kShareGpt);
  dialog["dialog"] = dialog["conversations"];
  dialog.erase("conversations");
  expect_same_segments(render_record(dialog, o), render_record(nlohmann::json::parse(kOpenAi), chat_options()));

  DatasetOptions t;
  t.kind = DatasetKind::kText;
  t.text_field = "body";
  const auto segs = render_record(nlohmann::json::parse(R"({"body": "Once upon a time."})"), t);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].text, "Once upon a time.");
  EXPECT_FALSE(segs[0].is_prompt);

  DatasetOptions q;
  q.instruction_field = "question";
  q.input_field = "context";
  q.output_field = "answer";
  const auto mapped = render_record(nlohmann::json::parse(R"({"question": "Q?", "context": "C", "answer": "A."})"), q);
  expect_same_segments(mapped, render_instruct(TemplateKind::kAlpaca, {"Q?", "C", "A."}));
}

TEST(RecordFormats, MissingMappedFieldNamesTheKeyToSet) {
  DatasetOptions q;
  q.output_field = "answer";
  const auto path = write_temp("answer.jsonl", R"({"instruction": "Q?", "response": "A."})" "\n");
  const auto msg = error_of([&] { read_records(path, q); });
  EXPECT_TRUE(contains(msg, path + ": line 1: missing field \"answer\" (set data.output_field")) << msg;
  EXPECT_TRUE(contains(msg, "keys instruction, response")) << msg;

  auto o = chat_options();
  o.messages_field = "dialog";
  const auto d = error_of([&] { render_record(nlohmann::json::parse(kShareGpt), o); });
  EXPECT_TRUE(contains(d, "missing field \"dialog\" (set data.messages_field")) << d;
  const auto auto_key = error_of([] { render_record(nlohmann::json::parse(R"({"turns": []})"), chat_options()); });
  EXPECT_TRUE(contains(auto_key, "missing field \"messages\" (or \"conversations\") (set data.messages_field")) << auto_key;

  DatasetOptions t;
  t.kind = DatasetKind::kText;
  t.text_field = "body";
  const auto tx = error_of([&] { render_record(nlohmann::json::parse(R"({"text": "x"})"), t); });
  EXPECT_TRUE(contains(tx, "missing field \"body\" (set data.text_field")) << tx;
  q = DatasetOptions{};
  q.instruction_field = "prompt";
  const auto in = error_of([&] { render_record(nlohmann::json::parse(R"({"instruction": "x", "output": "y"})"), q); });
  EXPECT_TRUE(contains(in, "missing field \"prompt\" (set data.instruction_field")) << in;
}

// Each configured format on each other format's file: the error names what the file looks like,
// the key that shows it and the data.format to set, with the file and line.
TEST(RecordFormats, FileOfAnotherFormatSaysWhichAndTheKeyToSet) {
  struct Case {
    DatasetKind configured;
    const char* record;
    const char* want;
  };
  const Case cases[] = {
      {DatasetKind::kInstruct, kShareGpt, "this looks like a chat file (key 'conversations'); set data.format = \"chat\""},
      {DatasetKind::kInstruct, kOpenAi, "this looks like a chat file (key 'messages'); set data.format = \"chat\""},
      {DatasetKind::kInstruct, R"({"text": "x"})", "this looks like a text file (key 'text'); set data.format = \"text\""},
      {DatasetKind::kChat, R"({"instruction": "a", "output": "b"})",
       "this looks like an instruct file (key 'instruction'); set data.format = \"instruct\""},
      {DatasetKind::kChat, R"({"text": "x"})", "this looks like a text file (key 'text'); set data.format = \"text\""},
      {DatasetKind::kText, kShareGpt, "this looks like a chat file (key 'conversations'); set data.format = \"chat\""},
      {DatasetKind::kText, R"({"instruction": "a", "output": "b"})",
       "this looks like an instruct file (key 'instruction'); set data.format = \"instruct\""},
  };
  for (const auto& c : cases) {
    DatasetOptions o = c.configured == DatasetKind::kChat ? chat_options() : DatasetOptions{};
    o.kind = c.configured;
    const auto path = write_temp("mismatch.jsonl", std::string("\n") + c.record + "\n");
    const auto msg = error_of([&] { read_records(path, o); });
    EXPECT_TRUE(contains(msg, path + ": line 2: " + c.want)) << dataset_kind_name(c.configured) << ": " << msg;
  }
}

// An assistant turn's reasoning is read under the names transformers reads it by, rendered by a
// model's own template as apply_chat_template renders it, and refused by a hand-written kind.
TEST(RecordFormats, ReasoningReachesTheModelsTemplateOnly) {
  const auto record = [](const std::string& field) {
    return nlohmann::json::parse(R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant",
        "content": "4", )" + field + "}]}");
  };
  for (const std::string field : {R"("reasoning_content": "Two and two make four.")",
                                  R"("reasoning_content": null, "thinking": "Two and two make four.")",
                                  R"("reasoning": "Two and two make four.")"}) {
    const auto m = chat_messages(record(field), chat_options());
    ASSERT_EQ(m.size(), 2u);
    EXPECT_FALSE(m[0].reasoning);
    EXPECT_EQ(m[1].reasoning.value_or("-"), "Two and two make four.") << field;
    // Qwen3's own template; the text is transformers 5.23's render_jinja_template of the same messages.
    const std::string qwen3 = data_dir() + "/chat_templates/Qwen3-0.6B.jinja";
    const auto t = ChatTemplate::from_source(*io::read_file(qwen3), qwen3, fixture_tokenizer(), nlohmann::ordered_json::object());
    EXPECT_EQ(t.render(messages_json(m), false),
              "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nTwo and two make four.\n</think>\n\n"
              "4<|im_end|>\n");
    const std::string e = error_of([&] { render_chat(TemplateKind::kQwen3, m); });
    EXPECT_TRUE(contains(e, "message 1 has reasoning") && contains(e, "data.template = \"qwen3\"") &&
                contains(e, "\"auto\""))
        << e;
  }
}

}  // namespace
}  // namespace qlora::data
