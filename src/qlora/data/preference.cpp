#include "qlora/data/preference.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "qlora/data/chat_template.h"
#include "qlora/data/data_files.h"
#include "qlora/data/record_formats.h"
#include "qlora/data/record_images.h"
#include "qlora/data/sample_images.h"

namespace qlora::data {
namespace {
using json = nlohmann::json;

// A record's messages under `key` ("chosen[2]: ..." in errors), roles canonical.
std::vector<Message> messages_at(const json& record, const std::string& key, const DatasetOptions& options) {
  DatasetOptions o = options;
  o.messages_field = key;
  return chat_messages(record, o);
}

std::string string_at(const json& record, const std::string& key) {
  const auto it = record.find(key);
  if (it == record.end()) throw std::invalid_argument("missing field \"" + key + "\"");
  if (!it->is_string()) throw std::invalid_argument("field \"" + key + "\" is " + it->type_name() + ", expected a string");
  return it->get<std::string>();
}

bool same_message(const Message& a, const Message& b) {
  return a.role == b.role && a.content == b.content && a.reasoning == b.reasoning;
}

// The prompt and each response as messages, in whichever form the record has.
struct PairMessages {
  std::vector<Message> prompt, chosen, rejected;
};

// A string prompt beside a record-level "images" list as the user message it is, so that its "<image>"
// placeholders are read as a chat record's are (record_formats.h, record_images.h).
json with_prompt_message(const json& record) {
  if (!record.is_object() || !record.contains("images") || !record.contains("prompt") || !record["prompt"].is_string())
    return record;
  json r = record;
  r["prompt"] = json::array({json{{"role", "user"}, {"content", record["prompt"]}}});
  return r;
}

PairMessages pair_messages(const json& record, const DatasetOptions& options) {
  if (!record.is_object()) throw std::invalid_argument(std::string("record is ") + record.type_name() + ", expected an object");
  for (const char* key : {"chosen", "rejected"})
    if (!record.contains(key))
      throw std::invalid_argument(std::string("missing field \"") + key +
                                  "\" (preference records hold \"chosen\" and \"rejected\", with \"prompt\" or a "
                                  "shared conversation start)");
  PairMessages p;
  const bool strings = record["chosen"].is_string();
  const auto response = [&](const char* key) {
    return strings ? std::vector<Message>{Message{"assistant", string_at(record, key)}} : messages_at(record, key, options);
  };
  p.chosen = response("chosen");
  p.rejected = response("rejected");
  if (strings || record.contains("prompt")) {
    p.prompt = !record.contains("prompt") || record["prompt"].is_string()
                   ? std::vector<Message>{Message{"user", string_at(record, "prompt")}}
                   : messages_at(record, "prompt", options);
    return p;
  }
  // The shared leading messages are the prompt (TRL's extract_prompt).
  size_t n = 0;
  while (n < p.chosen.size() && n < p.rejected.size() && same_message(p.chosen[n], p.rejected[n])) ++n;
  if (n == 0) throw std::invalid_argument("\"chosen\" and \"rejected\" share no leading message: no prompt to train on");
  p.prompt.assign(p.chosen.begin(), p.chosen.begin() + static_cast<std::ptrdiff_t>(n));
  p.chosen.erase(p.chosen.begin(), p.chosen.begin() + static_cast<std::ptrdiff_t>(n));
  p.rejected.erase(p.rejected.begin(), p.rejected.begin() + static_cast<std::ptrdiff_t>(n));
  return p;
}

int64_t image_parts(const std::vector<Message>& messages) {
  int64_t n = 0;
  for (const Message& m : messages) n += std::count_if(m.parts.begin(), m.parts.end(), [](const ContentPart& c) { return c.image; });
  return n;
}

// The prompt's images, read as a chat record's (record_images.h): under "prompt", or in the shared
// conversation start. Both sequences carry them; a response holds none (only text is scored).
std::vector<RecordImage> prompt_images(const json& record, const PairMessages& m, const std::string& base_dir) {
  if (image_parts(m.chosen) + image_parts(m.rejected) > 0)
    throw std::invalid_argument("a response holds an image: only the prompt's images are supported (the responses "
                                "are scored text)");
  return record_images(record, record.contains("prompt") ? "prompt" : "chosen", base_dir);
}

int64_t assistant_turns(const std::vector<Message>& messages) {
  return std::count_if(messages.begin(), messages.end(), [](const Message& m) { return m.role == "assistant"; });
}

// prompt + response rendered, untruncated; only the response's assistant turns trained (the
// template trains every assistant turn: those of the prompt become context).
std::vector<Segment> render_sequence(const std::vector<Message>& prompt, const std::vector<Message>& response,
                                     const char* which, const DatasetOptions& options) {
  if (response.empty()) throw std::invalid_argument(std::string("the ") + which + " response is empty");
  if (assistant_turns(response) == 0)
    throw std::invalid_argument(std::string("the ") + which + " response has no assistant message");
  std::vector<Message> all = prompt;
  all.insert(all.end(), response.begin(), response.end());
  std::vector<Segment> segments = options.chat_template ? options.chat_template->render_training(all)
                                                        : render_chat(options.prompt_template, all);
  const int64_t trained = std::count_if(segments.begin(), segments.end(), [](const Segment& s) { return !s.is_prompt; });
  int64_t context = trained - assistant_turns(response);  // the prompt's trained segments, first
  if (context != assistant_turns(prompt))
    throw std::invalid_argument(std::string("the template rendered ") + std::to_string(trained) +
                                " answer spans for " + std::to_string(assistant_turns(all)) +
                                " assistant messages; cannot tell the " + which + " response apart");
  for (Segment& s : segments)
    if (!s.is_prompt && context-- > 0) s.is_prompt = true;
  return segments;
}

// A rendered sequence tokenized whole (its image placeholders expanded to `processed`, the record's
// images processed once for both sequences).
Sample tokenize_sequence(const RenderedRecord& r, const std::vector<images::ProcessedImage>& processed,
                         const Tokenizer& tokenizer, const DatasetOptions& options) {
  DatasetOptions whole = options;
  whole.max_seq_len = 0;
  whole.train_on_input = false;
  if (r.images.empty()) return tokenize_segments(r.segments, tokenizer, whole);
  Sample s = tokenize_segments(expand_image_placeholders(r.segments, *options.image_processor, processed), tokenizer, whole);
  s.images = sample_images(r, processed);
  return s;
}

// Tokens before the first scored one: the prompt as this sequence spells it.
int64_t prompt_length(const Sample& s) {
  const auto it = std::find_if(s.labels.begin(), s.labels.end(), [](int64_t l) { return l != kIgnoreIndex; });
  if (it == s.labels.end()) throw std::invalid_argument("a response renders to no trained token");
  return it - s.labels.begin();
}

// Keeps `keep` prompt tokens (its end, after a leading BOS) and cuts the response to `budget`.
void cut(Sample& s, int64_t prompt_len, int64_t keep, int64_t budget, int64_t bos, int64_t eos) {
  if (keep < prompt_len) {
    const int64_t lead = bos >= 0 && !s.tokens.empty() && s.tokens[0] == bos ? 1 : 0;
    const int64_t drop = prompt_len - keep;
    s.tokens.erase(s.tokens.begin() + lead, s.tokens.begin() + lead + drop);
    s.labels.erase(s.labels.begin() + lead, s.labels.begin() + lead + drop);
    s.truncated = true;
  }
  if (static_cast<int64_t>(s.tokens.size()) - keep > budget) {
    s.tokens.resize(static_cast<size_t>(keep + budget));
    s.labels.resize(static_cast<size_t>(keep + budget));
    s.truncated = true;
    // An answer cut short was not finished: its last kept token must not teach "stop here".
    if (eos >= 0 && s.tokens.back() == eos) s.labels.back() = kIgnoreIndex;
  }
}

}  // namespace

PreferencePair preference_pair(const json& given, const std::string& origin, const Tokenizer& tokenizer,
                               const DatasetOptions& options, const PreferenceOptions& limits, const std::string& base_dir) {
  const json record = with_prompt_message(given);
  const PairMessages m = pair_messages(record, options);
  const std::vector<RecordImage> images = prompt_images(record, m, base_dir);
  const RenderedRecord chosen{origin, render_sequence(m.prompt, m.chosen, "chosen", options), images};
  const RenderedRecord rejected{origin, render_sequence(m.prompt, m.rejected, "rejected", options), images};
  const std::vector<images::ProcessedImage> processed = process_record_images(chosen, options);
  PreferencePair p;
  p.origin = origin;
  p.chosen = tokenize_sequence(chosen, processed, tokenizer, options);
  p.rejected = tokenize_sequence(rejected, processed, tokenizer, options);
  if (p.chosen.tokens == p.rejected.tokens) throw std::invalid_argument("\"chosen\" and \"rejected\" are the same");
  const int64_t prompt = std::min(prompt_length(p.chosen), prompt_length(p.rejected));
  const int64_t longest = std::max(p.chosen.tokens.size(), p.rejected.tokens.size());
  int64_t keep = prompt;
  if (limits.max_seq_len > 0 && longest > limits.max_seq_len) {
    keep = std::min(prompt, std::max<int64_t>(1, std::min(limits.max_prompt_len, limits.max_seq_len - 1)));
    const int64_t budget = limits.max_seq_len - keep;
    cut(p.chosen, prompt, keep, budget, tokenizer.bos_id(), tokenizer.eos_id());
    cut(p.rejected, prompt, keep, budget, tokenizer.bos_id(), tokenizer.eos_id());
    p.prompt_truncated = keep < prompt;
    p.response_truncated = static_cast<int64_t>(longest) - prompt > budget;
  }
  p.prompt_tokens = keep;
  if (!images.empty())  // truncation kept every image whole
    for (const Sample* s : {&p.chosen, &p.rejected})
      check_images_kept(*s, image_token_id(*options.image_processor, tokenizer), limits.max_seq_len);
  for (const Sample* s : {&p.chosen, &p.rejected})
    if (std::none_of(s->labels.begin(), s->labels.end(), [](int64_t l) { return l != kIgnoreIndex; }))
      throw std::invalid_argument("a response has no token left after truncation to data.max_seq_len = " +
                                  std::to_string(limits.max_seq_len) + " (raise it, or lower dpo.max_prompt_len)");
  return p;
}

std::vector<PreferencePair> load_preference_pairs(const std::string& path, const Tokenizer& tokenizer,
                                                  const DatasetOptions& options, const PreferenceOptions& limits) {
  std::vector<PreferencePair> out;
  for (const std::string& file : expand_data_path(path)) {
    const std::string dir = std::filesystem::path(file).parent_path().string();  // images' relative paths
    read_json_records(file, [&](const json& j, const std::string& origin) {
      out.push_back(preference_pair(j, origin, tokenizer, options, limits, dir));
    });
  }
  if (out.empty()) throw std::invalid_argument(path + ": no preference pairs");
  return out;
}

}  // namespace qlora::data
