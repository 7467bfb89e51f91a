#include "qlora/report/metrics.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "qlora/io/durable_file.h"

namespace qlora::report {

nlohmann::json StepMetrics::to_json() const {
  nlohmann::json j = {{"step", step},
                      {"epoch", epoch},
                      {"loss", loss},
                      {"lr", lr},
                      {"tokens_per_second", tokens_per_second},
                      {"peak_memory_bytes", peak_memory_bytes},
                      {"tokens", tokens}};
  if (grad_norm >= 0 || std::isnan(grad_norm)) j["grad_norm"] = grad_norm;  // NaN is written as null
  if (skipped) j["skipped"] = true;
  for (const auto& [k, v] : extra.items()) j[k] = v;
  return j;
}

nlohmann::json ValidationMetrics::to_json() const {
  nlohmann::json j = {{"step", step}, {"epoch", epoch}};
  if (!std::isnan(loss)) j["val_loss"] = loss;  // NaN: the recipe validates by other measures (GRPO's reward)
  if (perplexity >= 0) j["val_perplexity"] = perplexity;
  j["val_tokens"] = tokens;
  for (const auto& [k, v] : extra.items()) j["val_" + k] = v;
  return j;
}

namespace {
// Recipe metrics shown on the progress line, by their short names.
constexpr std::pair<const char*, const char*> kProgressMetrics[] = {
    {"rewards/accuracies", "acc"}, {"rewards/margins", "margin"}, {"reward", "reward"}, {"completions/mean_length", "len"}};
// " val_loss X", or nothing where the recipe has no validation loss (NaN).
std::string val_loss_text(const ValidationMetrics& v) {
  if (std::isnan(v.loss)) return "";
  char buf[48];
  std::snprintf(buf, sizeof buf, " val_loss %.4f", v.loss);
  return buf;
}

std::string shown_extra(const nlohmann::ordered_json& extra) {
  std::string out;
  char buf[64];
  for (const auto& [key, label] : kProgressMetrics)
    if (extra.contains(key) && extra[key].is_number()) {
      std::snprintf(buf, sizeof buf, " %s %.3f", label, extra[key].get<double>());
      out += buf;
    }
  return out;
}
}  // namespace

MetricsLog::MetricsLog(const std::string& output_dir, int64_t resume_step, bool tensorboard)
    : path_(output_dir + "/metrics.jsonl") {
  ::mkdir(output_dir.c_str(), 0755);  // the caller creates parents; an existing dir is fine
  std::ifstream in(path_);
  if (in) {
    // Keep the history up to the resumed step; later lines belong to work that was lost.
    std::string kept, line;
    bool dropped = false;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) {
        dropped = true;  // a torn last line from a crash, or foreign content: not ours to keep
        continue;
      }
      if (j["step"].get<int64_t>() > resume_step) {
        dropped = true;
        continue;
      }
      kept += line + "\n";
    }
    in.close();
    if (dropped || resume_step == 0) io::write_file_atomic(path_, resume_step == 0 ? "" : kept);
  }
  file_ = std::fopen(path_.c_str(), "a");
  if (!file_) throw std::runtime_error("cannot open " + path_ + " for appending");
  if (tensorboard) tensorboard_ = std::make_unique<TensorBoardLog>(output_dir + "/tb", resume_step);
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

namespace {
void append_line(std::FILE* file, const std::string& path, const nlohmann::json& j) {
  const std::string s = j.dump() + "\n";
  if (std::fwrite(s.data(), 1, s.size(), file) != s.size() || std::fflush(file) != 0)
    throw std::runtime_error("cannot write " + path);
}
}  // namespace

void MetricsLog::append_row(const nlohmann::json& row) {
  append_line(file_, path_, row);
  if (tensorboard_) tensorboard_->add_row(row);
}

void MetricsLog::append(const StepMetrics& m) { append_row(m.to_json()); }
void MetricsLog::append(const ValidationMetrics& m) { append_row(m.to_json()); }

ProgressMode parse_progress_mode(const std::string& s) {
  return io::enum_from_name(kProgressModeNames, s, "progress mode");
}

const char* progress_mode_name(ProgressMode mode) { return io::enum_name(kProgressModeNames, mode); }

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(s / 3600), (long long)(s / 60 % 60), (long long)(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", (long long)(s / 60), (long long)(s % 60));
  return buf;
}

