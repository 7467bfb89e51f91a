#include "qlora/data/dataset.h"
#include "qlora/data/arrow_records.h"
#include "qlora/data/chat_template.h"
#include "qlora/data/data_files.h"
#include "qlora/data/record_formats.h"
#include "qlora/data/sample_images.h"
#include "qlora/io/read_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>

namespace qlora::data {
namespace {

using nlohmann::json;

std::string read_file(const std::string& path) {
  auto text = io::read_file(path, io::kNoSizeBound);  // the user's data: as large as it is
  if (!text) throw std::invalid_argument("dataset: cannot open '" + path + "'");
  return std::move(*text);
}

int64_t line_of_offset(const std::string& text, size_t offset) {
  int64_t line = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) line += text[i] == '\n';
  return line;
}

// Byte offsets where the top-level array's elements start. nlohmann's DOM keeps no positions,
// so a small scan (strings and escapes aware) recovers them for error messages. Only called
// after the text parsed, so it may assume valid JSON.
std::vector<size_t> array_element_offsets(const std::string& text) {
  std::vector<size_t> starts;
  int depth = 0;
  bool in_string = false, escaped = false, expect_value = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    if (depth == 1 && expect_value && c != ']') {
      starts.push_back(i);
      expect_value = false;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth == 1) expect_value = true;
    } else if (c == ']' || c == '}') --depth;
    else if (c == ',' && depth == 1) expect_value = true;
  }
  return starts;
}

bool looks_like_array(const std::string& path, const std::string& text) {
  const auto ends_with = [&](std::string_view suffix) {
    return path.size() >= suffix.size() &&
           path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with(".jsonl")) return false;
  if (ends_with(".json")) return true;
  const auto first = text.find_first_not_of(" \t\r\n");
  return first != std::string::npos && text[first] == '[';
}

}  // namespace

DatasetKind dataset_kind_from_name(std::string_view name) {
  return io::enum_from_name(kDatasetKindNames, name, "dataset kind");
}

const char* dataset_kind_name(DatasetKind kind) { return io::enum_name(kDatasetKindNames, kind); }

namespace {

using TakeRecord = std::function<void(const json& record, const std::string& origin)>;

void read_json_file(const std::string& path, const TakeRecord& take) {
  const std::string text = read_file(path);
  if (looks_like_array(path, text)) {
    json doc;
    try {
      doc = json::parse(text);
    } catch (const json::parse_error& e) {
      throw std::invalid_argument(path + ": line " +
                                  std::to_string(line_of_offset(text, e.byte ? e.byte - 1 : 0)) +
                                  ": bad JSON: " + e.what());
    }
    if (!doc.is_array()) {
      throw std::invalid_argument(path + ": top-level JSON is " + std::string(doc.type_name()) +
                                  ", expected an array of records (or use JSONL: one per line)");
    }
    const auto starts = array_element_offsets(text);
    for (size_t k = 0; k < doc.size(); ++k) {
      std::string origin = path + ": record " + std::to_string(k + 1);
      if (k < starts.size()) origin += " (line " + std::to_string(line_of_offset(text, starts[k])) + ")";
      take(doc[k], origin);
    }
    return;
  }
  std::istringstream lines(text);
  std::string line;
  for (int64_t n = 1; std::getline(lines, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string origin = path + ": line " + std::to_string(n);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      throw std::invalid_argument(origin + ": bad JSON: " + e.what());
    }
    take(j, origin);
  }
}

}  // namespace

void read_json_records(const std::string& path, const TakeRecord& take) {
  auto take_one = [&take](const json& j, const std::string& origin) {
    try {
      take(j, origin);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(origin + ": " + e.what());
    }
  };
  for (const std::string& file : expand_data_path(path)) {
    if (arrow_file_kind(file) != ArrowFileKind::kNone) read_arrow_records(file, take_one);
    else read_json_file(file, take_one);
  }
}

