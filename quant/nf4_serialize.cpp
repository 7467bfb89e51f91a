#include "quant/nf4_serialize.h"

#include <nlohmann/json.hpp>

#include <stdexcept>

namespace qlora {

std::vector<Nf4EntrySpec> nf4_entry_specs(const std::string& key, const nf4::Layout& l,
                                          at::ScalarType dtype) {
  return {{key + kNf4Suffixes[0], at::kByte, {l.code_bytes()}},
          {key + kNf4Suffixes[1], at::kChar, {l.n_blocks()}},
          {key + kNf4Suffixes[2], dtype, {l.n_groups()}},
          {key + kNf4Suffixes[3], dtype, {}}};
}

std::vector<std::pair<std::string, at::Tensor>> nf4_entries(const std::string& key,
                                                            const Nf4Tensor& t) {
  t.validate(key);
  return {{key + kNf4Suffixes[0], t.codes},
          {key + kNf4Suffixes[1], t.scalers},
          {key + kNf4Suffixes[2], t.factors},
          {key + kNf4Suffixes[3], t.mean}};
}

void nf4_add_metadata(const std::string& key, const std::vector<int64_t>& shape,
                      const nf4::Layout& l, Metadata& metadata) {
  metadata[key + ".nf4.shape"] = nlohmann::json(shape).dump();
  metadata[key + ".nf4.block_size"] = std::to_string(l.block_size);
  metadata[key + ".nf4.scaler_block_size"] = std::to_string(l.scaler_block_size);
  metadata["format"] = kNf4FormatTag;
}

std::string nf4_key_of_entry(const std::string& name) {
  for (const char* suffix : kNf4Suffixes) {
    const std::string s(suffix);
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0)
      return name.substr(0, name.size() - s.size());
  }
  return {};
}

namespace {

int64_t positive_int(const std::string& text, const std::string& what) {
  size_t used = 0;
  int64_t v = -1;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
  }
  if (used != text.size() || v < 1 || v > (int64_t{1} << 30))
    throw std::invalid_argument(what + " must be a positive integer, got '" + text + "'");
  return v;
}

}  // namespace

Nf4Tensor nf4_from_entries(const std::string& key, const TensorLookup& lookup,
                           const Metadata& metadata, const std::string& where) {
  const std::string ctx = where + ": NF4 tensor '" + key + "'";
  auto meta = [&](const std::string& suffix) -> const std::string& {
    auto it = metadata.find(key + suffix);
    if (it == metadata.end()) throw std::invalid_argument(ctx + ": metadata '" + key + suffix + "' is missing");
    return it->second;
  };
  auto fmt = metadata.find("format");
  if (fmt == metadata.end() || fmt->second != kNf4FormatTag)
    throw std::invalid_argument(ctx + ": file metadata 'format' must be '" + kNf4FormatTag + "'");
  std::vector<int64_t> shape;
  try {
    const auto j = nlohmann::json::parse(meta(".nf4.shape"));
    if (!j.is_array()) throw std::invalid_argument("not a list");
    for (const auto& d : j) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) throw std::invalid_argument("dim");
      shape.push_back(d.get<int64_t>());
    }
  } catch (const std::exception&) {
    throw std::invalid_argument(ctx + ": metadata '" + key +
                                ".nf4.shape' must be a JSON list of non-negative integers, got '" +
                                meta(".nf4.shape") + "'");
  }
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d != 0 && numel > (int64_t{1} << 40) / d)
      throw std::invalid_argument(ctx + ": shape is too large");
    numel *= d;
  }
  const int64_t bs = positive_int(meta(".nf4.block_size"), ctx + ": block_size");
  const int64_t sbs = positive_int(meta(".nf4.scaler_block_size"), ctx + ": scaler_block_size");
  Nf4Tensor t;
  t.shape = shape;
  try {
    t.layout = nf4::Layout::make(numel, bs, sbs);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(ctx + ": " + e.what());
  }
  at::Tensor* parts[4] = {&t.codes, &t.scalers, &t.factors, &t.mean};
  for (int i = 0; i < 4; ++i) {
    *parts[i] = lookup(key + kNf4Suffixes[i]);
    if (!parts[i]->defined())
      throw std::invalid_argument(ctx + ": entry '" + key + kNf4Suffixes[i] + "' is missing");
  }
  t.mean = t.mean.reshape({});
  try {
    t.validate(key);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
  return t;
}

}  // namespace qlora
