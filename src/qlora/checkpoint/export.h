// Inference exports of a LoRA-adapted Llama: a PEFT adapter directory (loadable with
// peft.PeftModel.from_pretrained) and a merged Hugging Face model directory (loadable with
// transformers.AutoModelForCausalLM.from_pretrained), per epoch and committed atomically.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qlora/io/enum_names.h"
#include "qlora/models/decoder.h"

namespace qlora::checkpoint {

// How the run turned records into tokens, so that `qlora generate` can render prompts the way
// the model saw them in training. Names are data/'s (checkpoint does not depend on data):
// data::dataset_kind_name and data::template_name.
struct PromptFormat {
  std::string format;         // data.format: "instruct", "chat" or "text"
  std::string template_name;  // data.template; empty: none (format "text")
  bool train_on_input = false;
  bool add_bos = true;  // the tokenizer's BOS starts every sample
  bool add_eos = true;  // EOS ends every sample
  // template "auto": the model's chat template the run rendered with (its Jinja text, the file it
  // came from) and the keyword arguments it was given (data.template_kwargs).
  std::string chat_template{}, chat_template_origin{};
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();
};

struct AdapterInfo {
  int64_t r = 0;
  double alpha = 0.0;
  double dropout = 0.0;
  // PEFT module names, e.g. {"q_proj", "v_proj"}; empty: derived from the parameter names.
  std::vector<std::string> target_modules;
  // A hub id, or the base checkpoint's absolute path (PEFT resolves a relative one against the
  // loader's working directory, not the run's).
  std::string base_model_name_or_path;
  // Written to <epoch dir>/qlora.json when given (see write_prompt_format).
  std::optional<PromptFormat> prompt;
  // When set, target_modules is written as this regular expression instead of the list (PEFT
  // fullmatches it against module names): export_epoch sets it for a multimodal model, whose vision
  // tower has q/k/v projections that a list of names would match too.
  std::string target_pattern;
  bool use_rslora = false;  // scale alpha / sqrt(r); use_dora follows from lora_magnitude_vector keys
  // peft's trainable tokens (LoraConfig.trainable_token_indices), for the rows the run replaced in the
  // base (DecoderModel::token_rows): a list of ids (the input embedding; peft ties a tied head to it)
  // or {"embed_tokens": ids, "lm_head": ids}; null: none. Their rows are the tensors
  // <module>.token_adapter.trainable_tokens_delta [ids, hidden], which peft writes over the base's
  // rows. export_epoch fills it from the model.
  nlohmann::json trainable_token_indices;
  // peft's modules_to_save: modules trained whole (a vision-language model's projector), their tensors
  // base_model.model.<module>.<param> among the adapter's, written as they are. export_epoch fills it
  // from the model's tower.
  std::vector<std::string> modules_to_save;
};

// <dir>/qlora.json, atomically: {"format": "qlora-export-v1", "prompt": {"format", "template"
// (null for none), "train_on_input", "add_bos", "add_eos"; for template "auto" also
// "chat_template", "chat_template_origin", "template_kwargs"}}.
void write_prompt_format(const std::string& dir, const PromptFormat& prompt);
// What <dir>/qlora.json records; nullopt when the directory has none (an export of a release
// before it). A malformed file throws ExportError naming it and the key.
std::optional<PromptFormat> read_prompt_format(const std::string& dir);

// Every message names the directory or file, and the tensor where one is involved.
struct ExportError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Writes <dir>/adapter_model.safetensors (the given PEFT-named tensors, e.g. from
// DecoderModel::lora_parameters(), and the trainable_tokens_delta rows info.trainable_token_indices
// names, cast to `dtype` on the CPU) and <dir>/adapter_config.json, each
// atomically; creates dir. adapter_config.json carries the LoraConfig fields PEFT has long
// written (peft_type, r, lora_alpha, target_modules, lora_dropout, bias, task_type,
// base_model_name_or_path, fan_in_fan_out, inference_mode, init_lora_weights, rank/alpha_pattern,
// use_rslora, use_dora, ...), not every field of the newest PEFT: PEFT fills absent fields with
// their defaults, while older PEFT releases reject fields they do not know.
void write_peft_adapter(const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& lora_params,
                        const AdapterInfo& info, at::ScalarType dtype = at::kFloat);

enum class MergeSource {
  Nf4,       // W = the base the model trained against (NF4 dequantized, or the dense base), as torchtune
  Original,  // W = the full-precision tensor from base_checkpoint_dir (error if it lacks one)
};

inline constexpr io::EnumName<MergeSource> kMergeSourceNames[] = {{MergeSource::Nf4, "nf4"},
                                                                  {MergeSource::Original, "original"}};
// Throws std::invalid_argument listing the names.
MergeSource merge_source_from_name(std::string_view name);
const char* merge_source_name(MergeSource source);

// Writes the merged model as an HF checkpoint into dir (created if needed): for every adapted
// projection W' = W + scale * (B @ A), computed in fp32 and cast to the output dtype (the
// original checkpoint's dtype for that key, else the model's base dtype); every other weight
// copied from base_checkpoint_dir when it has the key (bit-exact), else from the model. One
// model.safetensors if the total fits in max_shard_bytes, else model-0000i-of-0000n.safetensors
// of at most max_shard_bytes each (a single larger tensor gets a shard of its own, as
// transformers does) plus model.safetensors.index.json. config.json and whichever tokenizer files
// exist (tokenizer.model, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// generation_config.json) are copied from base_checkpoint_dir, then from tokenizer_path (a file,
// copied under its own name, or a directory) if given. Streams: one merged tensor in memory at
// a time. A LoRA on a tied lm_head unties it: lm_head.weight is written and config.json gets
// tie_word_embeddings=false. A multimodal base (gemma3) is written back as the same class: its
// language model's keys in the base's layout (models/key_layout.h), its vision tower and projector
// tensors copied as they are.
void write_merged_model(const std::string& dir, const models::DecoderModel& model, const std::string& base_checkpoint_dir,
                        MergeSource source, int64_t max_shard_bytes = 5LL << 30, const std::string& tokenizer_path = "");

// write_merged_model in pieces, so several ranks can write one merged model together: every rank
// builds the same plan (entries, shard files, headers); one creates the files; each entry is
// written in place by whichever rank holds what it needs (unit_of: -1 the embedding, i layer i,
// num_layers the final norm and lm_head); one writes the index, config and tokenizer files.
// The files are byte-identical however the entries are spread over ranks.
class MergedModelWriter {
 public:
  MergedModelWriter(const std::string& dir, const models::DecoderModel& model, const std::string& base_checkpoint_dir,
                    MergeSource source, int64_t max_shard_bytes = 5LL << 30);
  ~MergedModelWriter();
  size_t num_entries() const;
  int64_t unit_of(size_t entry) const;
  void create_files() const;
  void write_entry(size_t entry) const;  // produces it (merging where adapted) and writes it in place
  void sync_written() const;             // fsyncs, once each, the files this process wrote entries into
  void write_extras(const std::string& tokenizer_path) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// How the processes of a job share one export (engine/sharded_export.h builds it from the ranks);
// the default is one process that holds every unit and writes everything.
struct ExportRanks {
  bool lead = true;           // writes the adapter and commits the directory (rank 0 of the job)
  bool writes_model = true;   // takes part in writing the merged model (the first replica's ranks)
  int writer = 0;             // this process's index among the model's writers
  std::function<void()> barrier;          // of every process of the job (empty: one process)
  std::function<void()> writers_barrier;  // of the model's writers
  // Calls write(u) for each unit of `units` that this writer owns, with the unit's weights
  // present while it runs (the engine gathers them to their owner, one unit per writer at a time).
  std::function<void(const std::vector<int64_t>& units, const std::function<void(int64_t)>& write)> for_my_units;
  // Run by the lead once the adapter and the model are in the directory, before it is committed
  // (e.g. the GGUF files of checkpoint.gguf): the epoch's export appears whole or not at all.
  std::function<void(const std::string& dir)> before_commit;
};

// <output_dir>/epoch_<epoch>/: the merged model at the top level (so the directory is a plain HF
// checkpoint) unless adapter_only, and the PEFT adapter always in the adapter/ subdirectory.
// The adapter lives in a subdirectory because transformers' from_pretrained, on finding
// adapter_config.json next to config.json, loads the adapter on top of the (already merged)
// weights, applying the update twice. qlora.json (info.prompt) sits at the top level. Built in epoch_<epoch>.tmp/ (a leftover one is discarded)
// and renamed into place; an existing epoch_<epoch> is replaced only once the new one is
// complete (atomically where the filesystem supports RENAME_EXCHANGE). With several processes
// (`ranks`), each writes the units it owns in place, and the files are byte-identical to one
// process's.
void export_epoch(const std::string& output_dir, int64_t epoch, const models::DecoderModel& model,
                  const AdapterInfo& info, bool adapter_only, const std::string& base_checkpoint_dir,
                  MergeSource source, const std::string& tokenizer_path = "", const ExportRanks& ranks = {});

}  // namespace qlora::checkpoint
