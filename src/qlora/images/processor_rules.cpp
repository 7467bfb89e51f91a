// A model directory's image processor rules: which processor, its values (the file's, else the class
// defaults of transformers 5.23), and the token strings of its text expansion.
#include "qlora/images/processor.h"

#include "qlora/io/read_file.h"

#include <nlohmann/json.hpp>

#include <array>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

namespace qlora::images {
namespace {

using nlohmann::json;

[[noreturn]] void refuse(const std::string& where, const std::string& what) {
  throw ImageProcessorError(where + ": " + what);
}

std::optional<json> load_json(const std::string& path) {
  std::optional<std::string> text;
  try {
    text = io::read_file(path);
  } catch (const std::exception& e) {
    refuse(path, e.what());
  }
  if (!text) return std::nullopt;
  json parsed = json::parse(*text, nullptr, false);
  if (parsed.is_discarded() || !parsed.is_object()) refuse(path, "not a JSON object");
  return parsed;
}

// One JSON object of rules and the file (and section) it came from, for errors. A key that is absent
// or null takes the class default, as transformers' processors take theirs.
struct Section {
  const json& j;
  std::string where;

  const json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  [[noreturn]] void bad(const char* key, const char* expected) const {
    refuse(where, std::string("\"") + key + "\" must be " + expected + ", not " + j.at(key).dump());
  }
  int64_t integer(const char* key, int64_t fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_number_integer() || v->get<int64_t>() <= 0) bad(key, "a positive integer");
    return v->get<int64_t>();
  }
  double number(const char* key, double fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_number()) bad(key, "a number");
    return v->get<double>();
  }
  bool flag(const char* key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) bad(key, "true or false");
    return v->get<bool>();
  }
  // image_mean / image_std: three numbers, or one for every channel (as tvF.normalize broadcasts it).
  std::array<double, 3> triple(const char* key, std::array<double, 3> fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (v->is_number()) return {v->get<double>(), v->get<double>(), v->get<double>()};
    if (!v->is_array() || v->size() != 3 || !(*v)[0].is_number() || !(*v)[1].is_number() || !(*v)[2].is_number())
      bad(key, "three numbers (R, G, B)");
    return {(*v)[0].get<double>(), (*v)[1].get<double>(), (*v)[2].get<double>()};
  }
  Resample resample(Resample fallback) const {
    const json* v = find("resample");
    if (v == nullptr) return fallback;
    if (!v->is_number_integer()) bad("resample", "one of PIL's resampling numbers");
    const int64_t r = v->get<int64_t>();
    if (r == 2) return Resample::bilinear;
    if (r == 3) return Resample::bicubic;
    static const char* const kNames[] = {"nearest", "lanczos", "bilinear", "bicubic", "box", "hamming"};
    refuse(where, std::string("\"resample\": ") + std::to_string(r) + " (" + (r >= 0 && r < 6 ? kNames[r] : "unknown") +
                      "): only bilinear (2) and bicubic (3) are computed here");
  }
};

constexpr std::array<double, 3> kClipMean{0.48145466, 0.4578275, 0.40821073};  // OPENAI_CLIP_MEAN
constexpr std::array<double, 3> kClipStd{0.26862954, 0.26130258, 0.27577711};   // OPENAI_CLIP_STD
constexpr std::array<double, 3> kHalf{0.5, 0.5, 0.5};                          // IMAGENET_STANDARD_*

std::optional<ProcessorKind> kind_of_name(const std::string& name) {
  auto is = [&](const char* prefix) { return name.rfind(prefix, 0) == 0; };
  if (is("Qwen2VLImageProcessor") || is("Qwen3VLProcessor") || is("Qwen2VLProcessor") || is("Qwen2_5_VLProcessor"))
    return ProcessorKind::qwen2_vl;
  if (is("Gemma3ImageProcessor") || is("Gemma3Processor")) return ProcessorKind::gemma3;
  if (is("Gemma4ImageProcessor") || is("Gemma4Processor")) return ProcessorKind::gemma4;
  if (name == "qwen3_5" || name == "qwen3_5_moe" || name == "qwen3_vl" || name == "qwen3_vl_moe" || name == "qwen2_vl" ||
      name == "qwen2_5_vl")
    return ProcessorKind::qwen2_vl;
  if (name == "gemma3") return ProcessorKind::gemma3;
  if (name == "gemma4") return ProcessorKind::gemma4;
  return std::nullopt;
}

