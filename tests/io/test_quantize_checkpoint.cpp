// `qlora quantize` at checkpoint level on the bundled sharded tiny Llama, and the quantized
// tensor dispatch (a key loads as NF4 whether stored as NF4 or as floats).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "qlora/io/quantize_checkpoint.h"
#include "qlora/ops/nf4_ops.h"
#include "quant/nf4_serialize.h"

namespace qlora::io {
namespace {
namespace fs = std::filesystem;

std::string tiny_llama() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/tiny_llama";
}

class QuantizeCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("qc_" + std::to_string(::getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

void expect_equal(const Nf4Tensor& a, const Nf4Tensor& b) {
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_TRUE(at::equal(a.codes, b.codes));
  EXPECT_TRUE(at::equal(a.scalers, b.scalers));
  EXPECT_TRUE(at::equal(a.factors, b.factors));
  EXPECT_TRUE(at::equal(a.mean, b.mean));
}

TEST_F(QuantizeCheckpoint, ShardedDirectoryBecomesNf4AndLoadsBothWays) {
  const std::string out = (dir_ / "nf4").string();
  const ConvertReport r = quantize_checkpoint(tiny_llama(), out, nullptr);
  EXPECT_EQ(r.converted, 14);  // 7 projections x 2 layers; embeddings, norms, lm_head copied
  EXPECT_EQ(r.copied, 7);
  EXPECT_TRUE(fs::exists(fs::path(out) / "config.json"));
  const CheckpointDir in = CheckpointDir::open(tiny_llama());
  const CheckpointDir q = CheckpointDir::open(out);
  EXPECT_TRUE(q.is_sharded());
  EXPECT_EQ(q.files().size(), 2u);
  for (const std::string& name : in.tensor_names()) {
    if (is_quantizable(in.file_of(name).info(name))) {
      EXPECT_FALSE(q.contains(name)) << name;
      const Nf4Tensor stored = load_nf4(q, name);   // read as NF4
      const Nf4Tensor fresh = load_nf4(in, name);   // quantized while loading
      expect_equal(stored, fresh);
      expect_equal(stored, ops::nf4_quantize(in.tensor(name), name));
    } else {
      EXPECT_TRUE(at::equal(q.tensor(name), in.tensor(name))) << name;
    }
  }
  EXPECT_EQ(q.file_of("model.layers.0.mlp.up_proj.weight.nf4.codes").metadata().at("format"), kNf4FormatTag);
  EXPECT_THROW(load_nf4(q, "model.layers.9.mlp.up_proj.weight"), std::invalid_argument);
}

TEST_F(QuantizeCheckpoint, DequantizeInvertsToTheDequantizedValues) {
  const std::string q = (dir_ / "nf4").string(), d = (dir_ / "deq").string();
  quantize_checkpoint(tiny_llama(), q, nullptr);
  const ConvertReport r = dequantize_checkpoint(q, d, at::kFloat, nullptr);
  EXPECT_EQ(r.converted, 14);
  const CheckpointDir qd = CheckpointDir::open(q), dd = CheckpointDir::open(d), in = CheckpointDir::open(tiny_llama());
  const std::string key = "model.layers.1.self_attn.k_proj.weight";
  at::Tensor deq = dd.tensor(key);
  EXPECT_EQ(deq.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(deq, ops::nf4_dequantize(load_nf4(qd, key), at::kFloat)));
  EXPECT_EQ(deq.sizes(), in.tensor(key).sizes());
  EXPECT_TRUE(at::equal(dd.tensor("model.norm.weight"), in.tensor("model.norm.weight")));
}

TEST_F(QuantizeCheckpoint, SingleFileInSingleFileOut) {
  const std::string src = (dir_ / "one.safetensors").string(), out = (dir_ / "one_nf4.safetensors").string();
  save_safetensors(src, {{"a.o_proj.weight", at::randn({100, 30})}, {"a.bias", at::randn({30})},
                         {"a.x_proj.weight", at::randn({4, 4, 4})}});  // 3-D: copied, not quantized
  const ConvertReport r = quantize_checkpoint(src, out, nullptr);
  EXPECT_EQ(r.converted, 1);
  EXPECT_EQ(r.copied, 2);
  const SafetensorsFile f = SafetensorsFile::open(out);
  EXPECT_TRUE(f.find("a.o_proj.weight.nf4.codes"));
  EXPECT_TRUE(f.find("a.x_proj.weight"));
}

TEST_F(QuantizeCheckpoint, NeverWritesOverItsInputAndNamesBadTensors) {
  EXPECT_THROW(quantize_checkpoint(tiny_llama(), tiny_llama(), nullptr), std::invalid_argument);
  EXPECT_THROW(quantize_checkpoint(tiny_llama(), tiny_llama() + "/sub", nullptr), std::invalid_argument);
  const std::string src = (dir_ / "nan.safetensors").string();
  at::Tensor w = at::randn({64, 64});
  w[1][2] = NAN;
  save_safetensors(src, {{"l.q_proj.weight", w}});
  try {
    quantize_checkpoint(src, (dir_ / "o.safetensors").string(), nullptr);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("nan.safetensors: l.q_proj.weight"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "o.safetensors"));      // nothing half-written is left
  EXPECT_FALSE(fs::exists(dir_ / "o.safetensors.tmp"));
}

}  // namespace
}  // namespace qlora::io
