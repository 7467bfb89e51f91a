#include "qlora/data/record_images.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <stdexcept>

namespace qlora::data {

using nlohmann::json;

bool is_image_part(const json& part) {
  if (!part.is_object()) return false;
  const auto t = part.find("type");
  if (t != part.end()) return t->is_string() && (*t == "image" || *t == "image_url");
  return part.contains("image") || part.contains("image_url");
}

namespace {

bool is_url(const std::string& s) {
  for (const char* scheme : {"http://", "https://", "ftp://", "data:"})
    if (s.rfind(scheme, 0) == 0) return true;
  return false;
}

// An image from its source: a path (relative to base_dir) or {"bytes", "path"} (datasets' Image struct).
RecordImage image_of(const json& src, const std::string& name, const std::string& base_dir) {
  RecordImage img;
  img.name = name;
  std::string path;
  if (src.is_string()) {
    path = src.get<std::string>();
  } else if (src.is_object() && (src.contains("bytes") || src.contains("path"))) {
    const json bytes = src.value("bytes", json());
    if (bytes.is_binary()) img.bytes.assign(bytes.get_binary().begin(), bytes.get_binary().end());
    else if (!bytes.is_null())
      throw std::invalid_argument(name + ".bytes is " + std::string(bytes.type_name()) +
                                  ", expected the image file's bytes (a Parquet binary column)");
    const json p = src.value("path", json());
    if (p.is_string()) path = p.get<std::string>();
    else if (!p.is_null()) throw std::invalid_argument(name + ".path is " + std::string(p.type_name()) + ", expected a string");
    if (!img.bytes.empty()) {
      if (!path.empty()) img.name += " (" + path + ")";
      return img;
    }
  } else {
    throw std::invalid_argument(name + " is " + std::string(src.type_name()) +
                                ", expected a path or {\"bytes\", \"path\"} (datasets' Image struct)");
  }
  if (path.empty()) throw std::invalid_argument(name + " has neither bytes nor a path");
  if (is_url(path))
    throw std::invalid_argument(name + " is a URL (" + path.substr(0, 80) +
                                "): images are read from files (nothing is downloaded); download it and give its path");
  const std::filesystem::path p(path);
  img.path = p.is_absolute() || base_dir.empty() ? p.string() : (std::filesystem::path(base_dir) / p).string();
  img.name += " (" + img.path + ")";
  return img;
}

// An image part's own source ("image", "path", "url", or image_url's url); null: none (the record's next
// "images" entry stands for it).
const json* part_source(const json& part) {
  for (const char* key : {"image", "path", "url"})
    if (const auto it = part.find(key); it != part.end() && !it->is_null()) return &*it;
  if (const auto it = part.find("image_url"); it != part.end() && !it->is_null())
    return it->is_object() && it->contains("url") ? &it->at("url") : &*it;
  return nullptr;
}

}  // namespace

std::vector<ContentPart> placeholder_parts(const std::string& text) {
  std::vector<ContentPart> parts;
  size_t at = 0;
  for (size_t hit; (hit = text.find(kImagePlaceholder, at)) != std::string::npos; at = hit + kImagePlaceholder.size()) {
    if (hit > at) parts.push_back({text.substr(at, hit - at), false});
    parts.push_back({"", true});
  }
  if (parts.empty()) return parts;
  if (at < text.size()) parts.push_back({text.substr(at), false});
  return parts;
}

std::vector<RecordImage> record_images(const json& record, const std::string& messages_key, const std::string& base_dir) {
  const json* listed = nullptr;
  if (const auto it = record.find("images"); it != record.end() && !it->is_null()) {
    if (!it->is_array()) throw std::invalid_argument("field \"images\" is " + std::string(it->type_name()) + ", expected a list");
    listed = &*it;
  }
  size_t next = 0;
  std::vector<RecordImage> out;
  const auto take_listed = [&](const std::string& where) {
    if (!listed || next >= listed->size())
      throw std::invalid_argument(where + " is an image without a source, and the record's \"images\" list has " +
                                  std::to_string(listed ? listed->size() : 0) + " entries for it");
    out.push_back(image_of((*listed)[next], "images[" + std::to_string(next) + "]", base_dir));
    ++next;
  };
  const auto turns = record.find(messages_key);
  if (turns != record.end() && turns->is_array()) {
    for (size_t k = 0; k < turns->size(); ++k) {
      const json& turn = (*turns)[k];
      const char* body = turn.contains("content") ? "content" : "value";
      const std::string where = messages_key + "[" + std::to_string(k) + "]." + body;
      const json content = turn.value(body, json());
      if (content.is_array()) {
        for (size_t i = 0; i < content.size(); ++i) {
          if (!is_image_part(content[i])) continue;
          const std::string part = where + "[" + std::to_string(i) + "]";
          if (const json* src = part_source(content[i])) out.push_back(image_of(*src, part, base_dir));
          else take_listed(part);
        }
      } else if (content.is_string() && listed) {
        for (const ContentPart& part : placeholder_parts(content.get<std::string>()))
          if (part.image) take_listed(where + " (\"<image>\")");
      }
    }
  }
  if (listed && next != listed->size())
    throw std::invalid_argument("field \"images\" lists " + std::to_string(listed->size()) + " images, the messages show " +
                                std::to_string(next) + " (\"<image>\" in their text, or {\"type\": \"image\"} parts)");
  return out;
}

}  // namespace qlora::data