// As AutoImageProcessor picks the class: image_processor_type, else the processor's class, else the
// model's config.json model_type.
ProcessorKind kind_of(const Section& s, const std::optional<json>& processor, const std::string& dir) {
  for (const char* key : {"image_processor_type", "processor_class"}) {
    const json* v = s.find(key);
    if (v != nullptr && v->is_string()) {
      if (auto kind = kind_of_name(v->get<std::string>())) return *kind;
      refuse(s.where, std::string("\"") + key + "\": " + v->dump() +
                          " is not an image processor computed here (Qwen2-VL's, Gemma 3's, Gemma 4's)");
    }
  }
  if (processor && processor->contains("processor_class") && (*processor)["processor_class"].is_string())
    if (auto kind = kind_of_name((*processor)["processor_class"].get<std::string>())) return *kind;
  if (auto config = load_json(dir + "/config.json"); config && config->contains("model_type") &&
                                                       (*config)["model_type"].is_string())
    if (auto kind = kind_of_name((*config)["model_type"].get<std::string>())) return *kind;
  refuse(s.where, "names no image processor (image_processor_type, processor_class, or config.json's model_type)");
}

// "size": {a: ..., b: ...}, both required where the file has a size; `fallback` (the class's) where not.
std::pair<int64_t, int64_t> size_entries(const Section& s, const char* a, const char* b, std::pair<int64_t, int64_t> fallback) {
  const json* size = s.find("size");
  if (size == nullptr) return fallback;
  const std::string expected = std::string("an object with ") + a + " and " + b;
  if (!size->is_object()) s.bad("size", expected.c_str());
  const Section entries{*size, s.where + " \"size\""};
  const std::pair<int64_t, int64_t> out{entries.integer(a, 0), entries.integer(b, 0)};
  if (out.first == 0 || out.second == 0) refuse(entries.where, "needs both " + std::string(a) + " and " + b);
  return out;
}

void read_qwen(const Section& s, ProcessorRules& r) {
  r.resample = s.resample(Resample::bicubic);
  r.image_mean = s.triple("image_mean", kClipMean);
  r.image_std = s.triple("image_std", kClipStd);
  r.patch_size = s.integer("patch_size", 14);
  r.temporal_patch_size = s.integer("temporal_patch_size", 2);
  r.merge_size = s.integer("merge_size", 2);
  std::tie(r.min_pixels, r.max_pixels) = size_entries(s, "shortest_edge", "longest_edge", {56 * 56, 28 * 28 * 1280});
  r.min_pixels = s.integer("min_pixels", r.min_pixels);  // the older keys override size, as __init__ does
  r.max_pixels = s.integer("max_pixels", r.max_pixels);
}

void read_gemma3(const Section& s, ProcessorRules& r) {
  r.resample = s.resample(Resample::bilinear);
  r.image_mean = s.triple("image_mean", kHalf);
  r.image_std = s.triple("image_std", kHalf);
  std::tie(r.height, r.width) = size_entries(s, "height", "width", {224, 224});
  if (s.flag("do_pan_and_scan", false))
    refuse(s.where, "\"do_pan_and_scan\": true: Gemma 3's pan-and-scan crops are not computed here");
}

void read_gemma4(const Section& s, ProcessorRules& r) {
  r.resample = s.resample(Resample::bicubic);
  r.image_mean = s.triple("image_mean", {0.0, 0.0, 0.0});
  r.image_std = s.triple("image_std", {1.0, 1.0, 1.0});
  r.patch_size = s.integer("patch_size", 16);
  r.pooling_kernel_size = s.integer("pooling_kernel_size", 3);
  r.max_soft_tokens = s.integer("max_soft_tokens", 280);
  const int64_t t = r.max_soft_tokens;
  if (t != 70 && t != 140 && t != 280 && t != 560 && t != 1120)
    refuse(s.where, "\"max_soft_tokens\": " + std::to_string(t) + " must be one of 70, 140, 280, 560, 1120");
}

