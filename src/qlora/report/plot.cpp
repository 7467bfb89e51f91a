#include "qlora/report/plot.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string_view>

#include "qlora/io/read_file.h"

namespace qlora::report {
namespace {

using nlohmann::json;

// ------------------------------------------------------------------ reading metrics.jsonl

// The row's `key` as a point: absent or null is no point, a number a point when finite; any
// other type is a malformed row.
void add_point(std::vector<CurvePoint>& series, const json& row, const char* key, const std::string& where) {
  const auto it = row.find(key);
  if (it == row.end() || it->is_null()) return;
  if (!it->is_number())
    throw std::invalid_argument(where + ": \"" + key + "\" is " + it->dump() + "; expected a number or null");
  const double v = it->get<double>();
  if (std::isfinite(v)) series.push_back({row["step"].get<double>(), v});
}

void add_row(RunCurves& c, const json& row, const std::string& where) {
  if (!row.is_object() || !row.contains("step") || !row["step"].is_number_integer())
    throw std::invalid_argument(where + ": expected a JSON object with an integer \"step\" (a metrics.jsonl row)");
  const auto skipped = row.find("skipped");
  const bool is_skipped = skipped != row.end() && skipped->is_boolean() && skipped->get<bool>();
  if (is_skipped) c.skipped_steps.push_back(row["step"].get<double>());
  else add_point(c.loss, row, "loss", where);
  add_point(c.val_loss, row, "val_loss", where);
  add_point(c.lr, row, "lr", where);
  add_point(c.tokens_per_second, row, "tokens_per_second", where);
  add_point(c.reward_margins, row, "rewards/margins", where);
  add_point(c.val_reward_margins, row, "val_rewards/margins", where);
  add_point(c.reward_accuracies, row, "rewards/accuracies", where);
  add_point(c.val_reward_accuracies, row, "val_rewards/accuracies", where);
  add_point(c.reward, row, "reward", where);
  add_point(c.val_reward, row, "val_reward", where);
  add_point(c.completion_length, row, "completions/mean_length", where);
  add_point(c.val_completion_length, row, "val_completions/mean_length", where);
}

// Every series of a run (R: RunCurves or const RunCurves).
template <class R>
auto all_series(R& c) {
  return std::vector{&c.loss, &c.val_loss, &c.lr, &c.tokens_per_second, &c.reward_margins, &c.val_reward_margins,
                     &c.reward_accuracies, &c.val_reward_accuracies, &c.reward, &c.val_reward,
                     &c.completion_length, &c.val_completion_length};
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char ch) { return ch == ' ' || ch == '\t' || ch == '\r'; });
}

void sort_by_step(std::vector<CurvePoint>& s) {
  std::stable_sort(s.begin(), s.end(), [](const CurvePoint& a, const CurvePoint& b) { return a.step < b.step; });
}

// ------------------------------------------------------------------ axes

// Heckbert's nice numbers: 1, 2 or 5 times a power of ten near x (round: nearest; else at least x).
double nice_number(double x, bool round) {
  const double e = std::pow(10.0, std::floor(std::log10(x)));
  const double f = x / e;
  if (round) return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * e;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * e;
}

// The largest (up: smallest) 1, 2 or 5 times a power of ten at most (up: at least) v > 0.
double nice_125(double v, bool up) {
  const double e = std::pow(10.0, std::floor(std::log10(v)));
  const double steps[] = {1, 2, 5, 10};
  if (up) {
    for (const double s : steps)
      if (s * e >= v * (1 - 1e-12)) return s * e;
    return 10 * e;
  }
  for (int k = 3; k >= 0; --k)
    if (steps[k] * e <= v * (1 + 1e-12)) return steps[k] * e;
  return e;
}

// ------------------------------------------------------------------ SVG writing

constexpr double kWidth = 960, kLeft = 84, kRight = 24;
constexpr double kPlotHeight = 170, kPanelHeight = 250;
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

const char* color_of(size_t run) { return kColors[run % (sizeof kColors / sizeof kColors[0])]; }

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", v);
  return b;
}

