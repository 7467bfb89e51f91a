// Training curves of one or several runs as one SVG (`qlora plot`): panels for the loss
// (training solid, validation dashed with markers), the learning rate and the throughput over
// optimizer steps, and where a run logged them (lora_dpo) the reward margin and accuracy; runs
// overlaid in distinct colours, nice tick values on every axis.
//
// Every drawn series is a <polyline data-run="NAME" data-series="loss|val_loss|lr|tokens_per_second"
// data-count="N">, each panel a <g class="panel" data-panel=... data-scale="linear|log"> holding
// its ticks as <g class="xtick|ytick"><line/><text>VALUE</text></g>, so a reader (or a test) can
// map the points back to the metrics through the tick labels.
#pragma once

#include <string>
#include <vector>

namespace qlora::report {

struct CurvePoint {
  double step = 0;
  double value = 0;
};

// One run's curves, read from its metrics.jsonl.
struct RunCurves {
  std::string name;  // the legend's label
  std::vector<CurvePoint> loss, val_loss, lr, tokens_per_second;
  std::vector<double> skipped_steps;  // rows marked "skipped": true (a non-finite step dropped)
  // Preference tuning (lora_dpo): rewards/margins and rewards/accuracies, training and validation.
  std::vector<CurvePoint> reward_margins, val_reward_margins, reward_accuracies, val_reward_accuracies;
  // RL with rewards (lora_grpo): the mean reward and completion length, training and validation.
  std::vector<CurvePoint> reward, val_reward, completion_length, val_completion_length;
};

// Reads a metrics.jsonl: one JSON object a line with an integer "step"; "loss", "val_loss",
// "lr", "tokens_per_second", "[val_]rewards/margins|accuracies", "[val_]reward" and
// "[val_]completions/mean_length" each give a point where they are finite numbers (absent, null or
// non-finite: no point; a skipped row gives no loss). Throws std::invalid_argument naming the
// file and the 1-based line of a malformed line; a last line without its newline that does not
// parse is a row still being written and is left out. A file without rows is an error too.
RunCurves read_run_curves(const std::string& metrics_path, const std::string& name);

// An axis from lo to hi with ticks at round values, lo and hi being ticks themselves.
struct PlotAxis {
  double lo = 0, hi = 1;
  bool log = false;  // log10 scale: ticks at 1, 2 and 5 times powers of ten
  std::vector<double> ticks;
};
// Linear: about target_ticks ticks 1, 2 or 5 times a power of ten apart, covering [min, max]
// (an empty range is widened around its value).
PlotAxis nice_linear_axis(double min, double max, int target_ticks = 6);
// Log: min > 0; lo and hi are the nearest 1, 2 or 5 times a power of ten outside [min, max].
PlotAxis nice_log_axis(double min, double max);
// How a tick value is written: as few digits as the tick spacing needs.
std::string tick_label(double value, const PlotAxis& axis);

// The whole picture. The loss panel is logarithmic when the losses span a factor of 10 or more.
std::string render_curves_svg(const std::vector<RunCurves>& runs);

}  // namespace qlora::report
