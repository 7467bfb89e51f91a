#include "qlora/gguf/convert.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <filesystem>
#include <set>
#include <stdexcept>

#include "qlora/gguf/arch.h"
#include "qlora/gguf/quant_mix.h"
#include "qlora/gguf/tensor_data.h"
#include "qlora/gguf/tokenizer_meta.h"
#include "qlora/gguf/writer.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/models/key_layout.h"
#include "qlora/models/decoder_config.h"
#include "quant/mxfp4.h"

namespace qlora::gguf {
namespace {

// The checkpoint's language-model tensors in file order, each with its text-only key (a
// multimodal Gemma 3's "language_model.model.X" read as "model.X"); the rest are counted.
struct Source {
  std::string key;   // in the checkpoint
  std::string text;  // text-only spelling, what gguf_tensor names
};

std::vector<Source> language_model_keys(const io::CheckpointDir& ckpt, models::KeyLayout layout) {
  std::vector<Source> out;
  for (const std::string& key : ckpt.tensor_names())
    if (models::is_language_model_key(layout, key)) out.push_back({key, models::text_key(layout, key)});
  return out;
}

}  // namespace

Metadata general_metadata(const std::string& arch, const std::string& kind, const ConvertOptions& o,
                          const std::string& dir) {
  std::string name = o.name;
  if (name.empty()) name = std::filesystem::path(dir).lexically_normal().filename().string();
  if (name.empty()) name = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
  return {{"general.architecture", Value::string(arch)},
          {"general.type", Value::string(kind)},
          {"general.name", Value::string(name)},
          {"general.file_type", Value::u32(type_info(o.type).file_type)},
          {"general.quantization_version", Value::u32(2)}};
}

namespace {

// What the file will hold: the architecture, every tensor's GGUF spec with the checkpoint key it
// comes from, and the metadata. Throws before anything is written when the model cannot be.
struct Plan {
  ArchPlan arch;
  std::vector<TensorSpec> specs;                                // the extra tensors first
  std::vector<std::pair<std::string, TensorPlan>> from_checkpoint;  // key, what to do on the way
  std::vector<StackedTensor> stacked;  // the MoE layers' experts, after those (their keys in the layout's spelling)
  Metadata metadata;
};

// A fused expert tensor that gpt-oss's Hub form holds in MXFP4: <key>_blocks [E, out, in / 32, 16]
// (out-major, where the plain tensor is [E, in, out]) beside <key>_scales.
void as_mxfp4(StackedTensor::Part& part) {
  part.shape = {part.shape[0], part.shape[2], part.shape[1] / 32, 16};
  part.key += "_blocks";
  part.transposed = false;
  part.mxfp4 = true;
}

std::string scales_key(const std::string& blocks_key) {
  return blocks_key.substr(0, blocks_key.size() - 7) + "_scales";
}

// Tensor `key` is in the checkpoint with `shape`, or the conversion is refused naming it (`what`: whose it is).
void check_part(const io::CheckpointDir& ckpt, const std::string& key, const std::vector<int64_t>& shape,
                const std::string& dir, const std::string& what) {
  if (!ckpt.contains(key))
    throw std::invalid_argument(dir + ": tensor '" + key + "' is missing (" + what + "); no GGUF is written");
  const auto& got = ckpt.file_of(key).info(key).shape;
  if (got == shape) return;
  std::string want_s, got_s;
  for (int64_t d : shape) want_s += (want_s.empty() ? "" : ", ") + std::to_string(d);
  for (int64_t d : got) got_s += (got_s.empty() ? "" : ", ") + std::to_string(d);
  throw std::invalid_argument(dir + ": tensor '" + key + "' is [" + got_s + "], config.json implies [" + want_s +
                              "]; no GGUF is written");
}

// The MoE layers' expert tensors (arch.h, expert_tensors) in whichever layout the checkpoint holds,
// their parts' keys in the checkpoint's spelling and checked against the config's shapes; the text
// keys they read go into `read`.
std::vector<StackedTensor> stacked_experts(const io::CheckpointDir& ckpt, const models::DecoderConfig& c,
                                           models::KeyLayout layout, const std::string& dir,
                                           std::set<std::string>& read) {
  std::vector<StackedTensor> out;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const bool fused = ckpt.contains(models::layout_key(layout, fused_experts_key(c, i)));
    for (StackedTensor& t : expert_tensors(c, i, fused)) {
      for (StackedTensor::Part& part : t.parts) {
        const std::string text = part.key;
        part.key = models::layout_key(layout, part.key);
        if (part.transposed && !ckpt.contains(part.key) && ckpt.contains(part.key + "_blocks")) {
          as_mxfp4(part);
          read.insert({text + "_blocks", text + "_scales"});
        } else {
          read.insert(text);
        }
        check_part(ckpt, part.key, part.shape, dir, "layer " + std::to_string(i) + "'s experts, for " + t.name);
        if (part.mxfp4)
          check_part(ckpt, scales_key(part.key), {part.shape.begin(), part.shape.end() - 1}, dir,
                     "layer " + std::to_string(i) + "'s MXFP4 scales, for " + t.name);
      }
      out.push_back(std::move(t));
    }
  }
  return out;
}

// An MXFP4 part, one expert's rows at a time: its blocks moved into ggml's MXFP4 as they are (the
// unchanged experts of a gpt-oss checkpoint: exact, and a quarter of bf16's bytes), or decoded
// exactly to fp32 and encoded in a quantized file's type.
void write_mxfp4(Writer& out, const at::Tensor& blocks, const at::Tensor& scales, const StackedTensor::Part& p,
                 GgmlType type) {
  for (int64_t e = 0; e < blocks.size(0); ++e) {
    const int64_t end = p.row0 + p.rows * p.stride;
    const at::Tensor b = blocks[e].slice(0, p.row0, end, p.stride), s = scales[e].slice(0, p.row0, end, p.stride);
    if (type == GgmlType::MXFP4) {
      const at::Tensor g = mxfp4::to_ggml_blocks(b, s, p.key);
      out.write(g.data_ptr(), static_cast<size_t>(g.numel()));
    } else {
      write_tensor(out, mxfp4::dequantize(b, s, at::kFloat, p.key), type);
    }
  }
}

// Writes a stacked expert tensor [experts, rows, cols] one expert's matrix at a time (peak memory:
// one expert's rows in fp32), from the checkpoint's mapped tensors.
void write_stacked(Writer& out, const io::CheckpointDir& ckpt, const StackedTensor& t, GgmlType type) {
  for (const StackedTensor::Part& p : t.parts) {
    const at::Tensor x = ckpt.tensor(p.key);
    if (p.mxfp4) {
      write_mxfp4(out, x, ckpt.tensor(scales_key(p.key)), p, type);
      continue;
    }
    if (!p.all_experts) {
      write_tensor(out, x.narrow(0, p.row0, p.rows), type);
      continue;
    }
    for (int64_t e = 0; e < x.size(0); ++e) {
      const at::Tensor m = p.transposed ? x[e].t() : x[e];
      write_tensor(out, m.slice(0, p.row0, p.row0 + p.rows * p.stride, p.stride).contiguous(), type);
    }
  }
}

Plan plan_gguf(const io::CheckpointDir& ckpt, const models::DecoderConfig& c, const std::string& dir,
               const ConvertOptions& options) {
  Plan p{plan_architecture(c, dir + "/config.json"), {}, {}, {}, {}};
  for (const ExtraTensor& e : p.arch.extra)
    p.specs.push_back({e.name, {static_cast<int64_t>(e.values.size())}, GgmlType::F32});
  const models::KeyLayout layout = models::key_layout_of(ckpt, c);
  std::set<std::string> expert_keys;
  p.stacked = stacked_experts(ckpt, c, layout, dir, expert_keys);
  for (const Source& s : language_model_keys(ckpt, layout)) {
    if (s.text == "lm_head.weight" && c.tie_word_embeddings) continue;
    if (expert_keys.count(s.text)) continue;  // stacked below
    const auto mapped = gguf_tensor(s.text, c);
    if (!mapped)
      throw std::invalid_argument(dir + ": tensor '" + s.key + "' has no GGUF name in llama.cpp's " + p.arch.arch +
                                  " architecture; no GGUF is written");
    const auto& info = ckpt.file_of(s.key).info(s.key);
    // The vocabulary metadata has vocab_size entries: the embedding's rows say how many there are
    // (a config.json asking for 10^12 would otherwise be written out, entry by entry).
    if (mapped->name == "token_embd.weight" && (info.shape.empty() || info.shape[0] != c.vocab_size))
      throw std::invalid_argument(dir + "/config.json: vocab_size is " + std::to_string(c.vocab_size) + ", but '" +
                                  s.key + "' has " + std::to_string(info.shape.empty() ? 0 : info.shape[0]) +
                                  " rows; no GGUF is written");
    p.specs.push_back({mapped->name, planned_shape(info.shape, *mapped)});
    p.from_checkpoint.emplace_back(s.key, *mapped);
  }
  for (const StackedTensor& t : p.stacked) p.specs.push_back({t.name, t.shape});
  set_types(p.specs, {p.arch.arch, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.moe.num_experts},
            options.type);
  // MXFP4 experts stay MXFP4 in an f32/f16/bf16 file, as llama.cpp's converter keeps them.
  for (size_t i = 0, first = p.specs.size() - p.stacked.size(); i < p.stacked.size(); ++i)
    if (p.stacked[i].parts[0].mxfp4 && !is_quantized(options.type)) p.specs[first + i].type = GgmlType::MXFP4;
  p.metadata = general_metadata(p.arch.arch, "model", options, dir);
  for (const auto& kv : p.arch.metadata) p.metadata.push_back(kv);
  add_tokenizer_metadata(dir, c.vocab_size, p.metadata);
  return p;
}

}  // namespace

