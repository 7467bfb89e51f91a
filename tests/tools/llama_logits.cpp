// llama_logits: runs our forward (any family load_decoder reads) on given token ids and writes the
// logits, so Python conformance tests can compare them with transformers.
//   llama_logits --checkpoint DIR --tokens 1,2,3[;4,5,6] [--nf4] [--dtype fp32|bf16] [--device cpu|cuda]
//                [--packed 5,7 | --decode-from P | --generate N [--batch-lengths 5,12 [--generations G]]]
//                --out FILE
// Writes FILE (safetensors) with "logits": float32 [batch, seq, vocab].
// --packed: each row holds samples of these lengths (summing to seq), run through the packed
//   training forward (positions restarting per sample, block-causal mask).
// --decode-from P: the KV-cache path as generation runs it (inference mode: its decode kernels):
//   one forward over the first P tokens, then one per token, the logits of all steps concatenated
//   (equal to the plain forward's when the cache is right).
// --generate N: instead of logits, "ids": int64 [batch, N], each row's greedy continuation by
//   models::generate (KV cache), no stop ids. With --batch-lengths (one per row): one
//   models::generate_batch over G greedy sequences per row, row r's prompt its first L_r tokens;
//   "ids": int64 [batch * G, N], row r's sequences at rows r*G .. r*G+G-1.
// --images FILE (safetensors): image features placed at image tokens (models/multimodal.h): "features"
//   float32 [n, hidden], "mask" uint8 [batch, seq] (the image tokens), and for Qwen3.5's M-RoPE
//   "grids" int64 [images, 3] (t, h, w patches) with "spatial_merge" int64 [1]; with --packed or alone.
// --image-files A,B: instead, image files through the checkpoint's own image processor
//   (preprocessor_config.json beside it) and its vision tower (models/vision), their features placed at
//   the config's image token (the tokens must hold each image's run); with --packed or alone.
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "qlora/data/batching.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/generate.h"
#include "qlora/images/decode.h"
#include "qlora/models/decoder.h"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "llama_logits: " << why << "\n"
            << "usage: llama_logits --checkpoint DIR --tokens 1,2,3[;4,5,6] [--nf4] [--dtype fp32|bf16] [--device D]"
               " [--packed 5,7 | --decode-from P | --generate N [--batch-lengths L,.. [--generations G]]]"
               " --out FILE\n";
  std::exit(2);
}

// "1,2,3" -> {1, 2, 3}; `what` names the flag in errors.
std::vector<int64_t> parse_ints(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  std::stringstream cs(text);
  for (std::string item; std::getline(cs, item, ',');) {
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      usage(what + ": '" + item + "' is not an integer");
    }
  }
  if (out.empty()) usage(what + ": empty list");
  return out;
}

// "1,2,3;4,5,6" -> rows of equal length.
at::Tensor parse_tokens(const std::string& text) {
  std::vector<int64_t> flat;
  int64_t rows = 0, cols = -1;
  std::stringstream rs(text);
  for (std::string row; std::getline(rs, row, ';');) {
    const std::vector<int64_t> r = parse_ints(row, "--tokens");
    if (cols >= 0 && static_cast<int64_t>(r.size()) != cols) usage("--tokens: rows must have equal length");
    cols = static_cast<int64_t>(r.size());
    flat.insert(flat.end(), r.begin(), r.end());
    ++rows;
  }
  if (rows == 0) usage("--tokens: no tokens");
  return at::tensor(flat, at::TensorOptions().dtype(at::kLong)).view({rows, cols});
}

// The packed forward's inputs for rows that each hold samples of `lengths`: positions restart at 0
// per sample, document ids number the samples (every row is packed the same way).
std::pair<at::Tensor, at::Tensor> packed_inputs(const std::vector<int64_t>& lengths, int64_t rows, int64_t seq) {
  std::vector<int64_t> pos, doc;
  for (size_t d = 0; d < lengths.size(); ++d) {
    if (lengths[d] <= 0) usage("--packed: lengths must be positive");
    for (int64_t i = 0; i < lengths[d]; ++i) {
      pos.push_back(i);
      doc.push_back(static_cast<int64_t>(d));
    }
  }
  if (static_cast<int64_t>(pos.size()) != seq) usage("--packed: lengths must sum to the row length");
  const auto opt = at::TensorOptions().dtype(at::kLong);
  const at::Tensor position_ids = at::tensor(pos, opt).view({1, seq}).expand({rows, seq}).contiguous();
  const at::Tensor document_ids = at::tensor(doc, opt).view({1, seq}).expand({rows, seq}).contiguous();
  return {position_ids, qlora::data::block_causal_mask(document_ids)};
}