Progress::Progress(ProgressMode mode, std::FILE* out)
    : out_(out), bar_(mode == ProgressMode::Bar || (mode == ProgressMode::Auto && ::isatty(::fileno(out)))) {}

void Progress::start_epoch(int64_t epoch, int64_t num_epochs, int64_t steps_in_epoch, int64_t first_step) {
  epoch_ = epoch;
  num_epochs_ = num_epochs;
  steps_ = steps_in_epoch;
  first_step_ = first_step;
  start_ = std::chrono::steady_clock::now();
  loss_sum_ = 0.0;
  losses_ = skipped_ = 0;
  last_validation_.reset();
}

std::string Progress::line(const StepMetrics& m, int64_t done) const {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t run = done - first_step_;  // steps done in this process (resume starts mid-epoch)
  const double eta = run > 0 ? elapsed / run * (steps_ - done) : NAN;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%lld/%lld loss %.4f%s lr %.2e %.0f tok/s mem %s eta %s", (long long)done,
                (long long)steps_, m.loss, shown_extra(m.extra).c_str(), m.lr, m.tokens_per_second,
                format_bytes(m.peak_memory_bytes).c_str(), format_duration(eta).c_str());
  return buf;
}

void Progress::update(const StepMetrics& m, int64_t done, int64_t every) {
  if (m.skipped) ++skipped_;
  else loss_sum_ += m.loss, ++losses_;
  if (m.skipped) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "epoch %lld/%lld step %lld: loss %g, grad norm %g: not finite, no update",
                  (long long)(epoch_ + 1), (long long)num_epochs_, (long long)m.step, m.loss, m.grad_norm);
    write_line(buf);
  } else if (bar_) {
    bar_open_ = true;
    constexpr int kWidth = 24;
    const int filled = steps_ > 0 ? static_cast<int>(kWidth * done / steps_) : kWidth;
    std::fprintf(out_, "\r\033[Kepoch %lld/%lld [%s%s] %s", (long long)(epoch_ + 1), (long long)num_epochs_,
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(), line(m, done).c_str());
  } else if (every <= 1 || done % every == 0 || done == steps_) {
    std::fprintf(out_, "epoch %lld/%lld step %lld %s\n", (long long)(epoch_ + 1), (long long)num_epochs_,
                 (long long)m.step, line(m, done).c_str());
  }
  std::fflush(out_);
}

void Progress::write_line(const std::string& text) {
  if (bar_open_) std::fputc('\n', out_);
  bar_open_ = false;
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void Progress::validation(const ValidationMetrics& v) {
  last_validation_ = v;
  char buf[256];
  if (v.perplexity >= 0)
    std::snprintf(buf, sizeof buf, "epoch %lld/%lld step %lld val_loss %.4f ppl %.2f (%lld tokens)",
                  (long long)(v.epoch + 1), (long long)num_epochs_, (long long)v.step, v.loss, v.perplexity,
                  (long long)v.tokens);
  else
    std::snprintf(buf, sizeof buf, "epoch %lld/%lld step %lld%s%s (%lld tokens)", (long long)(v.epoch + 1),
                  (long long)num_epochs_, (long long)v.step, val_loss_text(v).c_str(), shown_extra(v.extra).c_str(),
                  (long long)v.tokens);
  write_line(buf);
}

void Progress::end_epoch() {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string text = "epoch " + std::to_string(epoch_ + 1) + "/" + std::to_string(num_epochs_) + " done: " +
                     std::to_string(losses_ + skipped_) + " steps";
  char buf[96];
  if (losses_ > 0) std::snprintf(buf, sizeof buf, ", train loss %.4f (mean)", loss_sum_ / losses_), text += buf;
  if (skipped_ > 0) text += ", " + std::to_string(skipped_) + " skipped (not finite)";
  if (last_validation_) {
    const ValidationMetrics& v = *last_validation_;
    if (v.perplexity >= 0) std::snprintf(buf, sizeof buf, ", val_loss %.4f ppl %.2f", v.loss, v.perplexity);
    else std::snprintf(buf, sizeof buf, ",%s%s", val_loss_text(v).c_str(), shown_extra(v.extra).c_str());
    text += buf;
  }
  write_line(text + ", " + format_duration(elapsed));
}

}  // namespace qlora::report
