// NF4 <-> safetensors entries and metadata: round trip, and a clear error for every way a
// stored NF4 tensor can be incomplete or inconsistent.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>

#include "qlora/ops/nf4_ops.h"
#include "quant/nf4_serialize.h"

namespace qlora {
namespace {

struct Stored {
  std::map<std::string, at::Tensor> entries;
  Metadata metadata;
  TensorLookup lookup() const {
    return [this](const std::string& n) {
      auto it = entries.find(n);
      return it == entries.end() ? at::Tensor() : it->second;
    };
  }
};

Stored store(const std::string& key, const Nf4Tensor& t) {
  Stored s;
  for (auto& [n, v] : nf4_entries(key, t)) s.entries[n] = v;
  nf4_add_metadata(key, t.shape, t.layout, s.metadata);
  return s;
}

std::string error_of(const Stored& s, const std::string& key) {
  try {
    nf4_from_entries(key, s.lookup(), s.metadata, "ckpt.safetensors");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(Nf4Serialize, EntriesAndMetadataRoundTrip) {
  Nf4Tensor t = ops::nf4_quantize(at::randn({333, 65}).to(at::kBFloat16), "w");
  Stored s = store("model.layers.0.mlp.up_proj.weight", t);
  EXPECT_EQ(s.metadata["format"], "qlora-nf4-v1");
  EXPECT_EQ(s.metadata["model.layers.0.mlp.up_proj.weight.nf4.shape"], "[333,65]");
  EXPECT_EQ(s.metadata["model.layers.0.mlp.up_proj.weight.nf4.block_size"], "64");
  EXPECT_EQ(s.metadata["model.layers.0.mlp.up_proj.weight.nf4.scaler_block_size"], "256");
  const auto specs = nf4_entry_specs("k", t.layout, t.dtype());
  ASSERT_EQ(specs.size(), 4u);
  EXPECT_EQ(specs[0].name, "k.nf4.codes");
  EXPECT_EQ(specs[3].shape.size(), 0u);  // the mean is a scalar
  Nf4Tensor back = nf4_from_entries("model.layers.0.mlp.up_proj.weight", s.lookup(), s.metadata, "f");
  EXPECT_EQ(back.shape, t.shape);
  EXPECT_TRUE(at::equal(ops::nf4_dequantize(back, at::kFloat), ops::nf4_dequantize(t, at::kFloat)));
  EXPECT_EQ(nf4_key_of_entry("a.b.nf4.scalers"), "a.b");
  EXPECT_EQ(nf4_key_of_entry("a.b.weight"), "");
}

TEST(Nf4Serialize, BrokenEntriesNameFileKeyAndProblem) {
  const std::string key = "m.q_proj.weight";
  Nf4Tensor t = ops::nf4_quantize(at::randn({64, 64}), "w");
  struct Breakage {
    const char* what;
    std::function<void(Stored&)> apply;
    const char* expect;
  };
  std::vector<Breakage> cases = {
      {"missing shape", [&](Stored& s) { s.metadata.erase(key + ".nf4.shape"); }, ".nf4.shape' is missing"},
      {"shape not a list", [&](Stored& s) { s.metadata[key + ".nf4.shape"] = "{\"a\":1}"; }, "JSON list"},
      {"shape not JSON", [&](Stored& s) { s.metadata[key + ".nf4.shape"] = "[64,"; }, "JSON list"},
      {"negative dim", [&](Stored& s) { s.metadata[key + ".nf4.shape"] = "[-64,64]"; }, "JSON list"},
      {"shape mismatch", [&](Stored& s) { s.metadata[key + ".nf4.shape"] = "[64,300]"; }, "codes must be"},
      {"bad block size", [&](Stored& s) { s.metadata[key + ".nf4.block_size"] = "x"; }, "block_size must be"},
      {"odd block size", [&](Stored& s) { s.metadata[key + ".nf4.block_size"] = "63"; }, "must be even"},
      {"missing codes", [&](Stored& s) { s.entries.erase(key + ".nf4.codes"); }, ".nf4.codes' is missing"},
      {"wrong scaler dtype", [&](Stored& s) { s.entries[key + ".nf4.scalers"] = s.entries[key + ".nf4.scalers"].to(at::kByte); }, "scalers must be"},
      {"wrong format", [&](Stored& s) { s.metadata["format"] = "pt"; }, "qlora-nf4-v1"},
  };
  for (auto& c : cases) {
    Stored s = store(key, t);
    c.apply(s);
    const std::string err = error_of(s, key);
    EXPECT_NE(err.find("ckpt.safetensors"), std::string::npos) << c.what << ": " << err;
    EXPECT_NE(err.find(key), std::string::npos) << c.what << ": " << err;
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.what << ": " << err;
  }
}

}  // namespace
}  // namespace qlora
