// Input fingerprints: what a resume checkpoint records about the data and base weights it was
// trained on, so that a resumed run can refuse different inputs even where their paths moved
// (data.path and model.checkpoint_dir are deliberately outside the config exactness check).
// Fingerprints are 16 hex digits of XXH64 (xxh64.h) over content only: the same content at any
// path gives the same fingerprint. XXH64 catches accidents (an edited record, a retrained
// checkpoint), not an adversary.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>

namespace qlora::checkpoint {

// Every byte of the file, streamed with fixed memory at disk (or page-cache) speed. Throws
// std::runtime_error naming the file.
std::string fingerprint_file(const std::string& path);

// The data a data path names (data::expand_data_path): one file, its fingerprint_file; several (a
// glob or directory of Parquet shards), XXH64 over each file's name and fingerprint_file, in order.
std::string fingerprint_data(const std::string& path);

// An HF checkpoint directory (found as CheckpointDir finds it: model.safetensors, or the shards
// named by model.safetensors.index.json), without reading its weights.
// Covers:
//   - config.json, every byte (required);
//   - tokenizer.model, every byte, when present (the recipe tokenizes with it);
//   - per weight file, in name order: its file name, byte size and whole safetensors header
//     (tensor names, dtypes, shapes, data offsets, metadata);
//   - per weight file, XXH64 of 4 KiB windows of the data section: its start, middle and end,
//     and the middle of every tensor (the whole tensor where it is smaller).
// Cost: the headers plus (3 + tensors) x 4 KiB a file: about 1.2 MB read for a 7B Llama (291
// tensors) instead of 13.5 GB.
// Cannot detect:
//   - a change confined to bytes outside every window, e.g. a few edited rows of the embedding
//     or of one projection; changes that touch every element of a tensor (retraining, a merged
//     LoRA delta, requantization) are caught through that tensor's middle window;
//   - other files of the directory (generation_config.json, tokenizer.json, ...), and the index
//     file's own bytes (CheckpointDir checks its weight map against the shard headers, which
//     are covered).
// Errors (std::runtime_error, SafetensorsError for malformed weight files) name the file.
std::string fingerprint_checkpoint_dir(const std::string& dir);

// The resume-meta record of a run's inputs: data_path, data_fingerprint (fingerprint_data),
// base_dir and base_fingerprint (fingerprint_checkpoint_dir), tokenizer_path and
// tokenizer_fingerprint (the tokenizer the run reads, which may live outside base_dir:
// original/tokenizer.model, model.tokenizer).
nlohmann::json input_fingerprints(const std::string& data_path, const std::string& base_dir,
                                  const std::string& tokenizer_path);

// Compares the inputs recorded in a resume checkpoint's meta with the current run's
// (input_fingerprints). A changed fingerprint throws ResumeError naming the checkpoint, the input
// that changed (old path -> new path) and how to proceed. Returns a warning to print where the
// checkpoint records no fingerprints (written before they were kept: resuming is allowed, the
// inputs unchecked); nullopt where everything matches.
std::optional<std::string> check_input_fingerprints(const nlohmann::json& saved_meta, const nlohmann::json& current,
                                                    const std::string& checkpoint);

}  // namespace qlora::checkpoint
