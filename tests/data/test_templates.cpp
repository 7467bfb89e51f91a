// The model chat templates: text and mask of each kind, written out from the models' own Jinja
// templates (tests/data/chat_templates/); tests/conformance/test_chat_templates.py compares the
// same kinds with transformers' rendering on many more conversations.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "qlora/data/templates.h"

namespace qlora::data {
namespace {

// Each segment as "P:" (prompt) or "T:" (trained) + its text, "+EOS" when an EOS id follows.
std::vector<std::string> shown(const std::vector<Segment>& segments) {
  std::vector<std::string> out;
  for (const auto& s : segments) {
    EXPECT_FALSE(s.bos_before);  // BOS is the dataset's add_bos, never a template's
    out.push_back((s.is_prompt ? "P:" : "T:") + s.text + (s.eos_after ? "+EOS" : ""));
  }
  return out;
}

// A conversation: the system message when given, then user and assistant alternating.
std::vector<Message> chat(std::initializer_list<const char*> turns, const char* system = nullptr) {
  std::vector<Message> m;
  if (system != nullptr) m.push_back({"system", system});
  bool user = true;
  for (const char* t : turns) {
    m.push_back({user ? "user" : "assistant", t});
    user = !user;
  }
  return m;
}

using Shown = std::vector<std::string>;
const char* const kLlamaUser = "<|start_header_id|>user<|end_header_id|>\n\n";
const char* const kLlamaAnswer = "<|start_header_id|>assistant<|end_header_id|>\n\n";

TEST(ChatTemplates, NamesRoundTrip) {
  for (const auto& e : kTemplateKindNames) EXPECT_EQ(template_kind_from_name(e.name), e.value) << e.name;
  EXPECT_EQ(template_name(TemplateKind::kLlama31Chat), "llama3.1-chat");
  EXPECT_EQ(template_name(TemplateKind::kMistralV03), "mistral-v0.3");
}

// Meta-Llama-3-8B-Instruct's template trims every content (`| trim`).
TEST(ChatTemplates, Llama3TrimsContent) {
  const auto s = render_chat(TemplateKind::kLlama3Chat, chat({" Hi\n", "\n Hello \t"}));
  EXPECT_EQ(shown(s), (Shown{std::string("P:") + kLlamaUser + "Hi<|eot_id|>" + kLlamaAnswer, "T:Hello<|eot_id|>"}));
}

// Llama-3.1's template always writes the system header with its knowledge and date lines.
TEST(ChatTemplates, Llama31SystemHeaderWithOrWithoutSystem) {
  const std::string header =
      "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
      "Today Date: 26 Jul 2024\n\n";
  auto s = render_chat(TemplateKind::kLlama31Chat, chat({"Hi", "Hello"}));
  EXPECT_EQ(shown(s), (Shown{"P:" + header + "<|eot_id|>" + kLlamaUser + "Hi<|eot_id|>" + kLlamaAnswer,
                             "T:Hello<|eot_id|>"}));
  s = render_chat(TemplateKind::kLlama31Chat, chat({"Hi", "Hello"}, " Be brief. "));
  EXPECT_EQ(shown(s)[0], "P:" + header + "Be brief.<|eot_id|>" + kLlamaUser + "Hi<|eot_id|>" + kLlamaAnswer);
}

TEST(ChatTemplates, Qwen25DefaultSystemOnlyWithoutOne) {
  auto s = render_chat(TemplateKind::kQwen25, chat({"Hi", " Hello "}));
  EXPECT_EQ(shown(s), (Shown{"P:<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                             "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                             "T: Hello <|im_end|>\n"}));
  s = render_chat(TemplateKind::kQwen25, chat({"Hi", "Hello"}, "Be brief."));
  EXPECT_EQ(shown(s)[0], "P:<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                         "<|im_start|>assistant\n");
  // Plain ChatML writes no default system message.
  EXPECT_EQ(shown(render_chat(TemplateKind::kChatML, chat({"Hi", "Hello"})))[0],
            "P:<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

// Qwen3: earlier answers lose their reasoning; the last gets a <think> block, empty if it has none.
TEST(ChatTemplates, Qwen3ThinkBlocks) {
  auto s = render_chat(TemplateKind::kQwen3, chat({"q1", "<think>\nr1\n</think>\n\na1", "q2", "a2"}));
  EXPECT_EQ(shown(s), (Shown{"P:<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n", "T:a1<|im_end|>\n",
                             "P:<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n",
                             "T:<think>\n\n</think>\n\na2<|im_end|>\n"}));
  s = render_chat(TemplateKind::kQwen3, chat({"q", "<think>\n\nwhy\n</think>\n\n\nbecause"}));
  EXPECT_EQ(shown(s)[1], "T:<think>\nwhy\n</think>\n\nbecause<|im_end|>\n");
  // A user message that is a tool response does not end the query: the answer before it keeps its
  // reasoning.
  s = render_chat(TemplateKind::kQwen3,
                  chat({"q", "<think>r</think>a", "<tool_response>\nx\n</tool_response>", "done"}));
  EXPECT_EQ(shown(s)[1], "T:<think>\nr\n</think>\n\na<|im_end|>\n");
}

// Gemma 3 folds the system message (untrimmed) into the first user turn and trims contents as
// Python's str.strip() does: unicode spaces too, but not U+200B, which is no space to Python.
TEST(ChatTemplates, GemmaFoldsSystemAndTrims) {
  const auto s = render_chat(TemplateKind::kGemma,
                             chat({" Hi ", "\u3000Hello\u00a0\n", "\u200bBye", ""}, " Be brief."));
  EXPECT_EQ(shown(s), (Shown{"P:<start_of_turn>user\n Be brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n",
                             "T:Hello<end_of_turn>\n",
                             "P:<start_of_turn>user\n\u200b" "Bye<end_of_turn>\n<start_of_turn>model\n",
                             "T:<end_of_turn>\n"}));
}

// Mistral v0.3: no space before [/INST]; " " + trimmed answer, then EOS after every answer; the
// system message of a conversation ending with an answer is dropped, as the template drops it.
TEST(ChatTemplates, MistralV03) {
  const auto s = render_chat(TemplateKind::kMistralV03, chat({" Hi", " Hello \n", "Bye", "Ok"}, "Be brief."));
  EXPECT_EQ(shown(s), (Shown{"P:[INST]  Hi[/INST]", "T: Hello+EOS", "P:[INST] Bye[/INST]", "T: Ok+EOS"}));
}

TEST(ChatTemplates, InstructRecordIsOneUserTurn) {
  const auto s = render_instruct(TemplateKind::kGemma, {"Add the numbers.", "1 + 2", "3"});
  EXPECT_EQ(shown(s), (Shown{"P:<start_of_turn>user\nAdd the numbers.\n\n1 + 2<end_of_turn>\n<start_of_turn>model\n",
                             "T:3<end_of_turn>\n"}));
}

}  // namespace
}  // namespace qlora::data
