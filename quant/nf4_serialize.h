// NF4 on disk: how an Nf4Tensor becomes safetensors entries and metadata, and back.
//
// A tensor K stored as NF4 is four entries
//   K.nf4.codes   U8  [code_bytes]      K.nf4.scalers I8 [n_blocks]
//   K.nf4.factors T   [n_groups]        K.nf4.mean    T  []
// with __metadata__ entries K.nf4.shape (JSON list), K.nf4.block_size and
// K.nf4.scaler_block_size, and "format": "qlora-nf4-v1" for the file.
// This file knows nothing of the safetensors container (src/qlora/checkpoint does).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "quant/nf4_tensor.h"

namespace qlora {

inline constexpr const char* kNf4FormatTag = "qlora-nf4-v1";
inline constexpr const char* kNf4Suffixes[4] = {".nf4.codes", ".nf4.scalers", ".nf4.factors",
                                                ".nf4.mean"};

using Metadata = std::map<std::string, std::string>;

// Name, dtype and shape of the four entries of key (what a streaming writer declares first).
struct Nf4EntrySpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
std::vector<Nf4EntrySpec> nf4_entry_specs(const std::string& key, const nf4::Layout& layout,
                                          at::ScalarType dtype);
// The four tensors, in the order of nf4_entry_specs.
std::vector<std::pair<std::string, at::Tensor>> nf4_entries(const std::string& key,
                                                            const Nf4Tensor& t);
// Adds key's metadata entries and the format tag.
void nf4_add_metadata(const std::string& key, const std::vector<int64_t>& shape,
                      const nf4::Layout& layout, Metadata& metadata);

// If name is one of the four NF4 entries, its key K; otherwise empty.
std::string nf4_key_of_entry(const std::string& name);

// Rebuild K from its entries. lookup(name) returns the stored tensor or an undefined one;
// `where` (a file path) goes into error messages, which name the key and what is wrong.
using TensorLookup = std::function<at::Tensor(const std::string& name)>;
Nf4Tensor nf4_from_entries(const std::string& key, const TensorLookup& lookup,
                           const Metadata& metadata, const std::string& where);

}  // namespace qlora