// --images FILE: the batch's ImageInputs (see the header); position_ids restart where packed samples start.
qlora::models::ImageInputs read_images(const std::string& path, const at::Tensor& position_ids, at::Device device,
                                       at::ScalarType dtype) {
  const qlora::io::SafetensorsFile f = qlora::io::SafetensorsFile::open(path);
  qlora::models::ImageInputs in;
  in.features = f.tensor("features").to(device, dtype);
  in.mask = f.tensor("mask").to(at::kBool);
  if (f.find("grids")) {
    const at::Tensor g = f.tensor("grids").to(at::kLong).contiguous();
    std::vector<qlora::models::ImageGrid> grids;
    for (int64_t i = 0; i < g.size(0); ++i) grids.push_back({g[i][0].item<int64_t>(), g[i][1].item<int64_t>(), g[i][2].item<int64_t>()});
    in.positions = qlora::models::mrope_positions(in.mask, grids, f.tensor("spatial_merge").item<int64_t>(), position_ids.cpu())
                       .to(device);
  }
  in.mask = in.mask.to(device);
  return in;
}

// --image-files: the images' ImageInputs through the checkpoint's processor and tower.
qlora::models::ImageInputs tower_images(const std::string& checkpoint, const std::string& files, const at::Tensor& ids,
                                        const at::Tensor& position_ids, const qlora::models::DecoderLoadOptions& opt,
                                        const qlora::models::DecoderModel& model) {
  const qlora::images::ImageProcessor processor = qlora::images::processor_from_dir(checkpoint);
  std::vector<qlora::images::ProcessedImage> processed;
  std::stringstream fs(files);
  for (std::string f; std::getline(fs, f, ',');) processed.push_back(processor.process(qlora::images::load_image(f), f));
  qlora::models::vision::TowerLoadOptions t;
  t.base_in_nf4 = opt.base_in_nf4;
  t.compute_dtype = model.compute_dtype;
  t.device = opt.device;
  const auto tower = qlora::models::vision::load_tower(checkpoint, t);
  return qlora::models::image_inputs(*tower, processed, ids, position_ids.to(opt.device), model.config);
}

