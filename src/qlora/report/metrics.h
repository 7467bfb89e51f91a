// Per-step training metrics: one JSON object a line in <output_dir>/metrics.jsonl, and the
// progress display (a bar per epoch on a terminal, plain lines otherwise).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "qlora/io/enum_names.h"
#include "qlora/report/tensorboard.h"

namespace qlora::report {

struct StepMetrics {
  int64_t step = 0;   // global optimizer step, 1-based
  int64_t epoch = 0;  // 0-based
  double loss = 0.0;
  double lr = 0.0;
  double tokens_per_second = 0.0;
  int64_t peak_memory_bytes = 0;
  double grad_norm = -1.0;  // < 0: not computed
  int64_t tokens = 0;       // non-masked tokens in the step
  // The loss or gradient norm was not finite and training.on_nonfinite = "skip" dropped the
  // update (a non-finite loss is written as null).
  bool skipped = false;
  // A recipe's own metrics (lora_dpo's rewards/*, logps/*), written after the common ones; those
  // named in kProgressMetrics also go on the progress line.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  nlohmann::json to_json() const;
};

// A validation pass after optimizer step `step`: its own line in metrics.jsonl, told apart from
// step lines by val_loss in place of loss.
struct ValidationMetrics {
  int64_t step = 0;
  int64_t epoch = 0;
  double loss = 0.0;
  double perplexity = 0.0;
  int64_t tokens = 0;
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // prefixed "val_" in the line
  nlohmann::json to_json() const;
};

// Appends to <dir>/metrics.jsonl. Opening with resume_step = k first drops lines of steps > k
// (left by the interrupted run past its last checkpoint), atomically, so the file always
// describes exactly one run history. Each line is flushed as it is written. With `tensorboard`,
// each line's numbers also go to TensorBoard event files in <dir>/tb (tensorboard.h), which
// drop steps > k the same way.
class MetricsLog {
 public:
  MetricsLog(const std::string& output_dir, int64_t resume_step, bool tensorboard = false);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void append(const StepMetrics& m);
  void append(const ValidationMetrics& m);
  const std::string& path() const { return path_; }

 private:
  void append_row(const nlohmann::json& row);
  std::string path_;
  std::FILE* file_ = nullptr;
  std::unique_ptr<TensorBoardLog> tensorboard_;
};

enum class ProgressMode { Auto, Bar, Plain };
inline constexpr io::EnumName<ProgressMode> kProgressModeNames[] = {
    {ProgressMode::Auto, "auto"}, {ProgressMode::Bar, "bar"}, {ProgressMode::Plain, "plain"}};
// Throws std::invalid_argument listing the names.
ProgressMode parse_progress_mode(const std::string& s);
const char* progress_mode_name(ProgressMode mode);

// One bar per epoch: "epoch 1/3 [#####.....] 50/100 loss 1.234 lr 2.0e-04 3.1k tok/s
// mem 1.2 GiB eta 0:42". Plain mode prints the same fields as a line every `every` steps.
class Progress {
 public:
  Progress(ProgressMode mode, std::FILE* out = stdout);
  void start_epoch(int64_t epoch, int64_t num_epochs, int64_t steps_in_epoch, int64_t first_step);
  void update(const StepMetrics& m, int64_t step_in_epoch, int64_t every = 1);
  // A line of its own (the bar goes on below it).
  void validation(const ValidationMetrics& v);
  // The epoch's summary: steps run, mean training loss of this process's steps, skipped steps,
  // the last validation of the epoch if there was one, and the time taken.
  void end_epoch();
  bool is_bar() const { return bar_; }

 private:
  std::string line(const StepMetrics& m, int64_t step_in_epoch) const;
  void write_line(const std::string& text);  // ends a bar in progress first
  std::FILE* out_;
  bool bar_;
  bool bar_open_ = false;
  int64_t epoch_ = 0, num_epochs_ = 1, steps_ = 0, first_step_ = 0;
  double loss_sum_ = 0.0;
  int64_t losses_ = 0, skipped_ = 0;
  std::optional<ValidationMetrics> last_validation_;
  std::chrono::steady_clock::time_point start_;
};

std::string format_bytes(int64_t bytes);    // "1.2 GiB"
std::string format_duration(double seconds);  // "1:02:03" or "2:03"

}  // namespace qlora::report
