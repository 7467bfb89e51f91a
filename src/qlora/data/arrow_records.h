// Parquet and Arrow IPC data files as JSON records: each row becomes the JSON object the JSON /
// JSONL reader would give for it (dataset.h read_json_records), so every record format and column
// mapping downstream reads them unchanged. Read through Apache Arrow's C++ library (the pyarrow
// wheel's libarrow / libparquet; see CMakeLists.txt). This header includes no Arrow header: the
// reader compiles as C++20 (Arrow's headers need it), the rest of qlora as C++17.
#pragma once

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

namespace qlora::data {

enum class ArrowFileKind {
  kNone,       // not a Parquet or Arrow file (JSON, JSONL, ...)
  kParquet,    // ".parquet", or starts with "PAR1"
  kIpcFile,    // Arrow IPC file format (Feather v2): ".feather", or starts with "ARROW1"
  kIpcStream,  // Arrow IPC stream format: ".arrow" (`datasets`' cache and save_to_disk files) not
               // starting with "ARROW1", or starting with the stream's 0xFFFFFFFF continuation marker
};

// By extension first (".parquet", ".arrow", ".feather"), else by the file's first bytes; a file that
// cannot be opened is kNone (its reader names it).
ArrowFileKind arrow_file_kind(const std::string& path);

// Every row of `path` (arrow_file_kind not kNone), in order, as a JSON object {column: value},
// with its origin "<path>: row N" (1-based). Values as `datasets` gives them in Python: null for
// nulls, strings (UTF-8; string, large_string, string_view, dictionary-encoded), integers, floats
// (float32 widened exactly), bools, lists (list, large_list, fixed_size_list, list views) as
// arrays, structs as objects, maps as arrays of {"key", "value"}, binary as JSON binary; other
// types (timestamps, decimals, ...) as Arrow's text for them. A file that is not Parquet / Arrow
// or is damaged (truncated, bad footer, bad pages) throws std::runtime_error naming the file and
// what Arrow found; what `take` throws passes through unchanged.
void read_arrow_records(const std::string& path,
                        const std::function<void(const nlohmann::json& record, const std::string& origin)>& take);

}  // namespace qlora::data
