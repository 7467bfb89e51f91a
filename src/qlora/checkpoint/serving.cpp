#include "qlora/checkpoint/serving.h"

#include <algorithm>

#include "qlora/checkpoint/export.h"
#include "qlora/models/decoder_config.h"

namespace qlora::checkpoint {

std::vector<int64_t> stop_ids(const std::string& dir, const data::Tokenizer& tok, const std::string& end_of_turn) {
  std::vector<int64_t> ids;
  const auto add = [&](int64_t id) {
    if (id >= 0 && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  add(tok.eos_id());
  add(tok.eot_id());
  for (const int64_t e : models::load_decoder_config(dir).eos_token_ids) add(e);
  for (const int64_t e : models::load_generation_eos_ids(dir)) add(e);
  if (!end_of_turn.empty()) {
    const auto eot = tok.encode(end_of_turn);
    if (eot.size() == 1) add(eot[0]);
  }
  return ids;
}

Serving serving_format(const std::string& dir, const data::Tokenizer& tok) {
  Serving s;
  const auto pf = read_prompt_format(dir);
  // A hand-written template's text starts after the run's BOS; a model's own template is rendered
  // and then tokenized as transformers does it, with the tokenizer's rule (or a forced BOS).
  const bool own_template = !pf || !pf->chat_template.empty();
  s.add_bos = own_template ? tok.adds_bos() || (pf && pf->add_bos) : pf->add_bos;
  if (pf && !pf->chat_template.empty()) {
    s.chat_template = data::ChatTemplate::from_source(pf->chat_template, dir + "/qlora.json (prompt.chat_template)", tok,
                                                      pf->template_kwargs);
  } else if (pf && !pf->template_name.empty() && pf->template_name != "auto") {
    s.trained_kind = pf->template_name;
    s.chat_template = data::ChatTemplate::from_source(data::template_jinja(data::template_kind_from_name(s.trained_kind)),
                                                      dir + "/qlora.json (template " + s.trained_kind + ")", tok);
  } else {
    s.chat_template = data::ChatTemplate::find(tok);
  }
  if (s.chat_template) s.end_of_turn = s.chat_template->end_of_turn();
  s.stop_ids = stop_ids(dir, tok, s.end_of_turn);
  return s;
}

}  // namespace qlora::checkpoint