std::string escape(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

std::string text(double x, double y, std::string_view body, std::string_view attrs = "") {
  return "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\"" + (attrs.empty() ? "" : " ") + std::string(attrs) + ">" +
         escape(body) + "</text>\n";
}

std::string line(double x1, double y1, double x2, double y2, std::string_view attrs) {
  return "<line x1=\"" + num(x1) + "\" y1=\"" + num(y1) + "\" x2=\"" + num(x2) + "\" y2=\"" + num(y2) + "\" " +
         std::string(attrs) + "/>\n";
}

// A panel's plot area and the maps from data to pixels.
struct Frame {
  double left = kLeft, top = 0, width = kWidth - kLeft - kRight, height = kPlotHeight;
  PlotAxis x, y;
  double px(double step) const { return left + (step - x.lo) / (x.hi - x.lo) * width; }
  double py(double v) const {
    const auto t = [&](double u) { return y.log ? std::log10(u) : u; };
    return top + (t(y.hi) - t(v)) / (t(y.hi) - t(y.lo)) * height;
  }
};

struct PanelSpec {
  const char* key;    // data-panel
  const char* title;  // shown above the panel
  const char* ylabel;
  std::vector<std::vector<CurvePoint> RunCurves::*> series;
  std::vector<const char*> series_names;
  bool from_zero;  // the y axis starts at 0 (rates); else it fits the data (losses)
};

std::string ticks(const Frame& f) {
  std::string out;
  for (const double t : f.x.ticks) {
    const double x = f.px(t);
    out += "<g class=\"xtick\">" + line(x, f.top, x, f.top + f.height + 4, "stroke=\"#e3e3e3\"") +
           text(x, f.top + f.height + 17, tick_label(t, f.x), "text-anchor=\"middle\"") + "</g>\n";
  }
  for (const double t : f.y.ticks) {
    const double y = f.py(t);
    out += "<g class=\"ytick\">" + line(f.left - 4, y, f.left + f.width, y, "stroke=\"#e3e3e3\"") +
           text(f.left - 7, y + 4, tick_label(t, f.y), "text-anchor=\"end\"") + "</g>\n";
  }
  return out;
}

std::string polyline(const Frame& f, const std::vector<CurvePoint>& pts, const RunCurves& run, size_t index,
                     const char* series, bool dashed) {
  std::string points;
  for (const auto& p : pts) points += (points.empty() ? "" : " ") + num(f.px(p.step)) + "," + num(f.py(p.value));
  std::string out = "<polyline data-run=\"" + escape(run.name) + "\" data-series=\"" + series + "\" data-count=\"" +
                    std::to_string(pts.size()) + "\" fill=\"none\" stroke=\"" + color_of(index) +
                    "\" stroke-width=\"1.6\" stroke-linejoin=\"round\"" +
                    (dashed ? " stroke-dasharray=\"7 4\"" : "") + " points=\"" + points + "\"/>\n";
  // Validation has few points and a lone point draws no line: mark those.
  if (dashed || pts.size() == 1)
    for (const auto& p : pts)
      out += "<circle class=\"marker\" cx=\"" + num(f.px(p.step)) + "\" cy=\"" + num(f.py(p.value)) +
             "\" r=\"3\" fill=\"" + color_of(index) + "\"/>\n";
  return out;
}

// Steps whose update was dropped: short bars in the run's colour along the bottom of the panel.
std::string skipped_marks(const Frame& f, const RunCurves& run, size_t index) {
  if (run.skipped_steps.empty()) return "";
  std::string d;
  for (const double s : run.skipped_steps)
    d += "M" + num(f.px(s)) + " " + num(f.top + f.height) + "v-8";
  return "<path data-run=\"" + escape(run.name) + "\" data-series=\"skipped\" data-count=\"" +
         std::to_string(run.skipped_steps.size()) + "\" stroke=\"" + color_of(index) +
         "\" stroke-width=\"2\" d=\"" + d + "\"/>\n";
}

PlotAxis y_axis_for(const PanelSpec& spec, const std::vector<RunCurves>& runs, bool* has_data) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& run : runs)
    for (const auto member : spec.series)
      for (const auto& p : run.*member) lo = std::min(lo, p.value), hi = std::max(hi, p.value);
  *has_data = lo <= hi;
  if (!*has_data) return nice_linear_axis(0, 1);
  if (spec.from_zero) return nice_linear_axis(std::min(0.0, lo), std::max(0.0, hi));
  if (lo > 0 && hi / lo >= 10) return nice_log_axis(lo, hi);
  return nice_linear_axis(lo, hi);
}

