#include "qlora/io/quantize_checkpoint.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <optional>
#include <set>

#include "qlora/ops/nf4_ops.h"
#include "quant/nf4_serialize.h"

namespace qlora::io {
namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_float(Dtype d) { return d == Dtype::F32 || d == Dtype::BF16 || d == Dtype::F16; }

std::vector<EntrySpec> specs_of(const std::vector<Nf4EntrySpec>& nf4_specs) {
  std::vector<EntrySpec> out;
  for (const auto& s : nf4_specs) out.push_back({s.name, from_scalar_type(s.dtype), s.shape});
  return out;
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / 1048576.0);
  return buf;
}

// What one input tensor becomes in the output file.
struct Plan {
  enum Kind { Copy, Quantize, Dequantize } kind = Copy;
  std::string name;  // input tensor name, or the NF4 key for Dequantize
};

// Streams one input file into one output file, tensor by tensor.
class FileConverter {
 public:
  FileConverter(const SafetensorsFile& in, bool quantize, std::optional<at::ScalarType> dtype)
      : in_(in), quantize_(quantize), dtype_(dtype) {}

  // Decides every tensor's fate and the output entries, in input order.
  void plan() {
    std::set<std::string> nf4_done;
    Metadata md = in_.metadata();
    for (const TensorInfo& ti : in_.tensors()) {
      const std::string key = nf4_key_of_entry(ti.name);
      if (quantize_ && is_quantizable(ti)) {
        plans_.push_back({Plan::Quantize, ti.name});
        const auto l = nf4::Layout::make(ti.numel());
        for (auto& s : specs_of(nf4_entry_specs(ti.name, l, to_scalar_type(ti.dtype)))) specs_.push_back(s);
        nf4_add_metadata(ti.name, ti.shape, l, md);
      } else if (!quantize_ && !key.empty()) {
        if (!nf4_done.insert(key).second) continue;
        const Nf4Tensor t = load(key);
        const at::ScalarType st = dtype_.value_or(t.dtype());
        plans_.push_back({Plan::Dequantize, key});
        specs_.push_back({key, from_scalar_type(st), t.shape});
        for (const char* m : {".nf4.shape", ".nf4.block_size", ".nf4.scaler_block_size"}) md.erase(key + m);
      } else {
        plans_.push_back({Plan::Copy, ti.name});
        specs_.push_back({ti.name, ti.dtype, ti.shape});
      }
    }
    if (!quantize_ && md.count("format") && md["format"] == kNf4FormatTag) md["format"] = "pt";
    metadata_ = md;
  }

  const std::vector<EntrySpec>& specs() const { return specs_; }

  void run(const std::string& out_path, ConvertReport& report) {
    SafetensorsWriter w(out_path, specs_, metadata_);
    for (const Plan& p : plans_) {
      if (p.kind == Plan::Copy) {
        const TensorInfo& ti = in_.info(p.name);
        w.write(in_.data(p.name), ti.end - ti.begin);
        report.copied++;
        report.bytes_in += ti.end - ti.begin;
      } else if (p.kind == Plan::Quantize) {
        const TensorInfo& ti = in_.info(p.name);
        const Nf4Tensor t = ops::nf4_quantize(in_.tensor(p.name), in_.path() + ": " + p.name);
        for (const auto& [name, tensor] : nf4_entries(p.name, t)) w.write_tensor(tensor);
        report.converted++;
        report.bytes_in += ti.end - ti.begin;
      } else {
        const Nf4Tensor t = load(p.name);
        w.write_tensor(ops::nf4_dequantize(t, dtype_.value_or(t.dtype())));
        report.converted++;
        report.bytes_in += t.nbytes();
        for (const char* s : kNf4Suffixes) in_.release(p.name + s);
      }
      if (p.kind != Plan::Dequantize) in_.release(p.name);
    }
    w.commit();
    report.bytes_out += w.data_size();
    report.files_written.push_back(out_path);
  }

