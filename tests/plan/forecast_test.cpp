// The forecast of one run, forecast against actual, the measured matmul peak in the plan, and
// host memory and storage: known answers worked by hand (docs/plan.md).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/plan.h"
#include "kiln/report.h"
#include "kiln/results.h"
#include "kiln/training_run.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

// gpt: L = 2, C = 32, V = 300, T = 16, micro-batch 4:
//   N (without the position embedding) = V C + L (12 C^2 + 13 C) + 2 C
//     = 9,600 + 2 x (12,288 + 416) + 64 = 35,072
//   FLOPs per token = 6 N + 12 L C T = 210,432 + 12,288 = 222,720
//   tokens per step (per device) = 4 x 16 = 64; FLOPs per step = 14,254,080
//   state: parameters 35,072 + position embedding 512 = 35,584 x 4 B = 142,336 B; AdamW twice
//   that: 284,672 B; checkpoint (parameters + optimizer) = 427,008 B.
Config forecast_config(const std::vector<std::string>& extra = {}) {
  Config config = Config::defaults();
  for (const auto& o :
       {"model.name=gpt", "data.name=text", "model.preset=tiny", "model.n_layer=2",
        "model.n_embd=32", "model.n_head=2", "model.vocab_size=300", "model.block_size=16",
        "data.seq_len=16", "train.batch_size=4", "train.steps=200"})
    config.set_from_string(o);
  for (const auto& o : extra) config.set_from_string(o);
  config.validate();
  return config;
}

