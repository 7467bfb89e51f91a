// metrics.jsonl and the progress display.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "qlora/train/metrics.h"

namespace qlora::train {
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
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2);  // every 2nd step
  EXPECT_NE(text.find("epoch 1/2 step 2 2/4 loss 0.5000 lr 1.00e-04 100 tok/s mem 1.0 MiB eta"), std::string::npos) << text;
  EXPECT_NE(text.find("step 4 4/4"), std::string::npos);
}

TEST(Progress, Formats) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(int64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(format_duration(62), "1:02");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_THROW(parse_progress_mode("fancy"), std::invalid_argument);
  EXPECT_EQ(parse_progress_mode("plain"), ProgressMode::Plain);
  EXPECT_STREQ(progress_mode_name(ProgressMode::Bar), "bar");
  EXPECT_GT(peak_rss_bytes(), 0);
}

}  // namespace
}  // namespace qlora::train
