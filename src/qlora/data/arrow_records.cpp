#include "qlora/data/arrow_records.h"

#ifdef QLORA_WITH_ARROW
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <parquet/arrow/reader.h>
#endif

#include <cstdint>
#include <exception>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace qlora::data {
namespace {

using nlohmann::json;

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

const char* kind_name(ArrowFileKind kind) {
  return kind == ArrowFileKind::kParquet ? "Parquet file" : kind == ArrowFileKind::kIpcFile ? "Arrow IPC file"
                                                                                          : "Arrow IPC stream";
}

#ifdef QLORA_WITH_ARROW

// Arrow reports errors as Status / Result; these turn them into exceptions that read_arrow_records
// prefixes with the file (a Parquet decoder may also throw ParquetException, a std::exception).
void check(const arrow::Status& s) {
  if (!s.ok()) throw std::runtime_error(s.ToString());
}

template <class T>
T value_of(arrow::Result<T> r) {
  check(r.status());
  return std::move(r).ValueUnsafe();
}

json value_at(const arrow::Array& a, int64_t i);

template <class ListLike>
json list_at(const arrow::Array& array, int64_t i) {
  const auto& a = static_cast<const ListLike&>(array);
  const arrow::Array& values = *a.values();  // the whole child: value_offset(i) indexes into it
  json out = json::array();
  const int64_t begin = a.value_offset(i), n = a.value_length(i);
  for (int64_t k = 0; k < n; ++k) out.push_back(value_at(values, begin + k));
  return out;
}

template <class BinaryLike>
std::string_view bytes_at(const arrow::Array& a, int64_t i) {
  return static_cast<const BinaryLike&>(a).GetView(i);
}

json binary_of(std::string_view v) { return json::binary(std::vector<std::uint8_t>(v.begin(), v.end())); }

template <class NumericLike>
json number_at(const arrow::Array& a, int64_t i) {
  return static_cast<const NumericLike&>(a).Value(i);
}

json struct_at(const arrow::Array& array, int64_t i) {
  const auto& a = static_cast<const arrow::StructArray&>(array);
  json out = json::object();
  for (int k = 0; k < a.num_fields(); ++k)
    out[a.struct_type()->field(k)->name()] = value_at(*a.field(k), i);  // field(k): sliced as `a` is
  return out;
}

json value_at(const arrow::Array& a, int64_t i) {
  using T = arrow::Type;
  if (a.IsNull(i)) return nullptr;
  switch (a.type_id()) {
    case T::NA: return nullptr;
    case T::BOOL: return static_cast<const arrow::BooleanArray&>(a).Value(i);
    case T::INT8: return number_at<arrow::Int8Array>(a, i);
    case T::INT16: return number_at<arrow::Int16Array>(a, i);
    case T::INT32: return number_at<arrow::Int32Array>(a, i);
    case T::INT64: return number_at<arrow::Int64Array>(a, i);
    case T::UINT8: return number_at<arrow::UInt8Array>(a, i);
    case T::UINT16: return number_at<arrow::UInt16Array>(a, i);
    case T::UINT32: return number_at<arrow::UInt32Array>(a, i);
    case T::UINT64: return number_at<arrow::UInt64Array>(a, i);
    case T::FLOAT: return static_cast<double>(static_cast<const arrow::FloatArray&>(a).Value(i));
    case T::DOUBLE: return number_at<arrow::DoubleArray>(a, i);
    case T::STRING: return std::string(bytes_at<arrow::StringArray>(a, i));
    case T::LARGE_STRING: return std::string(bytes_at<arrow::LargeStringArray>(a, i));
    case T::STRING_VIEW: return std::string(bytes_at<arrow::StringViewArray>(a, i));
    case T::BINARY: return binary_of(bytes_at<arrow::BinaryArray>(a, i));
    case T::LARGE_BINARY: return binary_of(bytes_at<arrow::LargeBinaryArray>(a, i));
    case T::BINARY_VIEW: return binary_of(bytes_at<arrow::BinaryViewArray>(a, i));
    case T::FIXED_SIZE_BINARY: return binary_of(bytes_at<arrow::FixedSizeBinaryArray>(a, i));
    case T::LIST: return list_at<arrow::ListArray>(a, i);
    case T::LARGE_LIST: return list_at<arrow::LargeListArray>(a, i);
    case T::LIST_VIEW: return list_at<arrow::ListViewArray>(a, i);
    case T::LARGE_LIST_VIEW: return list_at<arrow::LargeListViewArray>(a, i);
    case T::FIXED_SIZE_LIST: return list_at<arrow::FixedSizeListArray>(a, i);
    case T::MAP: return list_at<arrow::MapArray>(a, i);  // entries struct<key, value>
    case T::STRUCT: return struct_at(a, i);
    case T::DICTIONARY: {
      const auto& d = static_cast<const arrow::DictionaryArray&>(a);
      return value_at(*d.dictionary(), d.GetValueIndex(i));
    }
    default:  // timestamps, dates, decimals, half floats, unions ...: Arrow's text for the value
      return value_of(a.GetScalar(i))->ToString();
  }
}

// The next record batch of a file, or null at its end.
using NextBatch = std::function<std::shared_ptr<arrow::RecordBatch>()>;

NextBatch open_batches(const std::string& path, ArrowFileKind kind) {
  const std::shared_ptr<arrow::io::ReadableFile> file = value_of(arrow::io::ReadableFile::Open(path));
  if (kind == ArrowFileKind::kParquet) {
    // One row group at a time, on this thread (ArrowReaderProperties' default: no thread pool). The
    // batch reader borrows the file reader: both live as long as the lambda.
    std::shared_ptr<parquet::arrow::FileReader> parquet_file =
        value_of(parquet::arrow::OpenFile(file, arrow::default_memory_pool()));
    std::shared_ptr<arrow::RecordBatchReader> reader = value_of(parquet_file->GetRecordBatchReader());
    return [parquet_file, reader] { return value_of(reader->Next()); };
  }
  auto options = arrow::ipc::IpcReadOptions::Defaults();
  options.use_threads = false;
  if (kind == ArrowFileKind::kIpcStream) {
    std::shared_ptr<arrow::RecordBatchReader> reader = value_of(arrow::ipc::RecordBatchStreamReader::Open(file, options));
    return [reader] { return value_of(reader->Next()); };
  }
  auto reader = value_of(arrow::ipc::RecordBatchFileReader::Open(file, options));
  return [reader, n = 0]() mutable -> std::shared_ptr<arrow::RecordBatch> {
    return n < reader->num_record_batches() ? value_of(reader->ReadRecordBatch(n++)) : nullptr;
  };
}

#endif  // QLORA_WITH_ARROW

}  // namespace

