// Checkpoint-level NF4: `qlora quantize` (every 2-D float *_proj.weight becomes NF4, the rest
// is copied), its inverse for inspection (`qlora dequantize`), and the quantized-tensor
// dispatch that loaders use (a key read as NF4 whether stored as NF4 or as floats).
// Streaming: one tensor in memory at a time, input pages released after use.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "qlora/io/checkpoint_dir.h"
#include "quant/nf4_tensor.h"

namespace qlora::io {

struct ConvertReport {
  int64_t converted = 0;  // tensors quantized (or dequantized)
  int64_t copied = 0;     // tensors copied unchanged
  uint64_t bytes_in = 0, bytes_out = 0;  // tensor data
  std::vector<std::string> files_written;
};
using Log = std::function<void(const std::string& line)>;

// True for the tensors `qlora quantize` turns into NF4.
bool is_quantizable(const TensorInfo& info);

// in: a .safetensors file or an HF checkpoint directory (single file or sharded with index).
// out: a file when in is a file, else a directory that gets the same shard names, a rewritten
// index and copies of the other files (config.json, tokenizer files). Every file is written
// aside and renamed into place; out may not be in itself.
ConvertReport quantize_checkpoint(const std::string& in, const std::string& out, const Log& log);

// Inverse: every NF4 tensor is dequantized to its stored dtype (or `dtype` if given).
ConvertReport dequantize_checkpoint(const std::string& in, const std::string& out,
                                    std::optional<at::ScalarType> dtype, const Log& log);

// The quantized-tensor dispatch: key as NF4, read from its NF4 entries if the checkpoint has
// them, else quantized from the float tensor key. Errors name the checkpoint and the key.
Nf4Tensor load_nf4(const CheckpointDir& ckpt, const std::string& key);

}  // namespace qlora::io
