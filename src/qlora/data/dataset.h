// Local JSON / JSONL / Parquet / Arrow datasets → tokenized samples with loss masks.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/record_images.h"
#include "qlora/data/templates.h"
#include "qlora/data/tokenizer.h"
#include "qlora/images/processor.h"
#include "qlora/io/enum_names.h"

namespace qlora::data {

class ChatTemplate;

// Label value the loss ignores (PyTorch cross_entropy's default ignore_index).
constexpr int64_t kIgnoreIndex = -100;

enum class DatasetKind {
  kInstruct,  // {"instruction", "input" (optional), "output"}; names configurable
  kChat,      // {"messages": [{"role", "content"}, ...]} or ShareGPT {"conversations": [{"from", "value"}, ...]}
  kText,      // {"text"}: plain language modelling, every token trained
  kPreference,  // {"prompt", "chosen", "rejected"} or conversational pairs: `qlora run lora_dpo` (preference.h)
  kPrompt,      // {"prompt": text or messages, "answer", ...}: GRPO's prompts, `qlora run lora_grpo` (prompts.h)
};
inline constexpr io::EnumName<DatasetKind> kDatasetKindNames[] = {
    {DatasetKind::kInstruct, "instruct"}, {DatasetKind::kChat, "chat"}, {DatasetKind::kText, "text"},
    {DatasetKind::kPreference, "preference"}, {DatasetKind::kPrompt, "prompt"}};
// Throws std::invalid_argument listing the names.
DatasetKind dataset_kind_from_name(std::string_view name);
const char* dataset_kind_name(DatasetKind kind);

struct DatasetOptions {
  DatasetKind kind = DatasetKind::kInstruct;
  TemplateKind prompt_template = TemplateKind::kAlpaca;
  std::string instruction_field = "instruction";
  std::string input_field = "input";
  std::string output_field = "output";
  std::string messages_field;  // empty: "messages", else "conversations" (record_formats.h)
  std::string text_field = "text";
  int64_t max_seq_len = 512;    // <= 0: no truncation
  bool train_on_input = false;  // true: prompt tokens are trained too
  // Resolved for a tokenizer by resolve_dataset_options (config::dataset_options does it).
  bool add_bos = true;          // BOS starts every sample (never twice)
  bool add_eos = true;          // EOS ends every sample so the model learns to stop (never twice)
  // prompt_template kAuto: the model's own template. Its text is tokenized whole, so the ids are
  // apply_chat_template's (tokenize_exact).
  std::shared_ptr<const ChatTemplate> chat_template;
  // The model's image processor (images/processor.h; from its preprocessor_config.json), for records
  // with images (record_images.h); null: a record with an image is refused. Images above
  // max_image_pixels (width x height, checked from the file's header) are refused.
  // resolve_dataset_options finds it beside the tokenizer (a chat data set's); where that file is one
  // qlora does not compute exactly, image_processor_error says why.
  std::shared_ptr<const images::ImageProcessor> image_processor;
  std::string image_processor_error;
  int64_t max_image_pixels = 64LL << 20;
};

// What "auto" means for `tokenizer`: data.template = auto takes the chat template beside the
// tokenizer, else alpaca for instruct data (chat data without one is an error naming the
// tokenizer's directory); add_bos / add_eos unset become the tokenizer's BOS rule and EOS for
// hand-written templates and text (none for the model's own template, which writes its
// end-of-turn). Returns one line saying what was chosen, for the log.
std::string resolve_dataset_options(DatasetOptions& options, const Tokenizer& tokenizer,
                                    std::optional<bool> add_bos, std::optional<bool> add_eos,
                                    const nlohmann::ordered_json& template_kwargs);

// One image of a sample: where it comes from, and what its processing gives that the tokens and
// positions depend on (its pixel values are made again when a batch needs them: sample_images.h's
// image_pixels, so a data set's images never sit in memory all at once).
struct SampleImage {
  RecordImage source;
  std::string origin;             // the record's, for errors
  int64_t num_image_tokens = 0;   // its run of image tokens in the sample
  at::Tensor grid;                // the processor's grid (Qwen: [t, h, w] patches), undefined where none
};

// tokens and labels have equal length; labels[i] is tokens[i] or kIgnoreIndex (not shifted:
// collate() shifts per sample, so no target crosses a packed boundary).
struct Sample {
  std::vector<int64_t> tokens;
  std::vector<int64_t> labels;
  bool truncated = false;  // longer than max_seq_len before tokenize_segments cut it
  // Its images in the order of their tokens (each image's num_image_tokens tokens, one run, in
  // `tokens`); empty for text.
  std::vector<SampleImage> images;
};

// One record rendered by its template; `origin` is "<file>: line N" for later error messages.
struct RenderedRecord {
  std::string origin;
  std::vector<Segment> segments;
  std::vector<RecordImage> images;  // in the order the segments show their placeholders
};

// Each record of the files `path` names (expand_data_path: a file, a directory, a glob), file by
// file, in order, with its origin: a JSON array (".json") or JSONL file (any other extension: the
// first non-space byte decides, '[' meaning an array) gives "<file>: line N" or "<file>: record K
// (line N)"; a Parquet or Arrow IPC file (arrow_records.h) one JSON object a row, "<file>: row N".
// An std::invalid_argument `take` throws is prefixed with the origin. Bad JSON names the file and
// line; blank JSONL lines are skipped; a damaged Parquet / Arrow file is a std::runtime_error naming it.
void read_json_records(const std::string& path,
                       const std::function<void(const nlohmann::json& record, const std::string& origin)>& take);

// Reads the records of read_json_records (JSON arrays, JSONL, Parquet, Arrow IPC). A malformed record
// throws std::invalid_argument naming the file, the 1-based line (and the record index for
// arrays) and what is wrong; a record of another format than options.kind says which format it
// looks like and the data.format to set (record_formats.h). Blank JSONL lines are skipped.
std::vector<RenderedRecord> read_records(const std::string& path, const DatasetOptions& options);

// Segments → ids and labels: BOS (if add_bos and the tokenizer has one), each segment (prompt
// ones masked unless train_on_input), EOS (if add_eos and the ids do not already end with it),
// then truncation to max_seq_len.
Sample tokenize_segments(const std::vector<Segment>& segments, const Tokenizer& tokenizer,
                         const DatasetOptions& options);

// tokenize_segments for every record, in order.
std::vector<Sample> tokenize_records(const std::vector<RenderedRecord>& records, const Tokenizer& tokenizer,
                                     const DatasetOptions& options);

// read_records + tokenize_records.
std::vector<Sample> load_dataset(const std::string& path, const Tokenizer& tokenizer,
                                 const DatasetOptions& options);

}  // namespace qlora::data