std::vector<RenderedRecord> read_records(const std::string& path, const DatasetOptions& options) {
  std::vector<RenderedRecord> out;
  for (const std::string& file : expand_data_path(path)) {
    const std::string dir = std::filesystem::path(file).parent_path().string();  // images' relative paths
    read_json_records(file, [&](const json& j, const std::string& origin) {
      RenderedRecord r{origin, render_record(j, options), {}};
      if (options.kind == DatasetKind::kChat && j.is_object()) {
        std::string key = options.messages_field;
        if (key.empty()) key = j.contains("messages") ? "messages" : "conversations";
        r.images = record_images(j, key, dir);
      }
      out.push_back(std::move(r));
    });
  }
  return out;
}

namespace {

// The image processor beside the tokenizer (a vision-language checkpoint's preprocessor_config.json or
// processor_config.json, as its chat template sits there), for records with images; a file this code
// cannot read exactly leaves none, and its reason in image_processor_error for the first such record.
std::string find_image_processor(DatasetOptions& o, const Tokenizer& tokenizer) {
  o.image_processor.reset();
  o.image_processor_error.clear();
  const std::filesystem::path dir = std::filesystem::path(tokenizer.path()).parent_path();
  // Chat records, preference pairs and GRPO's prompts are messages, where images are.
  if (o.kind == DatasetKind::kInstruct || o.kind == DatasetKind::kText ||
      (!std::filesystem::exists(dir / "preprocessor_config.json") && !std::filesystem::exists(dir / "processor_config.json")))
    return {};
  try {
    o.image_processor = std::make_shared<const images::ImageProcessor>(images::processor_from_dir(dir.string()));
    return std::string("images: the model's image processor (") +
           images::processor_kind_name(o.image_processor->rules().kind) + ") from " + dir.string();
  } catch (const std::exception& e) {
    o.image_processor_error = e.what();
    return {};
  }
}

}  // namespace

std::string resolve_dataset_options(DatasetOptions& o, const Tokenizer& tokenizer, std::optional<bool> add_bos,
                                    std::optional<bool> add_eos, const nlohmann::ordered_json& template_kwargs) {
  std::string note;
  o.chat_template.reset();
  if (o.kind != DatasetKind::kText && o.prompt_template == TemplateKind::kAuto) {
    if (auto t = ChatTemplate::find(tokenizer, template_kwargs)) {
      note = "data.template = \"auto\": the model's own chat template, " + t->origin();
      o.chat_template = std::make_shared<const ChatTemplate>(std::move(*t));
    } else if (o.kind == DatasetKind::kInstruct || o.kind == DatasetKind::kPreference || o.kind == DatasetKind::kPrompt) {
      o.prompt_template = TemplateKind::kAlpaca;
      note = "data.template = \"auto\": " + tokenizer.path() + " ships no chat template; alpaca";
    } else {
      throw std::invalid_argument("data.template = \"auto\" but the tokenizer " + tokenizer.path() +
                                  " ships no chat template (no chat_template.jinja, no chat_template in "
                                  "tokenizer_config.json): set data.template to one of " +
                                  io::enum_names(kTemplateKindNames));
    }
  }
  o.add_bos = add_bos.value_or(!o.chat_template && tokenizer.adds_bos());
  o.add_eos = add_eos.value_or(!o.chat_template);
  if (const std::string images = find_image_processor(o, tokenizer); !images.empty())
    note += (note.empty() ? "" : "\n") + images;
  return note;
}

