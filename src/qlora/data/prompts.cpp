#include "qlora/data/prompts.h"

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

// The conversation up to the opened answer turn, as the run's template renders it; its end of turn.
std::pair<std::vector<Segment>, std::string> render_conversation(std::vector<Message> m, const DatasetOptions& o) {
  if (m.empty()) throw std::invalid_argument("field \"prompt\" is an empty conversation");
  if (m.back().role != "user")
    throw std::invalid_argument("field \"prompt\" ends with a message of role \"" + m.back().role +
                                "\"; a prompt ends with the user's turn that the model answers");
  m.push_back({"assistant", std::string(kAnswerStandIn)});
  validate_messages(m);
  if (!o.chat_template) return cut_at_answer(render_chat(o.prompt_template, m));
  m.pop_back();
  return {{Segment{o.chat_template->render(messages_json(m), /*add_generation_prompt=*/true)}},
          o.chat_template->end_of_turn()};
}

}  // namespace

PromptRecord prompt_record(const json& record, const std::string& origin, const Tokenizer& tokenizer,
                           const DatasetOptions& options, const std::string& base_dir) {
  if (!record.is_object()) throw std::invalid_argument(std::string("record is ") + record.type_name() + ", expected an object");
  const auto it = record.find("prompt");
  if (it == record.end())
    throw std::invalid_argument("missing field \"prompt\" (prompt records hold \"prompt\": a string or a list of "
                                "messages, and the fields the rewards read, e.g. \"answer\")");
  PromptRecord p;
  p.origin = origin;
  p.record = record;
  if (it->is_string()) {
    // As transformers' tokenizer(prompt) and TRL's string prompts: the text as written, BOS as the
    // tokenizer adds it.
    p.text = it->get<std::string>();
    if (record.contains("images"))
      throw std::invalid_argument("a string \"prompt\" is the model's input as written; its \"images\" need the "
                                  "prompt as messages (their placeholders rendered by the model's chat template)");
    p.tokens = tokenizer.encode_with_special(p.text, tokenizer.adds_bos(), /*add_eos=*/false);
  } else if (it->is_array()) {
    DatasetOptions o = options;
    o.messages_field = "prompt";
    auto [segments, end_of_turn] = render_conversation(chat_messages(record, o), options);
    o.add_eos = false;
    o.max_seq_len = 0;
    const RenderedRecord r{origin, std::move(segments), record_images(record, "prompt", base_dir)};
    const std::vector<images::ProcessedImage> processed = process_record_images(r, options);
    const std::vector<Segment> expanded =
        r.images.empty() ? r.segments : expand_image_placeholders(r.segments, *options.image_processor, processed);
    p.text = join_segments(expanded);
    p.tokens = tokenize_segments(expanded, tokenizer, o).tokens;
    p.end_of_turn = std::move(end_of_turn);
    p.images = sample_images(r, processed);
  } else {
    throw std::invalid_argument(std::string("field \"prompt\" is ") + it->type_name() +
                                ", expected a string or a list of messages");
  }
  const int64_t n = static_cast<int64_t>(p.tokens.size());
  if (options.max_seq_len > 0 && n >= options.max_seq_len)
    throw std::invalid_argument("the prompt is " + std::to_string(n) + " tokens: data.max_seq_len = " +
                                std::to_string(options.max_seq_len) +
                                " (prompt + completion) leaves no room for a completion");
  return p;
}

std::vector<PromptRecord> load_prompts(const std::string& path, const Tokenizer& tokenizer,
                                       const DatasetOptions& options) {
  std::vector<PromptRecord> out;
  for (const std::string& file : expand_data_path(path)) {
    const std::string dir = std::filesystem::path(file).parent_path().string();  // images' relative paths
    read_json_records(file, [&](const json& j, const std::string& origin) {
      out.push_back(prompt_record(j, origin, tokenizer, options, dir));
    });
  }
  if (out.empty()) throw std::invalid_argument(path + ": no prompts");
  return out;
}

}  // namespace qlora::data