 private:
  Nf4Tensor load(const std::string& key) const {
    return nf4_from_entries(
        key,
        [&](const std::string& n) { return in_.find(n) ? in_.tensor(n) : at::Tensor(); },
        in_.metadata(), in_.path());
  }

  const SafetensorsFile& in_;
  bool quantize_;
  std::optional<at::ScalarType> dtype_;
  std::vector<Plan> plans_;
  std::vector<EntrySpec> specs_;
  Metadata metadata_;
};

void check_not_inside(const std::string& in, const std::string& out) {
  const fs::path a = fs::weakly_canonical(in), b = fs::weakly_canonical(out);
  if (a == b || (fs::is_directory(a) && b.string().rfind(a.string() + "/", 0) == 0))
    throw std::invalid_argument("output '" + out + "' would overwrite the input '" + in + "'");
}

ConvertReport convert(const std::string& in, const std::string& out, bool quantize,
                      std::optional<at::ScalarType> dtype, const Log& log) {
  check_not_inside(in, out);
  const CheckpointDir ckpt = CheckpointDir::open(in);
  ConvertReport report;
  const bool to_dir = fs::is_directory(in);
  if (to_dir) fs::create_directories(out);
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (const std::string& file : ckpt.files()) {
    const std::string name = fs::path(file).filename().string();
    const std::string out_path = to_dir ? (fs::path(out) / name).string() : out;
    const SafetensorsFile in_file = SafetensorsFile::open(file);
    FileConverter c(in_file, quantize, dtype);
    c.plan();
    for (const EntrySpec& s : c.specs()) weight_map[s.name] = name;
    const ConvertReport before = report;
    c.run(out_path, report);
    total += report.bytes_out - before.bytes_out;
    if (log)
      log("  " + name + ": " + std::to_string(report.converted - before.converted) +
          (quantize ? " tensors to NF4, " : " tensors dequantized, ") +
          std::to_string(report.copied - before.copied) + " copied, " +
          mib(report.bytes_in - before.bytes_in) + " -> " + mib(report.bytes_out - before.bytes_out) +
          " in " + out_path);
  }
  if (to_dir) {
    if (ckpt.is_sharded())
      write_safetensors_index((fs::path(out) / kSafetensorsIndexName).string(), weight_map, total);
    for (const auto& entry : fs::directory_iterator(in)) {  // config.json, tokenizer files, ...
      const std::string fname = entry.path().filename().string();
      if (!entry.is_regular_file() || ends_with(fname, ".safetensors") || fname == kSafetensorsIndexName) continue;
      fs::copy_file(entry.path(), fs::path(out) / fname, fs::copy_options::overwrite_existing);
      report.files_written.push_back((fs::path(out) / fname).string());
    }
  }
  return report;
}

}  // namespace

bool is_quantizable(const TensorInfo& info) {
  return ends_with(info.name, "_proj.weight") && info.shape.size() == 2 && is_float(info.dtype) &&
         info.numel() > 0;
}

ConvertReport quantize_checkpoint(const std::string& in, const std::string& out, const Log& log) {
  return convert(in, out, /*quantize=*/true, std::nullopt, log);
}

ConvertReport dequantize_checkpoint(const std::string& in, const std::string& out,
                                    std::optional<at::ScalarType> dtype, const Log& log) {
  return convert(in, out, /*quantize=*/false, dtype, log);
}

Nf4Tensor load_nf4(const CheckpointDir& ckpt, const std::string& key) {
  if (ckpt.contains(key + kNf4Suffixes[0])) {
    const SafetensorsFile& f = ckpt.file_of(key + kNf4Suffixes[0]);
    return nf4_from_entries(
        key, [&](const std::string& n) { return ckpt.contains(n) ? ckpt.tensor(n) : at::Tensor(); },
        f.metadata(), f.path());
  }
  if (!ckpt.contains(key))
    throw std::invalid_argument("checkpoint '" + ckpt.path() + "': no tensor '" + key +
                                "' (neither as NF4 entries nor as a float tensor)");
  return ops::nf4_quantize(ckpt.tensor(key), ckpt.path() + ": " + key);
}

}  // namespace qlora::io
