// Each hand-written template kind as a Jinja chat template, for what serves a model trained on it
// (the GGUF export's tokenizer.chat_template): rendered with the model's bos_token / eos_token, it
// gives render_chat's text with the BOS and EOS ids spelled where the segments carry them and EOS
// after the last answer where the kind ends answers with EOS (add_eos). tests/data/test_templates.cpp
// renders both on the same conversations.
#include "qlora/data/templates.h"

#include <stdexcept>
#include <string>

namespace qlora::data {
namespace {

// The system message, if any, split off: `sys` its content ("" without one), `turns` the rest.
constexpr const char* kSplitSystem =
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set sys = messages[0].content -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set sys = '' -%}{%- set turns = messages -%}{%- endif -%}";

constexpr const char* kAlpaca =
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{{ 'Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\\n\\n### Instruction:\\n' + m.content + '\\n\\n### Response:\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ m.content + eos_token }}"
    "{%- else -%}{{ raise_exception('the alpaca template renders one instruction: no ' + m.role + ' message') }}"
    "{%- endif -%}{%- endfor -%}";

constexpr const char* kLlama2 =
    "{%- for m in turns -%}"
    "{%- if m.role == 'user' -%}"
    "{{ ('' if loop.first else bos_token) + '[INST] ' + ('<<SYS>>\\n' + sys + '\\n<</SYS>>\\n\\n' if loop.first and sys "
    "else '') + m.content + ' [/INST]' }}"
    "{%- else -%}{{ ' ' + m.content + ' ' + eos_token }}{%- endif -%}{%- endfor -%}";

constexpr const char* kLlama3Turns =
    "{%- for m in turns -%}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}";

constexpr const char* kLlama31System =
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\nToday Date: 26 Jul "
    "2024\\n\\n' + (sys | trim) + '<|eot_id|>' }}";

constexpr const char* kChatMLTurns =
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

// Qwen3: the last real user message ends the query; an answer after it keeps its reasoning in a
// <think> block when it is the last message or has reasoning; every other answer loses it.
constexpr const char* kQwen3 =
    "{%- set ns = namespace(query=messages | length - 1, found=false) -%}"
    "{%- for m in messages[::-1] -%}"
    "{%- if not ns.found and m.role == 'user' and not (m.content.startswith('<tool_response>') and "
    "m.content.endswith('</tool_response>')) -%}"
    "{%- set ns.found = true -%}{%- set ns.query = messages | length - 1 - loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.query and (loop.last or reasoning) -%}"
    "{%- set content = '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

constexpr const char* kGemma =
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else 'user') + '\\n' + (sys + '\\n\\n' if loop.first and "
    "sys else '') + (m.content | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}";

constexpr const char* kMistralV03 =
    "{%- for m in turns -%}"
    "{%- if m.role == 'user' -%}{{ '[INST] ' + m.content + '[/INST]' }}"
    "{%- else -%}{{ ' ' + (m.content | trim) + eos_token }}{%- endif -%}{%- endfor -%}";

}  // namespace

std::string template_jinja(TemplateKind kind) {
  const std::string split = kSplitSystem;
  switch (kind) {
    case TemplateKind::kAuto: throw std::logic_error("template_jinja: 'auto' is the model's own template");
    case TemplateKind::kAlpaca: return kAlpaca;
    case TemplateKind::kLlama2Chat: return split + kLlama2;
    case TemplateKind::kLlama3Chat: return "{%- set turns = messages -%}" + std::string(kLlama3Turns);
    case TemplateKind::kLlama31Chat: return split + kLlama31System + kLlama3Turns;
    case TemplateKind::kChatML: return kChatMLTurns;
    case TemplateKind::kQwen25:
      return "{%- if not messages or messages[0].role != 'system' -%}{{ '<|im_start|>system\\nYou are Qwen, created by "
             "Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif -%}" +
             std::string(kChatMLTurns);
    case TemplateKind::kQwen3: return kQwen3;
    case TemplateKind::kGemma: return split + kGemma;
    case TemplateKind::kMistralV03: return split + kMistralV03;
  }
  throw std::logic_error("template_jinja: unhandled template");
}

}  // namespace qlora::data