ArrowFileKind arrow_file_kind(const std::string& path) {
  if (ends_with(path, ".parquet")) return ArrowFileKind::kParquet;
  if (ends_with(path, ".feather")) return ArrowFileKind::kIpcFile;
  char head[6] = {};
  std::ifstream in(path, std::ios::binary);
  const std::streamsize got = in.read(head, sizeof head) ? sizeof head : in.gcount();
  const std::string_view magic(head, static_cast<size_t>(got));
  if (magic.substr(0, 4) == "PAR1") return ArrowFileKind::kParquet;
  if (magic == "ARROW1") return ArrowFileKind::kIpcFile;
  if (ends_with(path, ".arrow") || magic.substr(0, 4) == "\xff\xff\xff\xff") return ArrowFileKind::kIpcStream;
  return ArrowFileKind::kNone;
}

#ifndef QLORA_WITH_ARROW
void read_arrow_records(const std::string& path, const std::function<void(const nlohmann::json&, const std::string&)>&) {
  throw std::runtime_error(path + ": this qlora was built without Apache Arrow (CMake found no pyarrow), so it " +
                           "cannot read this " + kind_name(arrow_file_kind(path)) + "; install pyarrow " +
                           "(scripts/setup.sh does) and rebuild, or convert the data to JSONL");
}
#else
void read_arrow_records(const std::string& path,
                        const std::function<void(const nlohmann::json& record, const std::string& origin)>& take) {
  const ArrowFileKind kind = arrow_file_kind(path);
  const std::string what = kind_name(kind);
  // Everything Arrow does runs in here; `take` runs outside, so its errors pass through as they are.
  const auto arrow_call = [&](const auto& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ": not a readable " + what + ": " + e.what());
    }
  };
  const NextBatch next = arrow_call([&] { return open_batches(path, kind); });
  int64_t row = 0;
  while (const std::shared_ptr<arrow::RecordBatch> batch = arrow_call(next)) {
    // Offsets, lengths and UTF-8 checked before any value is read: a damaged file is an error, not a crash.
    arrow_call([&] { return (check(batch->ValidateFull()), 0); });
    const int columns = batch->num_columns();
    for (int64_t r = 0; r < batch->num_rows(); ++r) {
      const json record = arrow_call([&] {
        json out = json::object();
        for (int c = 0; c < columns; ++c) out[batch->schema()->field(c)->name()] = value_at(*batch->column(c), r);
        return out;
      });
      take(record, path + ": row " + std::to_string(++row));
    }
  }
}

#endif  // QLORA_WITH_ARROW

}  // namespace qlora::data