namespace {

void push_ids(Sample& s, const std::vector<int64_t>& ids, bool masked) {
  s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
  for (const auto id : ids) s.labels.push_back(masked ? kIgnoreIndex : id);
}

// The model's own template: its text tokenized whole; BOS only where asked and not there yet.
Sample tokenize_template_text(const std::vector<Segment>& segments, const Tokenizer& tokenizer,
                              const DatasetOptions& o) {
  const auto [ids, trained] = tokenize_exact(segments, tokenizer);
  Sample s;
  const int64_t bos = tokenizer.bos_id();
  if (o.add_bos && bos >= 0 && (ids.empty() || ids.front() != bos)) push_ids(s, {bos}, !o.train_on_input);
  for (size_t k = 0; k < ids.size(); ++k) push_ids(s, {ids[k]}, !trained[k] && !o.train_on_input);
  return s;
}

// A hand-written template's segments, one by one.
Sample tokenize_kind_segments(const std::vector<Segment>& segments, const Tokenizer& tokenizer,
                              const DatasetOptions& o) {
  Sample s;
  // BOS is never a target after the shift; it counts as prompt for train_on_input=false. A
  // tokenizer without one (Qwen's) gets none, as its chat template writes none.
  const int64_t bos = tokenizer.bos_id(), eos = tokenizer.eos_id();
  if (o.add_bos && bos >= 0) push_ids(s, {bos}, !o.train_on_input);
  // Sentencepiece's dummy prefix belongs to the start of a text, i.e. the first segment and the
  // first after an inner BOS (Meta encodes each Llama-2 turn separately). Later segments are
  // continuations so that tokens(segments) ≈ tokens(joined text).
  bool at_text_start = true;
  for (const auto& seg : segments) {
    const bool masked = seg.is_prompt && !o.train_on_input;
    if (seg.bos_before && bos >= 0) {
      push_ids(s, {bos}, !o.train_on_input);
      at_text_start = true;
    }
    if (!seg.text.empty()) {
      push_ids(s, at_text_start ? tokenizer.encode(seg.text) : tokenizer.encode_continuation(seg.text), masked);
      at_text_start = false;
    }
    if (seg.eos_after && eos >= 0) push_ids(s, {eos}, masked);
  }
  return s;
}

}  // namespace

Sample tokenize_segments(const std::vector<Segment>& segments, const Tokenizer& tokenizer,
                         const DatasetOptions& o) {
  Sample s = o.chat_template ? tokenize_template_text(segments, tokenizer, o)
                             : tokenize_kind_segments(segments, tokenizer, o);
  const int64_t eos = tokenizer.eos_id();
  const auto push = [&](const std::vector<int64_t>& ids, bool masked) { push_ids(s, ids, masked); };
  // EOS is trained: it is how the model learns to stop answering. Once: a template whose text
  // already ends with it (Mistral's answers, Llama-3.1's <|eot_id|> where that is the EOS) gets
  // no second one, so the ids are apply_chat_template's.
  if (o.add_eos && eos >= 0 && (s.tokens.empty() || s.tokens.back() != eos)) push({eos}, false);
  if (o.max_seq_len > 0 && static_cast<int64_t>(s.tokens.size()) > o.max_seq_len) {
    // Keep the start, as torchtune's truncate() does; it also overwrites the last kept token
    // with EOS when EOS is wanted. We do the same but mask that EOS: the answer was cut, not
    // finished, so teaching the model to stop there would be wrong.
    s.truncated = true;
    s.tokens.resize(static_cast<size_t>(o.max_seq_len));
    s.labels.resize(static_cast<size_t>(o.max_seq_len));
    if (o.add_eos && eos >= 0) {
      s.tokens.back() = eos;
      s.labels.back() = kIgnoreIndex;
    }
  }
  return s;
}

std::vector<Sample> tokenize_records(const std::vector<RenderedRecord>& records, const Tokenizer& tokenizer,
                                     const DatasetOptions& options) {
  std::vector<Sample> samples;
  samples.reserve(records.size());
  int64_t image_token = -1;  // the processor's image token's id, looked up at the first record with images
  for (const auto& r : records) {
    if (r.images.empty()) {
      samples.push_back(tokenize_segments(r.segments, tokenizer, options));
      continue;
    }
    std::vector<images::ProcessedImage> images = process_record_images(r, options);
    try {
      Sample s = tokenize_segments(expand_image_placeholders(r.segments, *options.image_processor, images), tokenizer,
                                   options);
      s.images = sample_images(r, images);
      if (image_token < 0) image_token = image_token_id(*options.image_processor, tokenizer);
      check_images_kept(s, image_token, options.max_seq_len);
      samples.push_back(std::move(s));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(r.origin + ": " + e.what());
    }
  }
  return samples;
}

std::vector<Sample> load_dataset(const std::string& path, const Tokenizer& tokenizer,
                                 const DatasetOptions& options) {
  return tokenize_records(read_records(path, options), tokenizer, options);
}

}  // namespace qlora::data