size_t write_gguf(const std::string& dir, const std::string& out_path, const ConvertOptions& options) {
  const models::DecoderConfig c = models::load_decoder_config(dir);
  const io::CheckpointDir ckpt = io::CheckpointDir::open(dir);
  Plan plan = plan_gguf(ckpt, c, dir, options);
  if (const auto skipped = models::skipped_weights(ckpt, models::key_layout_of(ckpt, c)); skipped.tensors > 0)
    std::fprintf(stderr, "gguf: the tensors outside the language model (a vision tower and projector, mtp.*) are not "
                 "written (%lld tensors, e.g. '%s'): the GGUF "
                 "holds the language model only (a vision tower goes into its own mmproj file: qlora gguf DIR --mmproj)\n", static_cast<long long>(skipped.tensors), skipped.first.c_str());
  for (const std::string& note : plan.arch.notes) std::fprintf(stderr, "gguf: %s\n", note.c_str());
  Writer out(out_path, std::move(plan.metadata), plan.specs);
  for (const ExtraTensor& e : plan.arch.extra) out.write(e.values.data(), e.values.size() * sizeof(float));
  const size_t first = plan.arch.extra.size();
  for (size_t i = 0; i < plan.from_checkpoint.size(); ++i) {
    const auto& [key, t] = plan.from_checkpoint[i];
    at::Tensor x = planned_values(ckpt.tensor(key), t);
    write_tensor(out, x, plan.specs[first + i].type);
    x = at::Tensor();
    ckpt.file_of(key).release(key);  // its mapped pages leave the resident set
  }
  const size_t first_stacked = first + plan.from_checkpoint.size();
  for (size_t i = 0; i < plan.stacked.size(); ++i) {
    const StackedTensor& t = plan.stacked[i];
    write_stacked(out, ckpt, t, plan.specs[first_stacked + i].type);
    // A fused gate_up key serves the gate and the up tensor, written one after the other: released after both.
    const bool read_next = i + 1 < plan.stacked.size() && t.parts[0].all_experts &&
                           plan.stacked[i + 1].parts[0].key == t.parts[0].key;
    if (read_next) continue;
    for (const StackedTensor::Part& part : t.parts) {
      ckpt.file_of(part.key).release(part.key);
      if (part.mxfp4) ckpt.file_of(scales_key(part.key)).release(scales_key(part.key));
    }
  }
  out.commit();
  return plan.specs.size();
}

void check_convertible(const std::string& dir, bool untied_head) {
  models::DecoderConfig c = models::load_decoder_config(dir);
  if (untied_head) c.tie_word_embeddings = false;  // the head is then written from the embedding's shape
  plan_gguf(io::CheckpointDir::open(dir), c, dir, {});
}

}  // namespace qlora::gguf
