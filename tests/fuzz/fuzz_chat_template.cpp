// A chat template (the Jinja a model's tokenizer_config.json carries) from untrusted bytes:
// parsed, then rendered over a conversation as data.template = "auto" renders one (messages with
// a system turn, tools, bos/eos tokens, add_generation_prompt).
#include <cstdint>
#include <exception>
#include <string_view>

#include "qlora/jinja/template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>"},
                 {"role": "assistant", "content": "Hello.", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                 {"role": "user", "content": [{"type": "text", "text": "again"}]}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true})");
  try {
    const auto t = qlora::jinja::Template::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    qlora::jinja::RenderOptions o;
    o.now_unix_seconds = 0;
    // A tenth of the default budget: each input still ends within a second under ASan (the
    // budget's errors are what the corpus's budget_*.jinja inputs reach), so the fuzzer explores.
    o.budget.max_steps /= 10;
    o.budget.max_bytes /= 10;
    o.budget.max_string_bytes /= 10;
    (void)t.render(context, o);
  } catch (const std::exception&) {
  }
  return 0;
}
