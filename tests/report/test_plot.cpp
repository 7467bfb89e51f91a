// The training-curve picture: axes, reading metrics.jsonl rows of every kind, its errors.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <stdexcept>
#include <string>

#include "qlora/report/plot.h"

namespace qlora::report {
namespace {

std::string write_temp(const std::string& name, const std::string& contents) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

void expect_covers(const PlotAxis& a, double min, double max) {
  ASSERT_GE(a.ticks.size(), 2u);
  EXPECT_DOUBLE_EQ(a.ticks.front(), a.lo);
  EXPECT_NEAR(a.ticks.back(), a.hi, 1e-12 * std::fabs(a.hi));
  EXPECT_LE(a.lo, min);
  EXPECT_GE(a.hi, max);
}

TEST(PlotAxis, LinearTicksAreRoundAndCoverTheData) {
  const PlotAxis a = nice_linear_axis(2.83, 6.21);
  expect_covers(a, 2.83, 6.21);
  EXPECT_DOUBLE_EQ(a.lo, 2);
  EXPECT_DOUBLE_EQ(a.hi, 7);
  EXPECT_EQ(tick_label(a.ticks[1], a), "3");
  const PlotAxis fine = nice_linear_axis(2.83, 3.21);
  expect_covers(fine, 2.83, 3.21);
  EXPECT_EQ(tick_label(fine.ticks[1], fine), "2.9");
  const PlotAxis lr = nice_linear_axis(0, 3e-3);
  expect_covers(lr, 0, 3e-3);
  EXPECT_EQ(tick_label(lr.ticks[1], lr), "0.001");
  EXPECT_EQ(tick_label(lr.ticks[0], lr), "0");
  const PlotAxis flat = nice_linear_axis(4, 4);  // one value: widened around it
  expect_covers(flat, 4, 4);
  EXPECT_LT(flat.lo, 4);
  EXPECT_EQ(tick_label(1250, nice_linear_axis(0, 1300)), "1250");
}

TEST(PlotAxis, LogTicksAreOneTwoFiveTimesPowersOfTen) {
  const PlotAxis a = nice_log_axis(0.031, 7.2);
  expect_covers(a, 0.031, 7.2);
  EXPECT_TRUE(a.log);
  EXPECT_DOUBLE_EQ(a.lo, 0.02);
  EXPECT_DOUBLE_EQ(a.hi, 10);
  EXPECT_EQ(tick_label(a.ticks[1], a), "0.1");  // > 2 decades: powers of ten and the ends
  const PlotAxis narrow = nice_log_axis(0.31, 7.2);
  expect_covers(narrow, 0.31, 7.2);
  EXPECT_EQ(narrow.ticks.size(), 6u);  // 0.2 0.5 1 2 5 10
  const PlotAxis wide = nice_log_axis(1e-6, 50);
  expect_covers(wide, 1e-6, 50);
  EXPECT_EQ(wide.ticks.size(), 9u);
  EXPECT_THROW(nice_log_axis(0, 1), std::invalid_argument);
}

TEST(PlotRead, EveryKindOfRow) {
  const std::string path = write_temp("plot_rows.jsonl",
                                      "{\"step\": 1, \"epoch\": 0, \"loss\": 6.2, \"lr\": 0.001, \"tokens_per_second\": 900}\n"
                                      "\n"
                                      "{\"step\": 2, \"epoch\": 0, \"loss\": null, \"lr\": 0.002, \"skipped\": true}\n"
                                      "{\"step\": 2, \"epoch\": 0, \"val_loss\": 5.5, \"val_perplexity\": 244.7}\n"
                                      "{\"step\": 3, \"epoch\": 0, \"loss\": 4.0, \"lr\": 0.003, \"tokens_per_second\": 950}\n"
                                      "{\"step\": 4, \"loss\": 3.");  // being written
  const RunCurves c = read_run_curves(path, "run");
  ASSERT_EQ(c.loss.size(), 2u);
  EXPECT_EQ(c.loss[1].step, 3);
  EXPECT_EQ(c.loss[1].value, 4.0);
  ASSERT_EQ(c.val_loss.size(), 1u);
  EXPECT_EQ(c.val_loss[0].value, 5.5);
  EXPECT_EQ(c.lr.size(), 3u);
  EXPECT_EQ(c.tokens_per_second.size(), 2u);
  ASSERT_EQ(c.skipped_steps.size(), 1u);
  EXPECT_EQ(c.skipped_steps[0], 2);
}

void expect_error(const std::string& contents, const std::string& want) {
  const std::string path = write_temp("plot_bad.jsonl", contents);
  try {
    read_run_curves(path, "run");
    FAIL() << "no error for " << contents;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

TEST(PlotRead, ErrorsNameTheFileAndLine) {
  expect_error("{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": 2\n{\"step\": 3}\n", "line 2: not valid JSON");
  expect_error("{\"step\": 1, \"loss\": 2}\n{\"loss\": 2}\n", "line 2: expected a JSON object with an integer \"step\"");
  expect_error("{\"step\": 1, \"loss\": \"nan\"}\n", "line 1: \"loss\" is \"nan\"");
  expect_error("", "no rows");
}

TEST(PlotSvg, OneElementPerSeriesAndRun) {
  RunCurves a{"a", {{1, 3}, {2, 2}}, {{2, 2.5}}, {{1, 1e-3}, {2, 2e-3}}, {{1, 10}, {2, 11}}, {}};
  RunCurves b{"b & c", {{1, 4}}, {}, {{1, 1e-3}}, {{1, 12}}, {2}};
  const std::string svg = render_curves_svg({a, b});
  EXPECT_NE(svg.find("data-run=\"a\" data-series=\"loss\" data-count=\"2\""), std::string::npos);
  EXPECT_NE(svg.find("data-run=\"a\" data-series=\"val_loss\" data-count=\"1\""), std::string::npos);
  EXPECT_NE(svg.find("data-run=\"b &amp; c\" data-series=\"skipped\" data-count=\"1\""), std::string::npos);
  EXPECT_EQ(svg.find("data-run=\"b &amp; c\" data-series=\"val_loss\""), std::string::npos);
  EXPECT_NE(svg.find("data-panel=\"tokens_per_second\""), std::string::npos);
  EXPECT_EQ(svg.find("data-panel=\"reward\""), std::string::npos);  // no GRPO metrics: no reward panels
}

// lora_grpo's metrics.jsonl: the reward and completion-length panels, training and validation.
TEST(PlotSvg, RewardAndCompletionLengthOfGrpo) {
  const std::string path = write_temp("plot_grpo.jsonl",
      R"({"step": 1, "loss": 0.1, "reward": 0.25, "completions/mean_length": 4.5})" "\n"
      R"({"step": 2, "loss": 0.2, "reward": 0.5, "completions/mean_length": 3.0})" "\n"
      R"({"step": 2, "epoch": 0, "val_reward": 0.4, "val_completions/mean_length": 3.5, "val_tokens": 7})" "\n");
  const RunCurves c = read_run_curves(path, "grpo");
  ASSERT_EQ(c.reward.size(), 2u);
  EXPECT_DOUBLE_EQ(c.reward[1].value, 0.5);
  ASSERT_EQ(c.val_reward.size(), 1u);
  EXPECT_DOUBLE_EQ(c.val_completion_length[0].value, 3.5);
  EXPECT_TRUE(c.val_loss.empty());  // a GRPO validation row has no val_loss
  const std::string svg = render_curves_svg({c});
  EXPECT_NE(svg.find("data-run=\"grpo\" data-series=\"val_reward\" data-count=\"1\""), std::string::npos);
  EXPECT_NE(svg.find("data-panel=\"completion_length\""), std::string::npos);
}

}  // namespace
}  // namespace qlora::report