TEST(Forecast, UncalibratedStepTimeIsFlopsOverPeakTimesMfu) {
  // peak 1e12 (baseline.peak_flops_per_second) x plan.mfu 0.5 = 5e11 FLOP/s:
  // step = 14,254,080 / 5e11 = 28.50816 us; tokens/s = 64 / step = 2,244,971.26;
  // 200 steps = 5.701632 ms.
  const Config config = forecast_config({"baseline.peak_flops_per_second=1e12", "plan.mfu=0.5"});
  const Forecast f = forecast_run(config, nullptr, "cpu", 1);
  EXPECT_DOUBLE_EQ(f.flops_per_step, 14'254'080.0);
  EXPECT_DOUBLE_EQ(f.tokens_per_step, 64.0);
  EXPECT_NEAR(f.step_seconds, 2.850816e-5, 1e-15);
  EXPECT_NEAR(f.tokens_per_second, 2'244'971.264, 1e-2);
  EXPECT_NEAR(f.train_seconds, 5.701632e-3, 1e-12);
  EXPECT_EQ(f.calibration, "uncalibrated");
  EXPECT_EQ(f.mfu_source, "plan.mfu (assumed)");
  EXPECT_DOUBLE_EQ(f.checkpoint_bytes, 427'008.0);
  EXPECT_DOUBLE_EQ(f.save_seconds, 427'008.0 / 2e9);  // plan.checkpoint_write_gb_per_second = 2
  // The memory forecast, uncalibrated: the held state (427,008 B) and the gradients (142,336 B)
  // live at the peak, and the activations of 4 x 16 tokens through 2 blocks of width 32 add
  // under 1 MB (docs/plan.md; the memory table test measures the model itself).
  EXPECT_GT(f.peak_memory_bytes, 427'008.0 + 142'336.0);
  EXPECT_LT(f.peak_memory_bytes, 427'008.0 + 142'336.0 + 1e6);
  // A catalog row: H100's fp32 67 TFLOP/s x plan.mfu 0.4 = 2.68e13: step = 531.87 ns.
  const Forecast h100 = forecast_run(forecast_config(), nullptr, "NVIDIA H100 80GB HBM3", 1);
  EXPECT_NEAR(h100.step_seconds, 5.318686567e-7, 1e-15);
  EXPECT_THAT(h100.peak_source, HasSubstr("h100-sxm"));
  // No peak known (a CPU, no override): no time forecast, memory still.
  const Forecast none = forecast_run(forecast_config(), nullptr, "cpu", 1);
  EXPECT_EQ(none.step_seconds, 0.0);
  EXPECT_THAT(forecast_text(none), HasSubstr("no step time"));
  EXPECT_GT(none.peak_memory_bytes, 427'008.0);
}

TEST(Forecast, APilotOnTheSameDeviceCalibratesEveryInput) {
  // The pilot's step took 10 ms on "cpu" and its matmul ran 2e9 FLOP/s: achieved =
  // 14,254,080 / 0.01 = 1.425408e9 FLOP/s, MFU = 1.425408e9 / 2e9 = 0.712704, so the forecast
  // step is the pilot's 10 ms and tokens/s 64 / 0.01 = 6,400. Save: 427,008 B at 1e8 B/s =
  // 4.27008 ms. Memory: held state + the working memory x 1.5.
  const Config config = forecast_config();
  PilotCalibration pilot;
  pilot.run_dir = "runs/p";
  pilot.device = "cpu";
  pilot.step_seconds = 0.01;
  pilot.matmul_peak_flops_per_second = 2e9;
  pilot.activation_ratio = 1.5;
  pilot.write_bytes_per_second = 1e8;
  const Forecast f = forecast_run(config, &pilot, "cpu", 1);
  EXPECT_DOUBLE_EQ(f.peak_flops_per_second, 2e9);
  EXPECT_NEAR(f.mfu, 0.712704, 1e-12);
  EXPECT_NEAR(f.step_seconds, 0.01, 1e-15);
  EXPECT_NEAR(f.tokens_per_second, 6400.0, 1e-9);
  EXPECT_NEAR(f.save_seconds, 4.27008e-3, 1e-15);
  EXPECT_EQ(f.calibration, "pilot runs/p");
  // The calibration scales what the step adds over the held state and only that: against the
  // uncalibrated forecast of the same job, (peak - 427,008) x 1.5.
  const Forecast uncalibrated = forecast_run(config, nullptr, "cpu", 1);
  EXPECT_GT(uncalibrated.peak_memory_bytes, 427'008.0);
  EXPECT_DOUBLE_EQ(f.peak_memory_bytes,
                   427'008.0 + 1.5 * (uncalibrated.peak_memory_bytes - 427'008.0));
  // Negative control: the same pilot does not calibrate another device.
  const Forecast other = forecast_run(config, &pilot, "NVIDIA H100 80GB HBM3", 1);
  EXPECT_DOUBLE_EQ(other.mfu, 0.4);
  EXPECT_DOUBLE_EQ(other.peak_flops_per_second, 67e12);
  EXPECT_DOUBLE_EQ(other.memory_calibration, 1.0);
}

TEST(Forecast, ComparisonNamesTheMostWrongInput) {
  Forecast f;
  f.step_seconds = 0.010;
  f.tokens_per_second = 6400;
  f.peak_memory_bytes = 1000;
  f.save_seconds = 2.0;
  ActualRun a;
  a.run_dir = "runs/a";
  a.device = "cpu";
  a.step_seconds = 0.0125;     // forecast / actual = 0.8
  a.tokens_per_second = 5120;  // 1.25
  a.steps = 100;
  a.train_seconds = 1.25;      // 100 x 0.010 / 1.25 = 0.8
  a.peak_memory_bytes = 1100;  // 0.909
  a.save_seconds = 1.0;        // 2.0: |ln 2| = 0.69 > |ln 0.8| = 0.22 > |ln 0.909| = 0.095
  nlohmann::json c = compare_forecast(f, a);
  ASSERT_EQ(c["rows"].size(), 9u);  // the last: time lost to checkpoints
  EXPECT_NEAR(c["rows"][0]["ratio"].get<double>(), 0.8, 1e-12);
  EXPECT_NEAR(c["rows"][1]["ratio"].get<double>(), 1.25, 1e-12);
  EXPECT_NEAR(c["rows"][2]["ratio"].get<double>(), 0.8, 1e-12);
  EXPECT_NEAR(c["rows"][3]["ratio"].get<double>(), 1000.0 / 1100.0, 1e-12);
  EXPECT_NEAR(c["rows"][4]["ratio"].get<double>(), 2.0, 1e-12);
  EXPECT_THAT(c["most_wrong"]["input"].get<std::string>(), HasSubstr("checkpoint write speed"));
  EXPECT_THAT(comparison_markdown(c), HasSubstr("| checkpoint save | "));
  // Without a recorded save, the step time's input (peak x MFU) is the most wrong.
  a.save_seconds = 0;
  c = compare_forecast(f, a);
  EXPECT_TRUE(c["rows"][4]["ratio"].is_null());
  EXPECT_THAT(c["most_wrong"]["input"].get<std::string>(), HasSubstr("achieved FLOP/s"));
  // |ln 1.25| = |ln 0.8|: either of the three rows it sets.
  EXPECT_NEAR(std::abs(std::log(c["most_wrong"]["ratio"].get<double>())), std::log(1.25), 1e-12);
}

TEST(Forecast, TheRunsWallTimeEttrAndCost) {
  // Step 28.50816 us (peak 1e12 x MFU 0.5, as above); 200 steps = 5.701632 ms.
  // Evaluations: train.eval_every 100 -> at step 100 and at the end: 2, each 8 batches x 4 x 16
  //   = 512 tokens x 222,720 / 3 FLOPs (forward only) / 5e11 = 76.02176 us.
  // Saves: checkpoint.every_steps 50 -> 200 / 50 = 4 (the last at step 200: no extra final one),
  //   each 427,008 B / 2e9 B/s = 213.504 us.
  // wall = 5.701632 ms + 4 x 213.504 us + 2 x 76.02176 us = 6.70769152 ms; ETTR = 5.701632 /
  //   6.70769152 = 0.85001404477; cost at 2.5/GPU-hour on 2 GPUs = 6.70769152e-3 / 3600 x 2 x 2.5
  //   = 9.3162382222e-6.
  Config config = forecast_config(
      {"baseline.peak_flops_per_second=1e12", "plan.mfu=0.5", "checkpoint.every_steps=50"});
  config.set_from_string("plan.price_7d_per_gpu_hour={ h100-sxm = 2.5 }");
  config.validate();
  const Forecast f = forecast_run(config, nullptr, "NVIDIA H100 80GB HBM3", 2, "ddp");
  EXPECT_DOUBLE_EQ(f.evals, 2.0);
  EXPECT_NEAR(f.eval_seconds, 7.602176e-5, 1e-16);
  EXPECT_DOUBLE_EQ(f.saves, 4.0);
  EXPECT_NEAR(f.wall_seconds, 6.70769152e-3, 1e-15);
  EXPECT_NEAR(f.ettr, 0.8500140447722915, 1e-12);
  EXPECT_DOUBLE_EQ(f.price_per_gpu_hour, 2.5);
  EXPECT_NEAR(f.cost, 9.316238222222222e-06, 1e-17);
  // 210 steps: saves at 50..200 and a final one at 210 (save_final); evaluations at 100, 200
  // and the end. Without save_final, 4 saves.
  Config longer = forecast_config({"baseline.peak_flops_per_second=1e12", "plan.mfu=0.5",
                                   "checkpoint.every_steps=50", "train.steps=210"});
  EXPECT_DOUBLE_EQ(forecast_run(longer, nullptr, "cpu", 1).saves, 5.0);
  EXPECT_DOUBLE_EQ(forecast_run(longer, nullptr, "cpu", 1).evals, 3.0);
  longer.set_from_string("checkpoint.save_final=false");
  EXPECT_DOUBLE_EQ(forecast_run(longer, nullptr, "cpu", 1).saves, 4.0);
  // No catalog row (cpu): no price, no cost.
  EXPECT_EQ(forecast_run(config, nullptr, "cpu", 1).cost, 0.0);
}

TEST(Forecast, ComparisonHasWallEttrAndCostRowsWithTheirErrors) {
  // Forecast: wall 100 s, ETTR 0.9, 2.5/GPU-hour, cost 100 / 3600 x 2 x 2.5 = 0.138889.
  // Actual: wall 125 s, ETTR 0.72 on 2 GPUs: cost 125 / 3600 x 2 x 2.5 = 0.173611.
  // Ratios: wall 0.8 (error -20%), ETTR 1.25 (+25%), cost 0.8 (-20%).
  Forecast f;
  f.step_seconds = 0.01;
  f.wall_seconds = 100;
  f.ettr = 0.9;
  f.price_per_gpu_hour = 2.5;
  f.world_size = 2;
  f.cost = 100.0 / 3600 * 2 * 2.5;
  ActualRun a;
  a.run_dir = "runs/a";
  a.device = "NVIDIA H100 80GB HBM3";
  a.world_size = 2;
  a.step_seconds = 0.01;
  a.wall_seconds = 125;
  a.ettr = 0.72;
  const nlohmann::json c = compare_forecast(f, a);
  ASSERT_EQ(c["rows"].size(), 9u);  // the last: time lost to checkpoints
  const auto& wall = c["rows"][5];
  const auto& ettr = c["rows"][6];
  const auto& cost = c["rows"][7];
  EXPECT_EQ(wall["quantity"], "wall time");
  EXPECT_NEAR(wall["ratio"].get<double>(), 0.8, 1e-12);
  EXPECT_NEAR(wall["error"].get<double>(), -0.2, 1e-12);
  EXPECT_EQ(ettr["quantity"], "ETTR");
  EXPECT_NEAR(ettr["ratio"].get<double>(), 1.25, 1e-12);
  EXPECT_NEAR(ettr["error"].get<double>(), 0.25, 1e-12);
  EXPECT_EQ(cost["quantity"], "cost");
  EXPECT_NEAR(cost["forecast"].get<double>(), 0.1388888888888889, 1e-12);
  EXPECT_NEAR(cost["actual"].get<double>(), 0.1736111111111111, 1e-12);
  EXPECT_NEAR(cost["error"].get<double>(), -0.2, 1e-12);
  EXPECT_NEAR(c["rows"][0]["error"].get<double>(), 0.0, 1e-12);  // the step time: exact
  const std::string markdown = comparison_markdown(c);
  EXPECT_THAT(markdown, HasSubstr("| ETTR | 90.0% | 72.0% | 1.250 | +25.0% |"));
  EXPECT_THAT(markdown, HasSubstr("| cost | 0.14 | 0.17 | 0.800 | -20.0% |"));
  // No price: the cost row has no figures.
  f.price_per_gpu_hour = 0;
  f.cost = 0;
  EXPECT_TRUE(compare_forecast(f, a)["rows"][7]["ratio"].is_null());
}

// kiln train tracks itself against the forecast: every train.metrics_every steps a "plan" record
// whose tokens/s is the per-device rate of the steps since the last one (from the step records
// of the same file) and whose fraction is that over the forecast's; ETTR and the ETA from its
// own figures; the final record at the end; the --actual reader takes the final one.
TEST(PlanTracking, KilnTrainLogsTokensPerSecondAgainstThePlanInItsRecords) {
  TempDir dir;
  const Config config = gpt_config(
      dir.path(), {"train.steps=6", "train.metrics_every=1", "checkpoint.every_steps=3",
                   "baseline.peak_flops_per_second=1e9", "plan.mfu=0.5", "data.num_workers=0"});
  const Forecast forecast = forecast_run(config, nullptr, "cpu", 1);
  ASSERT_GT(forecast.tokens_per_second, 0.0);
  const TrainingRunResult result = run_training(config, TrainingRunOptions{});
  std::ifstream in(result.run_dir / "metrics.jsonl");
  std::vector<nlohmann::json> steps, plans;
  for (std::string line; std::getline(in, line);) {
    const auto r = nlohmann::json::parse(line);
    if (r.contains("loss") && r.contains("step_seconds")) steps.push_back(r);
    if (r.contains("plan")) plans.push_back(r);
  }
  int64_t previous = 0;
  for (const auto& r : plans) {
    const auto& p = r["plan"];
    if (p["final"].get<bool>()) continue;
    const int64_t at = r["step"].get<int64_t>();
    SCOPED_TRACE("plan record at step " + std::to_string(at));
    double tokens = 0, seconds = 0;  // the steps since the last plan record, from step records
    for (const auto& s : steps) {
      const int64_t n = s["step"].get<int64_t>();
      if (n <= previous || n > at) continue;
      tokens += s["tokens_per_second"].get<double>() * s["step_seconds"].get<double>();
      seconds += s["step_seconds"].get<double>();
    }
    previous = at;
    ASSERT_GT(seconds, 0.0);
    const double actual = tokens / seconds;  // one device
    EXPECT_NEAR(p["tokens_per_second"].get<double>(), actual, 1e-9 * actual);
    EXPECT_DOUBLE_EQ(p["tokens_per_second_forecast"].get<double>(), forecast.tokens_per_second);
    EXPECT_NEAR(p["tokens_per_second_vs_plan"].get<double>(), actual / forecast.tokens_per_second,
                1e-9 * actual / forecast.tokens_per_second);
    const double elapsed = p["elapsed_seconds"].get<double>();
    EXPECT_NEAR(p["ettr"].get<double>(), p["productive_seconds"].get<double>() / elapsed, 1e-12);
    EXPECT_LE(p["ettr"].get<double>(), 1.0);
    const double step = static_cast<double>(at);
    EXPECT_NEAR(p["eta_seconds"].get<double>(), elapsed / step * (6 - step), 1e-9);
  }
  const size_t steps_seen = steps.size();
  EXPECT_EQ(steps_seen, 6u);
  ASSERT_EQ(plans.size(), 7u);  // every step (metrics_every = 1) and the final one
  const auto& last = plans.back()["plan"];
  EXPECT_TRUE(last["final"].get<bool>());
  EXPECT_EQ(plans.back()["step"], 6);
  EXPECT_EQ(last["eta_seconds"].get<double>(), 0.0);
  // Two saves (steps 3 and 6) were timed in the checkpoint phase: the final record counts more
  // checkpoint time than the record at step 1 (which saw only the polls between steps), and no
  // more than the time outside the steps.
  EXPECT_GT(last["checkpoint_seconds"].get<double>(),
            plans[0]["plan"]["checkpoint_seconds"].get<double>());
  EXPECT_LE(last["checkpoint_seconds"].get<double>(),
            last["elapsed_seconds"].get<double>() - last["productive_seconds"].get<double>());
  EXPECT_DOUBLE_EQ(last["ettr_forecast"].get<double>(), forecast.ettr);
  // Without a step-time forecast (a CPU, no pilot, no peak): no plan records.
  TempDir other;
  const TrainingRunResult plain = run_training(
      gpt_config(other.path(), {"train.steps=2", "data.num_workers=0"}), TrainingRunOptions{});
  std::ifstream plain_in(plain.run_dir / "metrics.jsonl");
  int plain_plans = 0;
  for (std::string line; std::getline(plain_in, line);) {
    const auto r = nlohmann::json::parse(line);
    if (r.contains("plan")) ++plain_plans;
  }
  EXPECT_EQ(plain_plans, 0);
}

// The report of a kiln train run with plan records (report.html, "Against the plan"): every
// metrics line reads through MetricsRecord, and a plan record writes back to the same JSON (one
// list of keys, the tracker's and the reader's); the plan records' throughput and ETTR are charted
// by step beside the forecast, the final ETTR and wall time against the forecast with their errors;
// the loss and throughput curves hold the step records only.
TEST(PlanTracking, TheReportShowsTheRunAgainstTheForecast) {
  TempDir dir;
  const Config config = gpt_config(
      dir.path(), {"train.steps=6", "train.metrics_every=2", "checkpoint.every_steps=3",
                   "baseline.peak_flops_per_second=1e9", "plan.mfu=0.5", "data.num_workers=0"});
  const TrainingRunResult result = run_training(config, TrainingRunOptions{});
  std::ifstream in(result.run_dir / "metrics.jsonl");
  std::vector<MetricsRecord> steps, plans;
  for (std::string line; std::getline(in, line);) {
    const auto raw = nlohmann::json::parse(line);
    const auto record = raw.get<MetricsRecord>();
    if (record.plan) {
      EXPECT_EQ(nlohmann::json(record), raw) << line;  // nothing lost, nothing renamed
      EXPECT_FALSE(record.loss.has_value()) << line;
      EXPECT_DOUBLE_EQ(record.plan->ettr, raw["plan"]["ettr"].get<double>());
      plans.push_back(record);
    } else if (record.loss && record.step_seconds) {
      steps.push_back(record);
    }
  }
  ASSERT_EQ(steps.size(), 3u);  // steps 2, 4, 6 (train.metrics_every = 2)
  ASSERT_EQ(plans.size(), 4u);  // the same steps and the final one
  const PlanProgress& end = *plans.back().plan;
  ASSERT_TRUE(end.final);
  ASSERT_TRUE(end.ettr_forecast && end.wall_seconds_forecast);
  // The final record follows the last step's record: no steps since, no rate of its own.
  EXPECT_FALSE(end.tokens_per_second.has_value());
  const std::vector<MetricsRecord> rated(plans.begin(), plans.end() - 1);
  for (const auto& r : rated) ASSERT_TRUE(r.plan->tokens_per_second_forecast.has_value());

  testing::write_text(dir / "chart.js", "window.Chart = function() {};");  // a stand-in
  const ReportHtml page = make_report_html(result.run_dir, dir / "chart.js");
  const std::string& html = page.html;
  const auto at = [&](const std::string& id) {
    return std::find(page.charts.begin(), page.charts.end(), id) - page.charts.begin();
  };
  ASSERT_LT(at("chart-plan-tracking-throughput"), static_cast<long>(page.charts.size()));
  EXPECT_EQ(at("chart-plan-tracking-ettr"), at("chart-plan-tracking-throughput") + 1);
  EXPECT_GT(at("chart-plan-tracking-throughput"), at("chart-training-throughput"));
  const auto pct = [](double f) { return fmt::format("{:.1f}%", 100 * f); };
  auto points = [](const std::vector<MetricsRecord>& records, auto value) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : records) {
      out.push_back({{"x", static_cast<double>(r.step)}, {"y", value(r)}});
    }
    return "\"data\":" + out.dump() + ",";
  };
  // The curves by step: the plan records' own figures, the forecast flat beside them.
  EXPECT_NE(
      html.find(points(rated, [](const MetricsRecord& r) { return *r.plan->tokens_per_second; }) +
                "\"label\":\"tokens/s per device (since the last record)\""),
      std::string::npos);
  EXPECT_NE(html.find(points(
                rated, [](const MetricsRecord& r) { return *r.plan->tokens_per_second_forecast; })),
            std::string::npos);
  EXPECT_NE(html.find(points(plans, [](const MetricsRecord& r) { return r.plan->ettr; }) +
                      "\"label\":\"ETTR so far\""),
            std::string::npos);
  // The training curves: the six step records, no plan record.
  EXPECT_NE(html.find(points(steps, [](const MetricsRecord& r) { return *r.loss; }) +
                      "\"label\":\"train loss\""),
            std::string::npos);
  EXPECT_NE(html.find("8 records: 3 training steps, 1 evaluations, 4 against the plan"),
            std::string::npos);
  // The throughput per device against the forecast: the median of the records' fractions.
  std::vector<double> fractions;
  for (const auto& r : rated) fractions.push_back(*r.plan->tokens_per_second_vs_plan);
  std::sort(fractions.begin(), fractions.end());
  EXPECT_NE(html.find("<th>tokens/s per device</th><td>" + pct(fractions[1]) + " of the forecast"),
            std::string::npos);
  // The final figures against the forecast, errors as kiln plan --actual: (forecast - actual) /
  // actual.
  const auto error = [](double forecast, double actual) {
    return fmt::format("error {:+.1f}%", 100 * (forecast - actual) / actual);
  };
  EXPECT_NE(
      html.find("<th>ETTR</th><td>" + pct(end.ettr) + " (forecast " + pct(*end.ettr_forecast) +
                ", " + error(*end.ettr_forecast, end.ettr) + ")</td>"),
      std::string::npos);
  EXPECT_NE(html.find("<th>wall time</th><td>" + format_duration(end.elapsed_seconds) +
                      " (forecast " + format_duration(*end.wall_seconds_forecast) + ", " +
                      error(*end.wall_seconds_forecast, end.elapsed_seconds) + ")</td>"),
            std::string::npos);
  EXPECT_NE(html.find("<th>checkpoint time</th><td>" + format_duration(end.checkpoint_seconds)),
            std::string::npos);
  // A run without plan records has no such section.
  std::filesystem::remove(result.run_dir / "metrics.jsonl");
  nlohmann::json step_only(steps[0]);
  testing::write_text(result.run_dir / "metrics.jsonl", step_only.dump() + "\n");
  const ReportHtml plain = make_report_html(result.run_dir, dir / "chart.js");
  EXPECT_EQ(std::count(plain.charts.begin(), plain.charts.end(), "chart-plan-tracking-ettr"), 0);
  EXPECT_EQ(plain.html.find("Against the plan"), std::string::npos);
}

TEST(Forecast, ThePlanUsesThePilotsMeasuredMatmulPeakAndWarnsOnTheCatalog) {
  // H100 fp32 catalog 67 TFLOP/s; the pilot measured 20 TFLOP/s: 67 / 20 = 3.35 > 1.25, warned.
  // MFU = achieved / measured = 1.425408e9 / 20e12 = 7.12704e-5.
  const Config config = forecast_config({"plan.hardware=h100-sxm"});
  PilotCalibration pilot;
  pilot.run_dir = "runs/p";
  pilot.device = "NVIDIA H100 80GB HBM3";
  pilot.step_seconds = 0.01;
  pilot.matmul_peak_flops_per_second = 20e12;
  PlanResult plan = make_plan(config, &pilot, false);
  ASSERT_EQ(plan.rows.size(), 1u);
  const PlanRow& row = plan.rows[0];
  EXPECT_DOUBLE_EQ(row.peak_flops_per_gpu, 20e12);
  EXPECT_DOUBLE_EQ(row.catalog_peak_flops_per_gpu, 67e12);
  EXPECT_NEAR(row.mfu, 7.12704e-5, 1e-15);
  ASSERT_EQ(plan.warnings.size(), 1u);
  EXPECT_THAT(plan.warnings[0], HasSubstr("3.35x"));
  EXPECT_THAT(plan_markdown(plan), HasSubstr("Warnings:"));
  // Negative control: 60 TFLOP/s measured (67 / 60 = 1.12): no warning.
  pilot.matmul_peak_flops_per_second = 60e12;
  plan = make_plan(config, &pilot, false);
  EXPECT_TRUE(plan.warnings.empty());
  ASSERT_EQ(plan.rows.size(), 1u);
  EXPECT_DOUBLE_EQ(plan.rows[0].peak_flops_per_gpu, 60e12);
}

TEST(Forecast, HostMemoryStagingAndStorage) {
  // A node of 8 GPUs with 100 GB of host memory, 90 GB usable (plan.headroom 0.1).
  // Loader: 8 ranks x data.prefetch 4 x (4 x 16 tokens x 2 (input, target) x 8 B = 1,024 B)
  // = 32,768 B. DDP, async: rank 0 stages the whole checkpoint.
  Device d;
  d.name = "test-row";
  d.gpus_per_node = 8;
  d.host_memory_bytes = 100e9;
  StrategyDecision ddp;
  ddp.strategy = "ddp";
  const Config config = forecast_config();
  HostNeeds h = host_needs(config, d, 8, ddp, 50e9, 3600);
  EXPECT_DOUBLE_EQ(h.loader_bytes_per_node, 32'768.0);
  EXPECT_DOUBLE_EQ(h.staging_bytes_per_node, 50e9);
  EXPECT_TRUE(h.host_fits);
  // 95 GB staged + 32,768 B > 90 GB: warned, naming checkpoint.async.
  h = host_needs(config, d, 8, ddp, 95e9, 3600);
  EXPECT_FALSE(h.host_fits);
  ASSERT_EQ(h.warnings.size(), 1u);
  EXPECT_THAT(h.warnings[0], HasSubstr("checkpoint.async"));
  // FSDP over 16 GPUs: one replica's shards, 8 of 16 on a node: 95 GB x 8 / 16 = 47.5 GB.
  StrategyDecision fsdp;
  fsdp.strategy = "fsdp";
  fsdp.fsdp_degree = 16;
  h = host_needs(config, d, 16, fsdp, 95e9, 3600);
  EXPECT_DOUBLE_EQ(h.staging_bytes_per_node, 47.5e9);
  EXPECT_TRUE(h.host_fits);
  // Synchronous saves stage nothing.
  h = host_needs(forecast_config({"checkpoint.async=false"}), d, 8, ddp, 95e9, 3600);
  EXPECT_DOUBLE_EQ(h.staging_bytes_per_node, 0.0);
  EXPECT_TRUE(h.host_fits);

  // Storage 0.2 TB: keep_last_k 3 x 50 GB = 150 GB fits (a save every hour: 168 in 7 days, 3
  // kept); keep_last_k 5: 250 GB does not. A save every 3 days: 3 in 7 days, so 3 of 5 kept.
  h = host_needs(forecast_config({"plan.storage_tb=0.2"}), d, 8, ddp, 50e9, 3600);
  EXPECT_DOUBLE_EQ(h.storage_bytes, 150e9);
  EXPECT_TRUE(h.storage_fits);
  const Config keep5 = forecast_config({"plan.storage_tb=0.2", "checkpoint.keep_last_k=5"});
  h = host_needs(keep5, d, 8, ddp, 50e9, 3600);
  EXPECT_DOUBLE_EQ(h.storage_bytes, 250e9);
  EXPECT_FALSE(h.storage_fits);
  ASSERT_EQ(h.warnings.size(), 1u);
  EXPECT_THAT(h.warnings[0], HasSubstr("plan.storage_tb"));
  h = host_needs(keep5, d, 8, ddp, 50e9, 3 * 86400.0);
  EXPECT_DOUBLE_EQ(h.storage_bytes, 150e9);
  // Not set: never checked.
  h = host_needs(forecast_config({"checkpoint.keep_last_k=5"}), d, 8, ddp, 50e12, 3600);
  EXPECT_TRUE(h.storage_fits);
  // A negative storage is refused by the schema, naming the key.
  try {
    forecast_config({"plan.storage_tb=-1"});
    ADD_FAILURE() << "a negative plan.storage_tb was accepted";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("plan.storage_tb"));
  }
}

TEST(Forecast, MatmulPeakTimesTheJobsShapeInItsPrecision) {
  const Config config = forecast_config();
  JobShape job = job_shape(config);
  const MatmulShape s = job_matmul_shape(model_shape(config), job);
  EXPECT_EQ(s.m, 64);   // micro-batch 4 x seq 16
  EXPECT_EQ(s.k, 32);   // n_embd
  EXPECT_EQ(s.n, 128);  // 4 n_embd
  const MatmulPeak p = measure_matmul_peak(s, "fp32", "cpu", 0.02);
  EXPECT_EQ(p.dtype, "float32");
  EXPECT_GE(p.repeats, 5);
  ASSERT_GT(p.median_seconds, 0.0);
  EXPECT_NEAR(p.flops_per_second, 2.0 * 64 * 32 * 128 / p.median_seconds,
              1e-9 * p.flops_per_second);
  EXPECT_EQ(measure_matmul_peak({8, 8, 8}, "bf16-mixed", "cpu", 0.0).dtype, "bfloat16");
  EXPECT_EQ(to_json(p)["m"], 64);
  EXPECT_THROW(measure_matmul_peak(s, "fp32", "nonsense", 0.0), std::exception);
  // The mlp: [micro-batch, input_dim] x [input_dim, hidden_dim].
  const Config mlp = [] {
    Config c = Config::defaults();
    c.set_from_string("model.name=mlp");
    c.set_from_string("model.input_dim=7");
    c.set_from_string("model.hidden_dim=33");
    c.set_from_string("train.batch_size=5");
    c.validate();
    return c;
  }();
  const MatmulShape ms = job_matmul_shape(model_shape(mlp), job_shape(mlp));
  EXPECT_EQ(ms.m, 5);
  EXPECT_EQ(ms.k, 7);
  EXPECT_EQ(ms.n, 33);
}

// A model of your own whose ModelMath gives no widths (n_embd 0): the timed GEMM is square,
// [micro-batch x seq, w] x [w, w] with w = sqrt(its largest unit's parameters), the unit's
// forward FLOPs on the micro-batch (not the 1 x 1 GEMM the widths would give); the whole model's
// parameters without a unit; neither: refused, naming what to set.
TEST(Forecast, AModelWithoutWidthsTimesASquareGemmOfItsLargestUnit) {
  if (!find_model("test-plan-nowidth")) {
    ModelSpec spec;
    spec.name = "test-plan-nowidth";
    spec.input = ModelInput::kFeatures;
    spec.build = [](const Config&, at::Generator&) -> std::shared_ptr<Model> {
      throw UserError("test-plan-nowidth is planned, never built");
    };
    spec.math = [](const Config& config) {
      const int64_t w = config.get_int("model.hidden_dim");
      ModelMath math;
      math.parameters = 3 * w * w;
      math.largest_unit_parameters = w * w;
      math.flop_parameters = math.parameters;
      return math;
    };
    register_model(spec);
  }
  Config config = Config::defaults();
  for (const char* o :
       {"model.name=test-plan-nowidth", "model.hidden_dim=70", "train.batch_size=5"})
    config.set_from_string(o);
  config.validate();
  const ModelShape shape = model_shape(config);
  ASSERT_EQ(shape.n_embd, 0);
  const MatmulShape s = job_matmul_shape(shape, job_shape(config));
  EXPECT_EQ(s.m, 5);  // features: one row per sample
  EXPECT_EQ(s.k, 70);
  EXPECT_EQ(s.n, 70);
  const MatmulPeak p = measure_matmul_peak(s, "fp32", "cpu", 0.0);
  ASSERT_GT(p.median_seconds, 0.0);
  EXPECT_NEAR(p.flops_per_second, 2.0 * 5 * 70 * 70 / p.median_seconds, 1e-9 * p.flops_per_second);
  // No unit: the whole model's 10,000 parameters, w = 100; a token model's rows are b x seq.
  ModelShape whole;
  whole.architecture = "test-plan-nowidth";
  whole.math_parameters = 10'000;
  JobShape tokens;
  tokens.micro_batch = 4;
  tokens.seq_len = 16;
  const MatmulShape w = job_matmul_shape(whole, tokens);
  EXPECT_EQ(w.m, 64);
  EXPECT_EQ(w.k, 100);
  EXPECT_EQ(w.n, 100);
  // Nothing known: refused with the reason (the baseline records the peak as not measured).
  whole.math_parameters = 0;
  try {
    job_matmul_shape(whole, tokens);
    ADD_FAILURE() << "a model with no widths and no parameters got a GEMM";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("test-plan-nowidth"));
    EXPECT_THAT(e.what(), HasSubstr("ModelMath::n_embd"));
  }
}

}  // namespace
}  // namespace kiln::testing