std::string panel(const PanelSpec& spec, const std::vector<RunCurves>& runs, const PlotAxis& x, double top) {
  Frame f;
  f.top = top + 26;
  f.x = x;
  bool has_data = false;
  f.y = y_axis_for(spec, runs, &has_data);
  std::string out = std::string("<g class=\"panel\" data-panel=\"") + spec.key + "\" data-scale=\"" +
                    (f.y.log ? "log" : "linear") + "\">\n";
  out += text(f.left, top + 16, std::string(spec.title) + (f.y.log ? " (log scale)" : ""),
              "font-size=\"14\" font-weight=\"bold\"");
  out += ticks(f);
  out += "<rect x=\"" + num(f.left) + "\" y=\"" + num(f.top) + "\" width=\"" + num(f.width) + "\" height=\"" +
         num(f.height) + "\" fill=\"none\" stroke=\"#888\"/>\n";
  out += text(f.left + f.width / 2, f.top + f.height + 34, "step", "text-anchor=\"middle\"");
  const double ly = f.top + f.height / 2;
  out += text(18, ly, spec.ylabel, "text-anchor=\"middle\" transform=\"rotate(-90 18 " + num(ly) + ")\"");
  if (!has_data) out += text(f.left + f.width / 2, ly, "no data", "text-anchor=\"middle\" fill=\"#888\"");
  for (size_t r = 0; r < runs.size(); ++r) {
    for (size_t s = 0; s < spec.series.size(); ++s) {
      const auto& pts = runs[r].*spec.series[s];
      if (!pts.empty()) out += polyline(f, pts, runs[r], r, spec.series_names[s], s > 0);
    }
    if (spec.key == std::string_view("loss")) out += skipped_marks(f, runs[r], r);
  }
  return out + "</g>\n";
}

// Run names in their colours, wrapped into rows, then what the line styles mean. Returns the
// height used.
double legend(std::string& out, const std::vector<RunCurves>& runs, double top) {
  bool any_val = false, any_skipped = false;
  for (const auto& r : runs) any_val |= !r.val_loss.empty(), any_skipped |= !r.skipped_steps.empty();
  std::vector<std::pair<std::string, std::string>> entries;  // (label, swatch)
  for (size_t r = 0; r < runs.size(); ++r)
    entries.push_back({runs[r].name, "stroke=\"" + std::string(color_of(r)) + "\" stroke-width=\"3\""});
  entries.push_back({"training", "stroke=\"#444\" stroke-width=\"1.6\""});
  if (any_val) entries.push_back({"validation", "stroke=\"#444\" stroke-width=\"1.6\" stroke-dasharray=\"7 4\""});
  if (any_skipped) entries.push_back({"skipped step (non-finite)", "stroke=\"#444\" stroke-width=\"2\""});
  out += "<g class=\"legend\">\n";
  double x = kLeft, y = top;
  for (size_t k = 0; k < entries.size(); ++k) {
    const double w = 40 + 7.2 * static_cast<double>(entries[k].first.size());
    if (x + w > kWidth - kRight && x > kLeft) x = kLeft, y += 20;
    const bool is_run = k < runs.size();
    out += std::string("<g") + (is_run ? " data-run=\"" + escape(entries[k].first) + "\"" : "") + ">" +
           line(x, y - 4, x + 24, y - 4, entries[k].second) + text(x + 30, y, entries[k].first) + "</g>\n";
    x += w + 12;
  }
  out += "</g>\n";
  return y - top + 20;
}

}  // namespace

RunCurves read_run_curves(const std::string& path, const std::string& name) {
  const auto contents = io::read_file(path, io::kNoSizeBound);
  if (!contents) throw std::invalid_argument(path + ": cannot read (a run's metrics.jsonl)");
  const std::string& all = *contents;
  RunCurves c;
  c.name = name;
  size_t rows = 0, line_no = 0;
  for (size_t at = 0; at < all.size();) {
    const size_t nl = all.find('\n', at);
    const bool complete = nl != std::string::npos;
    const std::string_view row_text(all.data() + at, (complete ? nl : all.size()) - at);
    at = complete ? nl + 1 : all.size();
    ++line_no;
    if (is_blank(row_text)) continue;
    const json row = json::parse(row_text, nullptr, false);
    if (row.is_discarded() && !complete) break;  // the row the run is writing now
    const std::string where = path + ": line " + std::to_string(line_no);
    if (row.is_discarded()) throw std::invalid_argument(where + ": not valid JSON");
    add_row(c, row, where);
    ++rows;
  }
  if (rows == 0) throw std::invalid_argument(path + ": no rows (has the run finished a step yet?)");
  for (auto* s : all_series(c)) sort_by_step(*s);
  std::sort(c.skipped_steps.begin(), c.skipped_steps.end());
  return c;
}

PlotAxis nice_linear_axis(double min, double max, int target_ticks) {
  if (!(max > min)) {
    const double pad = min == 0 ? 1 : std::fabs(min) * 0.1;
    min -= pad, max += pad;
  }
  const double step = nice_number(nice_number(max - min, false) / std::max(1, target_ticks - 1), true);
  PlotAxis a;
  a.lo = std::floor(min / step + 1e-9) * step;
  a.hi = std::ceil(max / step - 1e-9) * step;
  const auto n = static_cast<int64_t>(std::llround((a.hi - a.lo) / step));
  for (int64_t k = 0; k <= n; ++k) a.ticks.push_back(a.lo + static_cast<double>(k) * step);
  return a;
}

