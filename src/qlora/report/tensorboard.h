// TensorBoard event files (logging.tensorboard = true): the numbers of each metrics.jsonl row as
// scalars, under OUTPUT_DIR/tb, written by rank 0 beside metrics.jsonl.
//
// The format is written here rather than through a library: TensorFlow's event writer comes with
// TensorFlow (or tensorboardX with Python), and all it takes is TFRecord framing (a length, the
// payload, each with a masked CRC32C) around a protobuf Event of four fields:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
// The first event of a file holds file_version "brain.Event:2", as TensorBoard expects.
// tests/recipes/test_tensorboard.py reads the files with the PyPI tensorboard package.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <string>

namespace qlora::report {

// CRC-32C (Castagnoli), as TFRecord frames use it (before masking).
uint32_t crc32c(const void* data, size_t n);

class TensorBoardLog {
 public:
  // Creates `dir`. Earlier event files there keep only their events of steps <= resume_step
  // (rewritten atomically; a torn record from a crash is dropped; resume_step 0 removes them), so
  // a resumed run appends without repeating the steps the interrupted one logged past its last
  // checkpoint. Then opens a new event file.
  TensorBoardLog(const std::string& dir, int64_t resume_step);
  ~TensorBoardLog();
  TensorBoardLog(const TensorBoardLog&) = delete;
  TensorBoardLog& operator=(const TensorBoardLog&) = delete;

  // Every finite number of a metrics row except "step" and "epoch" as a scalar at row["step"],
  // tagged by its key ("loss", "val_loss", "rewards/margins", ...); one event, flushed.
  void add_row(const nlohmann::json& row);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace qlora::report
