#include "qlora/data/record_formats.h"
#include "qlora/data/chat_template.h"
#include "qlora/data/record_images.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <stdexcept>

namespace qlora::data {
namespace {

using nlohmann::json;

struct RoleAlias {
  const char* from;
  const char* role;
};
constexpr RoleAlias kShareGptRoles[] = {
    {"human", "user"},          {"user", "user"},       {"prompter", "user"},
    {"gpt", "assistant"},       {"assistant", "assistant"}, {"model", "assistant"},
    {"bot", "assistant"},       {"chatgpt", "assistant"},   {"system", "system"}};

// Another format's keys in `record`: the format and the key that gives it away.
struct FormatGuess {
  DatasetKind kind;
  std::string key;
};

std::optional<FormatGuess> guess_other_format(const json& record, DatasetKind configured) {
  const auto has = [&](const char* key, bool (json::*is)() const noexcept) {
    const auto it = record.find(key);
    return it != record.end() && ((*it).*is)();
  };
  std::optional<FormatGuess> g;
  if (has("messages", &json::is_array)) g = FormatGuess{DatasetKind::kChat, "messages"};
  else if (has("conversations", &json::is_array)) g = FormatGuess{DatasetKind::kChat, "conversations"};
  else if (has("instruction", &json::is_string)) g = FormatGuess{DatasetKind::kInstruct, "instruction"};
  else if (has("text", &json::is_string)) g = FormatGuess{DatasetKind::kText, "text"};
  else if (record.contains("chosen") && record.contains("rejected")) g = FormatGuess{DatasetKind::kPreference, "chosen"};
  else if (record.contains("prompt")) g = FormatGuess{DatasetKind::kPrompt, "prompt"};
  if (g && g->kind == configured) return std::nullopt;
  return g;
}

// "keys a, b, c" of an object, for errors about a field it lacks.
std::string keys_of(const json& record) {
  std::string out;
  size_t n = 0;
  for (auto it = record.begin(); it != record.end(); ++it, ++n) {
    if (n == 8) return out + ", ...";
    out += (out.empty() ? "keys " : ", ") + it.key();
  }
  return out.empty() ? "no keys" : out;
}

// A record without the field the configured format needs: it looks like another format (say
// which and the key to set), or the field is named otherwise (say which data.*_field maps it).
[[noreturn]] void throw_missing(const json& record, DatasetKind configured, const std::string& quoted_field,
                                const char* config_key) {
  if (const auto g = guess_other_format(record, configured)) {
    const std::string kind = dataset_kind_name(g->kind);
    const char* article = kind == "instruct" ? "an " : "a ";
    throw std::invalid_argument(std::string("this looks like ") + article + kind + " file (key '" + g->key + "'); set data.format = \"" +
                                kind + "\"");
  }
  throw std::invalid_argument("missing field " + quoted_field + " (set " + config_key +
                              " to the key that holds it; this record has " + keys_of(record) + ")");
}

std::string string_field(const json& obj, const std::string& key) {
  const auto& v = obj.at(key);
  if (!v.is_string()) {
    throw std::invalid_argument("field \"" + key + "\" is " + v.type_name() + ", expected a string");
  }
  return v.get<std::string>();
}

// A field of a record that the configured format needs; `config_key` maps its name.
std::string required_field(const json& record, DatasetKind kind, const std::string& key, const char* config_key) {
  if (!record.contains(key)) throw_missing(record, kind, "\"" + key + "\"", config_key);
  return string_field(record, key);
}

std::string optional_field(const json& record, const std::string& key) {
  const auto it = record.find(key);
  return it == record.end() || it->is_null() ? std::string() : string_field(record, key);
}

// Content given as parts (transformers' chat format): text parts and image parts (record_images.h
// reads their sources); `content` gets the text parts joined.
std::vector<ContentPart> content_parts(const json& content, std::string& text) {
  std::vector<ContentPart> parts;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& item = content[i];
    const std::string where = "content[" + std::to_string(i) + "]";
    if (!item.is_object()) throw std::invalid_argument(where + " is " + item.type_name() + ", expected an object");
    if (is_image_part(item)) {
      parts.push_back({"", true});
      continue;
    }
    const auto type = item.find("type");
    if (type == item.end() || *type != "text" || !item.contains("text") || !item.at("text").is_string())
      throw std::invalid_argument(where + ": expected {\"type\": \"text\", \"text\": ...} or an image part "
                                  "{\"type\": \"image\", \"image\": path}, got " + item.dump().substr(0, 120));
    parts.push_back({item.at("text").get<std::string>(), false});
    text += parts.back().text;
  }
  return parts;
}

// One turn: OpenAI's role/content, or ShareGPT's from/value (a turn with "from" and no "role").
// `placeholders`: the record lists its images ("images"), so "<image>" in a text marks one.
Message turn_message(const json& turn, bool placeholders) {
  if (!turn.contains("role") && !turn.contains("from")) {
    throw std::invalid_argument("missing field \"role\" (OpenAI, with \"content\") or \"from\" (ShareGPT, with "
                                "\"value\")");
  }
  const auto text = [&](const char* key) {
    if (!turn.contains(key)) throw std::invalid_argument(std::string("missing field \"") + key + "\"");
    return string_field(turn, key);
  };
  const char* body = turn.contains("role") ? "content" : "value";
  if (turn.contains(body) && turn.at(body).is_array()) {  // parts: text and images
    Message m{turn.contains("role") ? text("role") : sharegpt_role(text("from")), ""};
    m.parts = content_parts(turn.at(body), m.content);
    return m;
  }
  Message m = turn.contains("role") ? Message{text("role"), text("content")}
                                    : Message{sharegpt_role(text("from")), text("value")};
  if (placeholders && !(m.parts = placeholder_parts(m.content)).empty()) {
    m.content.clear();
    for (const ContentPart& part : m.parts) m.content += part.text;
  }
  for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
    if (const auto it = turn.find(key); it != turn.end() && !it->is_null()) {
      m.reasoning = string_field(turn, key);
      break;
    }
  }
  return m;
}

}  // namespace

