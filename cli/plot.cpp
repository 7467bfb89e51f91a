// `qlora plot`: the training curves of one or several runs as one SVG picture (see
// report/plot.h), from each run's metrics.jsonl.
//
//   qlora plot OUT_DIR [OUT_DIR ...] [-o FILE]
//
// OUT_DIR is a run's checkpoint.output_dir (or its metrics.jsonl); each run is named in the
// legend by its directory. Default FILE: OUT_DIR/plot.svg for one run, ./plot.svg for several.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "qlora/io/durable_file.h"
#include "qlora/report/plot.h"
#include "cli/cli.h"

namespace qlora::cli {

namespace {

// The run's metrics.jsonl and its legend name (the directory's, as given: "out/tiny/" -> "tiny").
std::pair<std::string, std::string> locate_metrics(const std::string& arg) {
  namespace fs = std::filesystem;
  fs::path p = fs::path(arg).lexically_normal();
  if (p.has_filename() && fs::is_regular_file(p))
    return {p.string(), fs::absolute(p).parent_path().filename().string()};
  if (!fs::is_directory(p)) throw UsageError(arg + ": no such directory (expected a run's output_dir)");
  if (!p.has_filename()) p = p.parent_path();  // a trailing slash
  const fs::path metrics = p / "metrics.jsonl";
  if (!fs::is_regular_file(metrics))
    throw UsageError(arg + ": no metrics.jsonl (expected a run's checkpoint.output_dir)");
  std::string name = fs::absolute(p).lexically_normal().filename().string();
  return {metrics.string(), name.empty() ? arg : name};
}

int plot(const std::vector<std::string>& dirs, std::string out) {
  std::vector<report::RunCurves> runs;
  for (const auto& d : dirs) {
    auto [path, name] = locate_metrics(d);
    for (const auto& r : runs)
      if (r.name == name) name = d;  // two runs of the same name: tell them apart by their paths
    runs.push_back(report::read_run_curves(path, name));
  }
  if (out.empty())
    out = dirs.size() == 1 ? (std::filesystem::path(locate_metrics(dirs[0]).first).parent_path() / "plot.svg").string()
                           : "plot.svg";
  io::write_file_atomic(out, report::render_curves_svg(runs));
  size_t steps = 0;
  for (const auto& r : runs) steps = std::max(steps, r.loss.size());
  std::printf("wrote %s (%zu run%s, up to %zu steps)\n", out.c_str(), runs.size(), runs.size() == 1 ? "" : "s", steps);
  return 0;
}

}  // namespace

Command plot_command(CLI::App& cmd) {
  auto dirs = std::make_shared<std::vector<std::string>>();
  auto out = std::make_shared<std::string>();
  cmd.add_option("OUT_DIR", *dirs, "a run's checkpoint.output_dir (or its metrics.jsonl), one per run")->required();
  cmd.add_option("-o,--output", *out, "the picture (default OUT_DIR/plot.svg; ./plot.svg for several runs)")
      ->type_name("FILE.svg");
  return [dirs, out] { return plot(*dirs, *out); };
}

}  // namespace qlora::cli
