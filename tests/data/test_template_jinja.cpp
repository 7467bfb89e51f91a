// template_jinja(kind) against render_chat(kind): the Jinja each hand-written kind is served with
// (the GGUF export's tokenizer.chat_template) renders the text the run trained on, conversation by
// conversation, and its generation prompt is the text before the answer.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "qlora/data/chat_template.h"
#include "qlora/data/templates.h"

namespace qlora::data {
namespace {

struct Case {
  std::vector<Message> messages;
  const char* what;
};

std::vector<Case> conversations() {
  return {
      {{{"user", "Say hi."}, {"assistant", "hi"}}, "one turn"},
      {{{"user", "  spaced question \n"}, {"assistant", "\n answer with spaces  "}}, "untrimmed contents"},
      {{{"system", "Be brief."}, {"user", "a"}, {"assistant", "b"}, {"user", "c"}, {"assistant", "d"}},
       "system and two turns"},
      {{{"user", "q1"}, {"assistant", "<think>\nr1\n</think>\n\nx1"}, {"user", "q2"},
        {"assistant", "<think>r2</think>x2"}},
       "answers with think blocks"},
      {{{"user", "q"}, {"assistant", "a"}, {"user", "<tool_response>42</tool_response>"}, {"assistant", "done"}},
       "a tool response after the query"},
  };
}

// render_chat's text with the BOS/EOS ids spelled, plus the EOS that add_eos puts after the last
// answer where the kind's answers end with EOS.
std::string spelled(TemplateKind kind, const std::vector<Segment>& segments, const Tokenizer& tok) {
  std::string text;
  for (const Segment& s : segments)
    text += (s.bos_before ? tok.id_to_piece(tok.bos_id()) : "") + s.text + (s.eos_after ? tok.id_to_piece(tok.eos_id()) : "");
  if (kind == TemplateKind::kAlpaca || kind == TemplateKind::kLlama2Chat) text += tok.id_to_piece(tok.eos_id());
  return text;
}

// The segments before the last answer: what a generation prompt renders.
std::string prompt_of(const std::vector<Segment>& segments, const Tokenizer& tok) {
  std::string text;
  size_t last_answer = segments.size();
  while (last_answer > 0 && segments[last_answer - 1].is_prompt) --last_answer;
  for (size_t k = 0; k + 1 < last_answer; ++k)
    text += (segments[k].bos_before ? tok.id_to_piece(tok.bos_id()) : "") + segments[k].text +
            (segments[k].eos_after ? tok.id_to_piece(tok.eos_id()) : "");
  return text;
}

TEST(TemplateJinja, EveryKindRendersWhatRenderChatTrains) {
  const Tokenizer tok = test_fixtures::fixture_tokenizer();
  int compared = 0;
  for (const auto& [kind, name] : kTemplateKindNames) {
    if (kind == TemplateKind::kAuto) continue;
    const ChatTemplate t = ChatTemplate::from_source(template_jinja(kind), std::string(name), tok);
    for (const Case& c : conversations()) {
      std::vector<Segment> segments;
      try {
        segments = render_chat(kind, c.messages);
      } catch (const std::invalid_argument&) {
        continue;  // alpaca: one turn, no system
      }
      const std::string where = std::string(name) + ", " + c.what;
      EXPECT_EQ(t.render(messages_json(c.messages), false), spelled(kind, segments, tok)) << where;
      std::vector<Message> asked(c.messages.begin(), c.messages.end() - 1);
      EXPECT_EQ(t.render(messages_json(asked), true), prompt_of(segments, tok)) << where;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 8 * 5 + 2);  // alpaca: the two one-turn conversations
}

TEST(TemplateJinja, EndOfTurnIsTheKinds) {
  const Tokenizer tok = test_fixtures::fixture_tokenizer();
  EXPECT_EQ(ChatTemplate::from_source(template_jinja(TemplateKind::kChatML), "chatml", tok).end_of_turn(), "<|im_end|>");
  EXPECT_EQ(ChatTemplate::from_source(template_jinja(TemplateKind::kGemma), "gemma", tok).end_of_turn(), "<end_of_turn>");
  EXPECT_EQ(ChatTemplate::from_source(template_jinja(TemplateKind::kAlpaca), "alpaca", tok).end_of_turn(), "</s>");
}

// A model's chat template is untrusted input: one that runs away (issue 36: `'a' * 2000000000`
// took 52 s and 6.2 GB, then std::bad_alloc) stops at once with an error that names the file, the
// key and the line, as every other error of a model file does.
TEST(TemplateJinja, ARunawayTemplateNamesTheFileKeyAndLine) {
  const std::string dir = testing::TempDir() + "qlora_runaway_template";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(test_fixtures::data_dir() + "/tokenizer/tokenizer.model", dir + "/tokenizer.model",
                             std::filesystem::copy_options::overwrite_existing);
  const std::pair<const char*, const char*> runaway[] = {
      {"{{ bos_token }}\n{{ 'a' * 2000000000 }}", ":2:"},
      {"{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", ":1:"}};
  for (const auto& [source, line] : runaway) {
    std::ofstream(dir + "/tokenizer_config.json") << nlohmann::json{{"chat_template", source}}.dump();
    const Tokenizer tok = Tokenizer::open(dir + "/tokenizer.model");
    const auto t = ChatTemplate::find(tok);
    ASSERT_TRUE(t.has_value());
    const std::string error = test_fixtures::error_of([&] { t->render(nlohmann::ordered_json::array(), true); });
    EXPECT_NE(error.find(dir + "/tokenizer_config.json (chat_template)" + line), std::string::npos) << error;
    EXPECT_NE(error.find("budget"), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace qlora::data
