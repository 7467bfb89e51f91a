#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "qlora/io/checkpoint_dir.h"
#include "qlora/checkpoint/export.h"
#include "qlora/io/safetensors.h"
#include "qlora/ops/nf4_ops.h"

namespace fs = std::filesystem;
using namespace qlora;
using namespace qlora::checkpoint;
using namespace qlora::io;

namespace {

// tests/data/tiny_llama: 2 layers, hidden 128, bf16, two shards (see tests/data/make_fixtures.py).
std::string tiny_dir() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return (fs::path(d ? d : "tests/data") / "tiny_llama").string();
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("qlora_export_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// LoRA on q and v (and down, for the MLP path), with random non-zero B so the merge is non-trivial.
models::DecoderModel tiny_model(bool nf4) {
  models::DecoderLoadOptions opt;
  opt.base_in_nf4 = nf4;
  opt.lora_targets = {"q_proj", "v_proj", "down_proj"};
  opt.lora_r = 4;
  opt.lora_alpha = 8.0;
  opt.seed = 1;
  models::DecoderModel m = models::load_decoder(tiny_dir(), opt);
  at::manual_seed(3);
  const c10::NoGradGuard g;
  for (auto& L : m.layers) {
    for (auto* l : {&L.q_proj, &L.v_proj, &L.down_proj}) l->lora_b.copy_(at::randn_like(l->lora_b) * 0.1);
  }
  return m;
}

AdapterInfo info_for_tiny() {
  return {4, 8.0, 0.05, {"q_proj", "v_proj", "down_proj"}, "/models/tiny"};
}

}  // namespace

TEST(PeftAdapter, ConfigFieldsAndTensors) {
  const models::DecoderModel m = tiny_model(false);
  const fs::path d = fresh_dir("adapter");
  write_peft_adapter(d.string(), m.lora_parameters(), info_for_tiny());
  const nlohmann::json cfg = read_json(d / "adapter_config.json");
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_TRUE(cfg["lora_alpha"].is_number_integer());
  EXPECT_EQ(cfg["lora_alpha"], 8);
  EXPECT_DOUBLE_EQ(cfg["lora_dropout"].get<double>(), 0.05);
  EXPECT_EQ(cfg["target_modules"], (nlohmann::json{"q_proj", "v_proj", "down_proj"}));
  EXPECT_EQ(cfg["bias"], "none");
  EXPECT_EQ(cfg["base_model_name_or_path"], "/models/tiny");
  EXPECT_EQ(cfg["use_rslora"], false);
  EXPECT_EQ(cfg["fan_in_fan_out"], false);

  const SafetensorsFile f = SafetensorsFile::open((d / "adapter_model.safetensors").string());
  EXPECT_EQ(f.tensors().size(), 2u * 3u * 2u);  // 2 layers x 3 modules x {A, B}
  const TensorInfo& a = f.info("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(a.dtype, Dtype::F32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{4, 128}));
  EXPECT_EQ(f.info("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight").shape,
            (std::vector<int64_t>{128, 4}));
  EXPECT_TRUE(at::equal(f.tensor("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"),
                        m.layers[0].v_proj.lora_b));
  // Empty target_modules are derived from the parameter names.
  AdapterInfo derived = info_for_tiny();
  derived.target_modules.clear();
  write_peft_adapter(d.string(), m.lora_parameters(), derived);
  EXPECT_EQ(read_json(d / "adapter_config.json")["target_modules"], (nlohmann::json{"down_proj", "q_proj", "v_proj"}));
  // Wrong names are rejected with the name in the message.
  EXPECT_THROW(write_peft_adapter(d.string(), {{"q_proj.weight", at::zeros({4, 4})}}, info_for_tiny()), ExportError);
  fs::remove_all(d);
}

TEST(MergedModel, EqualsIndependentMergeAndCopiesTheRest) {
  const models::DecoderModel m = tiny_model(true);
  const CheckpointDir orig = CheckpointDir::open(tiny_dir());
  const fs::path nf4_dir = fresh_dir("merged_nf4"), orig_dir = fresh_dir("merged_orig");
  write_merged_model(nf4_dir.string(), m, tiny_dir(), MergeSource::Nf4);
  write_merged_model(orig_dir.string(), m, tiny_dir(), MergeSource::Original);
  const CheckpointDir a = CheckpointDir::open(nf4_dir.string()), b = CheckpointDir::open(orig_dir.string());
  EXPECT_FALSE(a.is_sharded());
  EXPECT_EQ(a.tensor_names().size(), orig.tensor_names().size());

  const std::string key = "model.layers.1.self_attn.q_proj.weight";
  const auto& l = m.layers[1].q_proj;
  const at::Tensor delta = at::mm(l.lora_b, l.lora_a) * 2.0;  // scale = alpha / r = 8 / 4
  const at::Tensor want_nf4 = (ops::nf4_dequantize(l.base_nf4, at::kFloat) + delta).to(at::kBFloat16);
  const at::Tensor want_orig = (orig.tensor(key).to(at::kFloat) + delta).to(at::kBFloat16);
  EXPECT_EQ(a.tensor(key).scalar_type(), at::kBFloat16);  // the original checkpoint's dtype
  // Both sides round one fp32 sum to bf16; the sums may differ in the last fp32 bit (add vs
  // add with alpha), which can flip a bf16 rounding: allow one bf16 ulp (2^-8 relative).
  EXPECT_TRUE(at::allclose(a.tensor(key).to(at::kFloat), want_nf4.to(at::kFloat), 1e-2, 1e-6));
  EXPECT_TRUE(at::allclose(b.tensor(key).to(at::kFloat), want_orig.to(at::kFloat), 1e-2, 1e-6));
  // NF4 vs original base: they differ by the quantization error, far more than bf16 rounding.
  const double nf4_vs_orig = (a.tensor(key).to(at::kFloat) - b.tensor(key).to(at::kFloat)).abs().max().item<double>();
  EXPECT_GT(nf4_vs_orig, 1e-3);
  // The update is really in there.
  EXPECT_GT((b.tensor(key).to(at::kFloat) - orig.tensor(key).to(at::kFloat)).abs().max().item<double>(), 1e-2);
  // Not adapted: copied bit-exactly from the original (k_proj) in both modes.
  for (const std::string k : {"model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight",
                              "model.layers.0.input_layernorm.weight", "lm_head.weight", "model.norm.weight"}) {
    EXPECT_TRUE(at::equal(a.tensor(k), orig.tensor(k))) << k;
    EXPECT_TRUE(at::equal(b.tensor(k), orig.tensor(k))) << k;
  }
  EXPECT_TRUE(fs::exists(nf4_dir / "config.json"));
  EXPECT_EQ(read_json(nf4_dir / "config.json"), read_json(fs::path(tiny_dir()) / "config.json"));
  fs::remove_all(nf4_dir);
  fs::remove_all(orig_dir);
}

// A text-only checkpoint's tensors outside the language model (Qwen3.5's multi-token prediction block,
// mtp.*) are never read and go into the merged export as they are.
TEST(MergedModel, CopiesTensorsOutsideTheLanguageModel) {
  const fs::path src = fresh_dir("mtp_src"), out = fresh_dir("mtp_out");
  for (const auto& f : fs::directory_iterator(tiny_dir())) fs::copy(f.path(), src / f.path().filename());
  const at::Tensor mtp = at::randn({4, 8}).to(at::kBFloat16);
  save_safetensors((src / "mtp.safetensors").string(), {{"mtp.fc.weight", mtp}}, {{"format", "pt"}});
  nlohmann::json index = read_json(src / "model.safetensors.index.json");
  index["weight_map"]["mtp.fc.weight"] = "mtp.safetensors";
  std::ofstream(src / "model.safetensors.index.json") << index.dump(2);
  models::DecoderLoadOptions opt;
  opt.base_in_nf4 = true;
  const models::DecoderModel m = models::load_decoder(src.string(), opt);
  EXPECT_EQ(m.skipped_weights.tensors, 1);
  EXPECT_EQ(m.skipped_weights.first, "mtp.fc.weight");
  write_merged_model(out.string(), m, src.string(), MergeSource::Nf4);
  const CheckpointDir merged = CheckpointDir::open(out.string());
  ASSERT_TRUE(merged.contains("mtp.fc.weight"));
  EXPECT_TRUE(at::equal(merged.tensor("mtp.fc.weight"), mtp));
  EXPECT_EQ(merged.tensor_names().size(), CheckpointDir::open(tiny_dir()).tensor_names().size() + 1);
  fs::remove_all(src);
  fs::remove_all(out);
}

TEST(MergedModel, ShardsBySizeWithIndexAndCopiesTokenizer) {
  const models::DecoderModel m = tiny_model(false);
  const fs::path d = fresh_dir("sharded"), tok = fresh_dir("tok");
  std::ofstream(tok / "tokenizer.model") << "not really a sentencepiece model";
  const int64_t limit = 100 * 1024;  // bf16 q_proj is 32 KiB, embed 64 KiB, mlp 88 KiB
  write_merged_model(d.string(), m, tiny_dir(), MergeSource::Original, limit, (tok / "tokenizer.model").string());
  const nlohmann::json idx = read_json(d / "model.safetensors.index.json");
  std::map<std::string, uint64_t> shard_bytes;
  uint64_t total = 0;
  const CheckpointDir c = CheckpointDir::open(d.string());
  EXPECT_TRUE(c.is_sharded());
  for (const auto& [k, file] : idx["weight_map"].items()) {
    const SafetensorsFile& f = c.file_of(k);
    EXPECT_EQ(fs::path(f.path()).filename().string(), file.get<std::string>());
    const TensorInfo& ti = f.info(k);
    shard_bytes[file] += ti.end - ti.begin;
    total += ti.end - ti.begin;
  }
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_GT(shard_bytes.size(), 2u);
  for (const auto& [file, n] : shard_bytes) {
    EXPECT_LE(n, static_cast<uint64_t>(limit)) << file;
    EXPECT_NE(file.find("-of-"), std::string::npos);
  }
  EXPECT_EQ(c.tensor_names().size(), CheckpointDir::open(tiny_dir()).tensor_names().size());
  EXPECT_TRUE(fs::exists(d / "tokenizer.model"));
  EXPECT_TRUE(fs::exists(d / "config.json"));
  EXPECT_FALSE(fs::exists(d / "tokenizer.json"));  // only files that exist are copied
  fs::remove_all(d);
  fs::remove_all(tok);
}

TEST(MergedModel, OriginalSourceNeedsTheTensor) {
  const models::DecoderModel m = tiny_model(false);
  const fs::path d = fresh_dir("no_base");
  EXPECT_THROW(write_merged_model(d.string(), m, (d / "missing").string(), MergeSource::Original), ExportError);
  fs::remove_all(d);
}

TEST(ExportEpoch, LayoutAndAtomicReplace) {
  const models::DecoderModel m = tiny_model(false);
  const fs::path out = fresh_dir("epoch");
  export_epoch(out.string(), 0, m, info_for_tiny(), /*adapter_only=*/true, tiny_dir(), MergeSource::Nf4);
  EXPECT_TRUE(fs::exists(out / "epoch_0/adapter/adapter_model.safetensors"));
  EXPECT_TRUE(fs::exists(out / "epoch_0/adapter/adapter_config.json"));
  EXPECT_FALSE(fs::exists(out / "epoch_0/model.safetensors"));
  // A crashed earlier export left a .tmp; the next export discards it and replaces epoch_0 whole.
  fs::create_directories(out / "epoch_0.tmp/junk");
  export_epoch(out.string(), 0, m, info_for_tiny(), /*adapter_only=*/false, tiny_dir(), MergeSource::Nf4);
  EXPECT_TRUE(fs::exists(out / "epoch_0/model.safetensors"));
  EXPECT_TRUE(fs::exists(out / "epoch_0/config.json"));
  EXPECT_TRUE(fs::exists(out / "epoch_0/adapter/adapter_config.json"));
  EXPECT_FALSE(fs::exists(out / "epoch_0.tmp"));
  // A failing export (bad base dir) leaves the previous epoch_0 untouched.
  EXPECT_THROW(export_epoch(out.string(), 0, m, info_for_tiny(), false, (out / "nope").string(), MergeSource::Nf4),
               ExportError);
  EXPECT_TRUE(fs::exists(out / "epoch_0/model.safetensors"));
  fs::remove_all(out);
}

TEST(PromptFormat, RoundTripsAndRefusesMalformedFiles) {
  const fs::path d = fresh_dir("prompt");
  EXPECT_FALSE(read_prompt_format(d.string()).has_value());  // an export of an earlier release
  write_prompt_format(d.string(), {"chat", "qwen3", true, false, true});
  const auto p = read_prompt_format(d.string());
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->format, "chat");
  EXPECT_EQ(p->template_name, "qwen3");
  EXPECT_TRUE(p->train_on_input);
  EXPECT_FALSE(p->add_bos);
  EXPECT_TRUE(p->add_eos);
  write_prompt_format(d.string(), {"text", "", false, true, true});
  EXPECT_TRUE(read_json(d / "qlora.json")["prompt"]["template"].is_null());
  EXPECT_EQ(read_prompt_format(d.string())->template_name, "");
  std::ofstream(d / "qlora.json") << R"({"format": "qlora-export-v1", "prompt": {"format": "chat", "add_bos": 1}})";
  try {
    read_prompt_format(d.string());
    FAIL() << "no error";
  } catch (const ExportError& e) {
    EXPECT_NE(std::string(e.what()).find((d / "qlora.json").string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("prompt.train_on_input"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}
