// The images of a chat record (issue 52), in the forms the ecosystem ships:
//   - message content as parts (transformers' chat format): {"type": "image", "image": PATH} beside
//     {"type": "text", "text": ...}; "path" for "image", and {"type": "image_url", "image_url": {"url"}}
//     are read too; a part without a source ({"type": "image"}, TRL's form) takes the record's next
//     "images" entry;
//   - a record-level "images": [PATH, ...] with "<image>" placeholders in the messages' text (LLaVA,
//     LLaMA-Factory);
//   - Parquet / Hub data sets whose image column holds {"bytes", "path"} structs, as `datasets`
//     writes them (bytes win; the path then only names the image).
// Paths are relative to the data file; URLs are refused by name (nothing is downloaded at run time).
// Their order is the order the messages show them, which is the order the template renders their
// placeholders and the processor replaces them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "qlora/data/templates.h"

namespace qlora::data {

// LLaVA's placeholder for an image in a message's text.
inline constexpr std::string_view kImagePlaceholder = "<image>";

// Text with LLaVA's "<image>" placeholders (a record with an "images" list) as parts, each placeholder an
// image part; empty when the text has none.
std::vector<ContentPart> placeholder_parts(const std::string& text);

// Whether a content part is an image ({"type": "image" / "image_url"}, or a part holding an "image" key).
bool is_image_part(const nlohmann::json& part);

// One image of a record: a file, or bytes in the record; `name` says which for errors
// ("messages[0].content[1]", "images[2]", with the path where there is one).
struct RecordImage {
  std::string path;            // absolute or relative to the working directory; empty with bytes
  std::vector<uint8_t> bytes;  // the encoded file, as a Parquet struct holds it
  std::string name;
};

// The images of `record` (its messages under `messages_key`), in order; `base_dir`: the data file's
// directory, for relative paths. Throws std::invalid_argument naming the key when a source is not a
// path or {"bytes", "path"}, is a URL, or when image parts and the "images" list disagree in number.
std::vector<RecordImage> record_images(const nlohmann::json& record, const std::string& messages_key,
                                       const std::string& base_dir);

}  // namespace qlora::data
