// metrics.jsonl and the progress display.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "qlora/report/metrics.h"

namespace qlora::report {
namespace {

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string l; std::getline(in, l);) out.push_back(nlohmann::json::parse(l));
  return out;
}

std::string temp_dir() {
  std::string t = ::testing::TempDir() + "qlora_metrics_XXXXXX";
  if (!::mkdtemp(t.data())) throw std::runtime_error("mkdtemp");
  return t;
}

StepMetrics at(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.epoch = step / 10;
  m.loss = 1.0 / step;
  m.lr = 1e-4;
  m.tokens_per_second = 100;
  m.peak_memory_bytes = 1 << 20;
  return m;
}

TEST(MetricsLog, OneObjectPerStepWithTheRequiredFields) {
  const std::string dir = temp_dir();
  {
    MetricsLog log(dir, 0);
    for (int s = 1; s <= 3; ++s) log.append(at(s));
  }
  const auto lines = read_lines(dir + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  for (const char* k : {"step", "epoch", "loss", "lr", "tokens_per_second", "peak_memory_bytes"})
    EXPECT_TRUE(lines[1].contains(k)) << k;
  EXPECT_EQ(lines[2]["step"], 3);
  EXPECT_DOUBLE_EQ(lines[1]["loss"].get<double>(), 0.5);
}

TEST(MetricsLog, ResumeDropsStepsPastTheCheckpointAndTornLines) {
  const std::string dir = temp_dir();
  {
    MetricsLog log(dir, 0);
    for (int s = 1; s <= 7; ++s) log.append(at(s));
  }
  { std::ofstream(dir + "/metrics.jsonl", std::ios::app) << "{\"step\": 8, \"lo"; }  // killed mid-write
  {
    MetricsLog log(dir, 5);  // resumed from the checkpoint of step 5
    log.append(at(6));
  }
  const auto lines = read_lines(dir + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 6u);
  for (size_t i = 0; i < lines.size(); ++i) EXPECT_EQ(lines[i]["step"], static_cast<int>(i + 1));
  { MetricsLog fresh(dir, 0); }  // a new run starts a new history
  EXPECT_TRUE(read_lines(dir + "/metrics.jsonl").empty());
}

TEST(Progress, PlainLinesCarryLossLrThroughputMemoryAndEta) {
  std::FILE* f = std::tmpfile();
  Progress p(ProgressMode::Plain, f);
  EXPECT_FALSE(p.is_bar());
  p.start_epoch(0, 2, 4, 0);
  for (int s = 1; s <= 4; ++s) p.update(at(s), s, 2);
  p.end_epoch();
  std::rewind(f);
  std::string text(4096, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), f));
  std::fclose(f);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3);  // every 2nd step, and the summary
  EXPECT_NE(text.find("epoch 1/2 step 2 2/4 loss 0.5000 lr 1.00e-04 100 tok/s mem 1.0 MiB eta"), std::string::npos) << text;
  EXPECT_NE(text.find("step 4 4/4"), std::string::npos);
  EXPECT_NE(text.find("epoch 1/2 done: 4 steps, train loss 0.5208 (mean), 0:00"), std::string::npos) << text;
}

// A skipped (non-finite) step gets a line of its own and is counted apart in the summary; a
// validation gets its line and the summary repeats the epoch's last.
TEST(Progress, SkippedStepsAndValidationInLinesAndSummary) {
  std::FILE* f = std::tmpfile();
  Progress p(ProgressMode::Plain, f);
  p.start_epoch(1, 2, 3, 0);
  p.update(at(1), 1, 10);
  StepMetrics bad = at(2);
  bad.loss = NAN;
  bad.skipped = true;
  p.update(bad, 2, 10);
  p.validation(ValidationMetrics{2, 1, 1.5, std::exp(1.5), 40});
  p.update(at(3), 3, 10);
  p.end_epoch();
  std::rewind(f);
  std::string text(4096, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), f));
  std::fclose(f);
  EXPECT_NE(text.find("epoch 2/2 step 2: loss nan"), std::string::npos) << text;
  EXPECT_NE(text.find("not finite, no update"), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 2/2 step 2 val_loss 1.5000 ppl 4.48 (40 tokens)"), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 2/2 done: 3 steps, train loss 0.6667 (mean), 1 skipped (not finite), val_loss 1.5000 ppl 4.48"),
            std::string::npos) << text;
}

TEST(MetricsLog, SkippedAndValidationRows) {
  StepMetrics bad = at(3);
  bad.loss = NAN;
  bad.grad_norm = NAN;
  bad.skipped = true;
  const nlohmann::json j = nlohmann::json::parse(bad.to_json().dump());
  EXPECT_TRUE(j["loss"].is_null());
  EXPECT_TRUE(j["grad_norm"].is_null());
  EXPECT_EQ(j["skipped"], true);
  EXPECT_FALSE(at(3).to_json().contains("skipped"));
  const nlohmann::json v = ValidationMetrics{5, 0, 2.0, std::exp(2.0), 17}.to_json();
  EXPECT_EQ(v["step"], 5);
  EXPECT_EQ(v["val_loss"], 2.0);
  EXPECT_EQ(v["val_tokens"], 17);
  EXPECT_FALSE(v.contains("loss"));
}

TEST(Progress, Formats) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(int64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(format_duration(62), "1:02");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_THROW(parse_progress_mode("fancy"), std::invalid_argument);
  EXPECT_EQ(parse_progress_mode("plain"), ProgressMode::Plain);
  EXPECT_STREQ(progress_mode_name(ProgressMode::Bar), "bar");
}

}  // namespace
}  // namespace qlora::report
