// A resume checkpoint directory from untrusted bytes, as `checkpoint.resume = true` reads it: the
// manifest (format, step, world_size, ranks_here, files), meta.json, a rank's state file with its
// tensor order, the recorded input fingerprints and the sampler state.
//
// The input is up to three files separated by the line "--8<--": manifest.json, meta.json,
// rank_00000.safetensors. Unless the input's size is a multiple of 3, every file the manifest
// lists that exists gets its true size and XXH64 written into the manifest first, so mutations
// reach the readers behind the checksums instead of stopping at them. A damaged checkpoint must
// be refused with ResumeError, which resume answers by trying an older one.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/checkpoint/fingerprint.h"
#include "qlora/checkpoint/resume.h"
#include "qlora/checkpoint/xxh64.h"
#include "qlora/data/sampler.h"

namespace fs = std::filesystem;

namespace {

const fs::path& scratch() {
  static const fs::path dir = fs::temp_directory_path() / ("qlora_fuzz_resume_" + std::to_string(::getpid()));
  return dir;
}

std::vector<std::string> split(const std::string& in) {
  const std::string sep = "\n--8<--\n";
  std::vector<std::string> parts;
  size_t at = 0;
  while (parts.size() < 2) {
    const size_t next = in.find(sep, at);
    if (next == std::string::npos) break;
    parts.push_back(in.substr(at, next - at));
    at = next + sep.size();
  }
  parts.push_back(in.substr(at));
  return parts;
}

void write(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// The manifest with true sizes and checksums for the files it lists that exist.
std::string repaired(const fs::path& dir, const std::string& manifest) {
  nlohmann::json m = nlohmann::json::parse(manifest, nullptr, /*allow_exceptions=*/false);
  if (!m.is_object() || !m.contains("files") || !m["files"].is_object()) return manifest;
  for (auto& [name, entry] : m["files"].items()) {
    std::error_code ec;
    if (name.find('/') != std::string::npos || !fs::is_regular_file(dir / name, ec)) continue;
    uint64_t n = 0;
    const uint64_t h = qlora::checkpoint::xxh64_file((dir / name).string(), &n);
    entry = {{"bytes", n}, {"xxh64", qlora::checkpoint::xxh64_hex(h)}};
  }
  return m.dump();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string> parts = split(std::string(reinterpret_cast<const char*>(data), size));
  const fs::path out = scratch(), dir = out / "checkpoints" / "step_00000001";
  fs::remove_all(out);
  fs::create_directories(dir);
  const char* names[] = {"manifest.json", "meta.json", "rank_00000.safetensors"};
  for (size_t i = 1; i < parts.size(); ++i) write(dir / names[i], parts[i]);
  write(dir / names[0], size % 3 ? repaired(dir, parts[0]) : parts[0]);
  // A damaged checkpoint must fail as ResumeError (resume skips it and tries an older one): any
  // other exception escaping the loader is a finding.
  qlora::checkpoint::ResumeCheckpoint ck;
  try {
    (void)qlora::checkpoint::latest_resume_checkpoint(out.string());
    (void)qlora::checkpoint::resume_checkpoint_step(dir.string());
    ck = qlora::checkpoint::load_resume_checkpoint(dir.string());
  } catch (const qlora::checkpoint::ResumeError&) {
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "not a ResumeError: %s\n", e.what());
    std::abort();
  }
  try {
    const nlohmann::json current = {{"data_path", "a.jsonl"}, {"data_fingerprint", "0123456789abcdef"},
                                    {"base_dir", "base"}, {"base_fingerprint", "0123456789abcdef"},
                                    {"tokenizer_path", "base/tokenizer.json"},
                                    {"tokenizer_fingerprint", "0123456789abcdef"}};
    (void)qlora::checkpoint::check_input_fingerprints(ck.meta, current, dir.string());
    if (ck.meta.is_object() && ck.meta.contains("sampler")) {
      qlora::data::Sampler sampler({64, 4, 0, true, true, 1, 0});
      sampler.load_state_json(ck.meta["sampler"].dump(), dir.string() + "/meta.json");
    }
  } catch (const std::exception&) {
  }
  return 0;
}