PlotAxis nice_log_axis(double min, double max) {
  if (!(min > 0) || !(max >= min)) throw std::invalid_argument("nice_log_axis: needs 0 < min <= max");
  PlotAxis a;
  a.log = true;
  a.lo = nice_125(min, false);
  a.hi = nice_125(max, true);
  if (a.hi <= a.lo) a.hi = nice_125(a.lo * 1.5, true);
  // Every 1, 2, 5 between them when that stays readable, else the powers of ten (and both ends).
  const bool dense = a.hi / a.lo <= 100;
  for (double e = std::pow(10.0, std::floor(std::log10(a.lo))); e <= a.hi * (1 + 1e-9); e *= 10)
    for (const double m : {1.0, 2.0, 5.0}) {
      const double t = m * e;
      const bool end = std::fabs(t / a.lo - 1) < 1e-9 || std::fabs(t / a.hi - 1) < 1e-9;
      if (t >= a.lo * (1 - 1e-9) && t <= a.hi * (1 + 1e-9) && (dense || m == 1 || end)) a.ticks.push_back(t);
    }
  return a;
}

std::string tick_label(double value, const PlotAxis& axis) {
  char b[48];
  if (axis.log) {
    std::snprintf(b, sizeof b, "%g", value);
    return b;
  }
  // The spacing is 1, 2 or 5 times 10^k: -k decimals show every tick exactly.
  const double step = axis.ticks.size() > 1 ? axis.ticks[1] - axis.ticks[0] : 1.0;
  const int decimals = std::clamp(static_cast<int>(-std::floor(std::log10(step) + 1e-9)), 0, 12);
  if (std::fabs(value) < step * 1e-9) return "0";
  std::snprintf(b, sizeof b, "%.*f", decimals, value);
  return b;
}

std::string render_curves_svg(const std::vector<RunCurves>& runs) {
  if (runs.empty()) throw std::invalid_argument("render_curves_svg: no runs");
  double last = 0;
  bool rewards = false, rl = false;
  for (const RunCurves& r : runs) {
    for (const auto* s : all_series(r))
      if (!s->empty()) last = std::max(last, s->back().step);
    rewards |= !r.reward_margins.empty() || !r.val_reward_margins.empty();
    rl |= !r.reward.empty() || !r.val_reward.empty();
  }
  const PlotAxis x = nice_linear_axis(0, std::max(last, 1.0), 8);
  std::vector<PanelSpec> panels = {
      {"loss", "Loss", "loss", {&RunCurves::loss, &RunCurves::val_loss}, {"loss", "val_loss"}, false},
      {"lr", "Learning rate", "learning rate", {&RunCurves::lr}, {"lr"}, true},
      {"tokens_per_second", "Throughput", "tokens/s", {&RunCurves::tokens_per_second}, {"tokens_per_second"}, true}};
  if (rewards) {
    panels.push_back({"reward_margins", "Reward margin (chosen - rejected)", "reward margin",
                      {&RunCurves::reward_margins, &RunCurves::val_reward_margins},
                      {"rewards/margins", "val_rewards/margins"}, false});
    panels.push_back({"reward_accuracies", "Reward accuracy (chosen above rejected)", "accuracy",
                      {&RunCurves::reward_accuracies, &RunCurves::val_reward_accuracies},
                      {"rewards/accuracies", "val_rewards/accuracies"}, true});
  }
  if (rl) {
    panels.push_back({"reward", "Reward (mean per completion)", "reward", {&RunCurves::reward, &RunCurves::val_reward},
                      {"reward", "val_reward"}, false});
    panels.push_back({"completion_length", "Completion length", "tokens",
                      {&RunCurves::completion_length, &RunCurves::val_completion_length},
                      {"completions/mean_length", "val_completions/mean_length"}, true});
  }

  std::string body;
  std::string title = "Training curves:";
  for (size_t r = 0; r < runs.size(); ++r) title += (r ? ", " : " ") + runs[r].name;
  body += text(kLeft, 28, title, "font-size=\"16\" font-weight=\"bold\"");
  double top = 56;
  top += legend(body, runs, top) + 8;
  for (const auto& spec : panels) {
    body += panel(spec, runs, x, top);
    top += kPanelHeight;
  }
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
         num(kWidth) + "\" height=\"" + num(top) + "\" viewBox=\"0 0 " + num(kWidth) + " " + num(top) +
         "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
         "fill=\"white\"/>\n" +
         body + "</svg>\n";
}

}  // namespace qlora::report