std::string sharegpt_role(std::string_view from) {
  for (const auto& a : kShareGptRoles)
    if (from == a.from) return a.role;
  std::string names;
  for (const auto& a : kShareGptRoles) names += (names.empty() ? "" : ", ") + std::string(a.from);
  throw std::invalid_argument("\"from\" is '" + std::string(from) + "'; expected a ShareGPT speaker: " + names);
}

std::vector<Message> chat_messages(const json& record, const DatasetOptions& o) {
  std::string key = o.messages_field;
  if (key.empty()) key = record.contains("messages") ? "messages" : "conversations";
  const auto it = record.find(key);
  if (it == record.end()) {
    throw_missing(record, DatasetKind::kChat,
                  o.messages_field.empty() ? "\"messages\" (or \"conversations\")" : "\"" + key + "\"",
                  "data.messages_field");
  }
  if (!it->is_array()) {
    throw std::invalid_argument("field \"" + key + "\" is " + it->type_name() +
                                ", expected an array of {role, content} or {from, value}");
  }
  std::vector<Message> messages;
  for (size_t k = 0; k < it->size(); ++k) {
    const auto& turn = (*it)[k];
    const std::string where = key + "[" + std::to_string(k) + "]";
    if (!turn.is_object()) throw std::invalid_argument(where + " is " + turn.type_name() + ", expected an object");
    try {
      messages.push_back(turn_message(turn, record.contains("images")));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(where + ": " + e.what());
    }
  }
  return messages;
}

std::vector<Segment> render_record(const json& j, const DatasetOptions& o) {
  if (!j.is_object()) {
    throw std::invalid_argument(std::string("record is ") + j.type_name() + ", expected an object");
  }
  switch (o.kind) {
    case DatasetKind::kInstruct: {
      InstructRecord r;
      r.instruction = required_field(j, o.kind, o.instruction_field, "data.instruction_field");
      r.input = optional_field(j, o.input_field);
      r.output = required_field(j, o.kind, o.output_field, "data.output_field");
      if (o.chat_template) return o.chat_template->render_training(instruct_messages(r));
      return render_instruct(o.prompt_template, r);
    }
    case DatasetKind::kChat: {
      const std::vector<Message> messages = chat_messages(j, o);
      if (o.chat_template) return o.chat_template->render_training(messages);
      for (const Message& m : messages)
        for (const ContentPart& p : m.parts)
          if (p.image)
            throw std::invalid_argument("a message holds an image: images render through the model's own chat "
                                        "template (data.template = \"auto\"), not " +
                                        std::string(template_name(o.prompt_template)));
      return render_chat(o.prompt_template, messages);
    }
    case DatasetKind::kText:
      return {Segment{required_field(j, o.kind, o.text_field, "data.text_field"), false}};
    case DatasetKind::kPreference:
      throw std::invalid_argument("preference pairs are not single samples: they train with `qlora run lora_dpo`");
    case DatasetKind::kPrompt:
      throw std::invalid_argument("prompt records have no answer to train on: they are GRPO's prompts (data/prompts.h)");
  }
  throw std::logic_error("render_record: unhandled dataset kind");
}

}  // namespace qlora::data