// --generate N [--batch-lengths ...]: the greedy continuations as "ids" in `out` (see the header).
void write_generation(const qlora::models::DecoderModel& model, const at::Tensor& ids, int64_t generate_n,
                      const std::vector<int64_t>& batch_lengths, int64_t generations, const std::string& out,
                      const qlora::models::ImageInputs* images = nullptr) {
  if (!batch_lengths.empty() && static_cast<int64_t>(batch_lengths.size()) != ids.size(0))
    usage("--batch-lengths: one per row");
  qlora::models::GenerateOptions g;  // greedy, no stop ids
  g.max_new_tokens = generate_n;
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t r = 0; r < ids.size(0); ++r) {
    const at::Tensor row = ids[r].cpu().contiguous();
    const int64_t len = batch_lengths.empty() ? row.numel() : batch_lengths[static_cast<size_t>(r)];
    if (len < 1 || len > row.numel()) usage("--batch-lengths: each must be in [1, row length]");
    prompts.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + len);
  }
  std::vector<std::vector<int64_t>> results;
  if (batch_lengths.empty()) {
    for (const auto& prompt : prompts) results.push_back(qlora::models::generate(model, prompt, g, images));
  } else {
    std::vector<qlora::models::BatchSequence> seqs;
    for (int64_t i = 0; i < ids.size(0) * generations; ++i) seqs.push_back({i / generations, g});
    for (auto& c : qlora::models::generate_batch(model, prompts, seqs)) results.push_back(std::move(c.ids));
  }
  std::vector<int64_t> all;
  for (const std::vector<int64_t>& got : results) {
    if (static_cast<int64_t>(got.size()) != generate_n)
      throw std::runtime_error("generate returned " + std::to_string(got.size()) + " ids, wanted " +
                               std::to_string(generate_n));
    all.insert(all.end(), got.begin(), got.end());
  }
  const int64_t rows = static_cast<int64_t>(results.size());
  const at::Tensor t = at::tensor(all, at::TensorOptions().dtype(at::kLong)).view({rows, generate_n});
  qlora::io::save_safetensors(out, {{"ids", t}});
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, tokens, out, packed, images, image_files;
  int64_t generate_n = -1, decode_from = -1, generations = 1;
  std::vector<int64_t> batch_lengths;
  qlora::models::DecoderLoadOptions opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--checkpoint") checkpoint = value();
    else if (a == "--tokens") tokens = value();
    else if (a == "--out") out = value();
    else if (a == "--nf4") opt.base_in_nf4 = true;
    else if (a == "--device") opt.device = at::Device(value());
    else if (a == "--packed") packed = value();
    else if (a == "--images") images = value();
    else if (a == "--image-files") image_files = value();
    else if (a == "--generate") generate_n = parse_ints(value(), "--generate").at(0);
    else if (a == "--batch-lengths") batch_lengths = parse_ints(value(), "--batch-lengths");
    else if (a == "--generations") generations = parse_ints(value(), "--generations").at(0);
    else if (a == "--decode-from") decode_from = parse_ints(value(), "--decode-from").at(0);
    else if (a == "--dtype") {
      const std::string d = value();
      if (d == "fp32") opt.compute_dtype = at::kFloat;
      else if (d == "bf16") opt.compute_dtype = at::kBFloat16;
      else usage("--dtype must be fp32 or bf16");
    } else {
      usage("unknown argument '" + a + "'");
    }
  }
  if (checkpoint.empty() || tokens.empty() || out.empty()) usage("--checkpoint, --tokens and --out are required");
  if (!packed.empty() + (generate_n >= 0) + (decode_from >= 0) > 1 || (!images.empty() && (generate_n >= 0 || decode_from >= 0)) ||
      (!image_files.empty() && decode_from >= 0))
    usage("--packed, --decode-from and --generate exclude each other, --images takes --packed or nothing, "
          "--image-files no --decode-from");
  try {
    const at::Tensor ids = parse_tokens(tokens).to(opt.device);  // [batch, seq]
    const qlora::models::DecoderModel model = qlora::models::load_decoder(checkpoint, opt);
    at::NoGradGuard no_grad;
    if (generate_n >= 0) {
      if (!image_files.empty() && (ids.size(0) != 1 || !batch_lengths.empty()))
        usage("--image-files with --generate: one row, no --batch-lengths");
      const qlora::models::ImageInputs in =
          image_files.empty() ? qlora::models::ImageInputs{}
                              : tower_images(checkpoint, image_files, ids, at::arange(ids.size(1), ids.options()).expand_as(ids),
                                             opt, model);
      write_generation(model, ids, generate_n, batch_lengths, generations, out, image_files.empty() ? nullptr : &in);
      return 0;
    }
    at::Tensor logits;  // [batch, seq, vocab] fp32
    if (decode_from >= 0) {
      if (decode_from < 1 || decode_from > ids.size(1)) usage("--decode-from must be in [1, seq]");
      c10::InferenceMode as_generation;  // generation's kernels: decode matmul and decode attention
      qlora::modules::KvCache cache;
      std::vector<at::Tensor> steps{model.forward(ids.narrow(1, 0, decode_from), &cache)};
      for (int64_t t = decode_from; t < ids.size(1); ++t) steps.push_back(model.forward(ids.narrow(1, t, 1), &cache));
      logits = at::cat(steps, 1);
    } else if (packed.empty() && images.empty() && image_files.empty()) {
      logits = model.forward(ids);
    } else {
      const std::vector<int64_t> lengths = packed.empty() ? std::vector<int64_t>{ids.size(1)} : parse_ints(packed, "--packed");
      const auto [position_ids, mask] = packed_inputs(lengths, ids.size(0), ids.size(1));
      const qlora::models::ImageInputs in =
          !image_files.empty() ? tower_images(checkpoint, image_files, ids, position_ids, opt, model)
          : images.empty()     ? qlora::models::ImageInputs{}
                               : read_images(images, position_ids, opt.device, model.compute_dtype);
      const bool with = !images.empty() || !image_files.empty();
      logits = model.forward(ids, position_ids.to(opt.device), mask.to(opt.device), nullptr, with ? &in : nullptr);
    }
    qlora::io::save_safetensors(out, {{"logits", logits.cpu().contiguous()}});
  } catch (const std::exception& e) {
    std::cerr << "llama_logits: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
