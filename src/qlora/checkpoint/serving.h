// How a checkpoint directory is served: the chat template, whether prompts start with BOS, and the
// ids generation stops at. `qlora generate`, the GGUF export (tokenizer.chat_template,
// tokenizer.ggml.add_bos_token) and the Ollama Modelfile beside it (PARAMETER stop) all read them
// here, so what llama.cpp or Ollama serves is what the run trained on and what qlora generates.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qlora/data/chat_template.h"
#include "qlora/data/tokenizer.h"

namespace qlora::checkpoint {

struct Serving {
  // The run's template: the model's own it recorded (data.template = "auto": qlora.json's
  // prompt.chat_template), or its hand-written kind as Jinja (data::template_jinja); else, for a
  // model qlora never trained or a plain-text run, the directory's own. nullopt when there is none.
  std::optional<data::ChatTemplate> chat_template;
  std::string trained_kind;  // the hand-written data.template the run recorded; "" otherwise
  // The end of an answer, trimmed ("<|im_end|>", "<|eot_id|>", "</s>").
  std::string end_of_turn;
  // Whether a prompt's ids start with BOS: a hand-written template's run's data.add_bos (qlora.json),
  // else the tokenizer's own rule (or true where the run forced BOS).
  bool add_bos = false;
  std::vector<int64_t> stop_ids;  // see stop_ids()
};

// `dir`'s serving format; `tok` is its tokenizer. Errors name qlora.json or the template's file.
Serving serving_format(const std::string& dir, const data::Tokenizer& tok);

// What generation stops at, each id once, in this order: the tokenizer's EOS and end of turn
// (Llama-3's <|eot_id|>), the eos_token_id(s) of config.json and generation_config.json (Llama-3
// lists several; instruct models list their end of turn), and `end_of_turn` where it is one token.
std::vector<int64_t> stop_ids(const std::string& dir, const data::Tokenizer& tok, const std::string& end_of_turn);

}  // namespace qlora::checkpoint