// A special token's string as the tokenizer holds it: tokenizer_config.json's top-level "<name>" or its
// extra_special_tokens / model_specific_special_tokens entry, else special_tokens_map.json's.
std::string token_string(const std::string& dir, const char* name, const char* fallback) {
  auto text_of = [](const json& v) -> std::optional<std::string> {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
    return std::nullopt;
  };
  for (const char* file : {"/tokenizer_config.json", "/special_tokens_map.json"}) {
    const std::optional<json> j = load_json(dir + file);
    if (!j) continue;
    if (auto it = j->find(name); it != j->end())
      if (auto s = text_of(*it)) return *s;
    for (const char* group : {"extra_special_tokens", "model_specific_special_tokens"}) {
      auto g = j->find(group);
      if (g != j->end() && g->is_object() && g->contains(name))
        if (auto s = text_of((*g)[name])) return *s;
    }
  }
  return fallback;
}

void read_text(const std::string& dir, const std::optional<json>& processor, const json& pre, ProcessorRules& r) {
  switch (r.kind) {
    case ProcessorKind::qwen2_vl: r.image_token = token_string(dir, "image_token", "<|image_pad|>"); break;
    case ProcessorKind::gemma3: {
      r.boi_token = token_string(dir, "boi_token", "<start_of_image>");
      r.image_token = token_string(dir, "image_token", "<image_soft_token>");
      r.eoi_token = token_string(dir, "eoi_token", "<end_of_image>");
      // Gemma3Processor's image_seq_length: processor_config.json's, else the older files' copy in
      // preprocessor_config.json, else its default.
      const json* from = processor && processor->contains("image_seq_length") ? &*processor : &pre;
      r.image_seq_length = Section{*from, dir + " image_seq_length"}.integer("image_seq_length", 256);
      break;
    }
    case ProcessorKind::gemma4:
      r.boi_token = token_string(dir, "boi_token", "<|image>");
      r.image_token = token_string(dir, "image_token", "<|image|>");
      r.eoi_token = token_string(dir, "eoi_token", "<image|>");
      break;
  }
}

}  // namespace

const char* processor_kind_name(ProcessorKind kind) {
  switch (kind) {
    case ProcessorKind::qwen2_vl: return "qwen2_vl";
    case ProcessorKind::gemma3: return "gemma3";
    default: return "gemma4";
  }
}

namespace {
bool nested_rules(const std::optional<json>& processor) {
  return processor && processor->contains("image_processor") && (*processor)["image_processor"].is_object();
}
}  // namespace

bool has_processor_rules(const std::string& dir) {
  return std::filesystem::exists(dir + "/preprocessor_config.json") || nested_rules(load_json(dir + "/processor_config.json"));
}

ProcessorRules read_processor_rules(const std::string& dir) {
  const std::optional<json> processor = load_json(dir + "/processor_config.json");
  const std::optional<json> pre = load_json(dir + "/preprocessor_config.json");
  const json empty = json::object();
  const bool nested = nested_rules(processor);
  if (!nested && !pre)
    refuse(dir, "no preprocessor_config.json, nor a processor_config.json with an \"image_processor\" section");
  const json& rules_json = nested ? (*processor)["image_processor"] : *pre;
  const Section s{rules_json, nested ? dir + "/processor_config.json \"image_processor\"" : dir + "/preprocessor_config.json"};
  ProcessorRules r;
  r.kind = kind_of(s, processor, dir);
  if (!s.flag("do_resize", true)) refuse(s.where, "\"do_resize\": false is not computed here");
  r.do_convert_rgb = s.flag("do_convert_rgb", true);
  r.do_rescale = s.flag("do_rescale", true);
  r.rescale_factor = s.number("rescale_factor", 1.0 / 255.0);
  switch (r.kind) {
    case ProcessorKind::qwen2_vl: read_qwen(s, r); break;
    case ProcessorKind::gemma3: read_gemma3(s, r); break;
    case ProcessorKind::gemma4: read_gemma4(s, r); break;
  }
  r.do_normalize = s.flag("do_normalize", r.kind != ProcessorKind::gemma4);
  read_text(dir, processor, pre ? *pre : empty, r);
  return r;
}

ImageProcessor processor_from_dir(const std::string& dir) { return ImageProcessor(read_processor_rules(dir)); }

}  // namespace qlora::images
