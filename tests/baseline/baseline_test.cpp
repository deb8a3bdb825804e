#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kiln/error.h"
#include "kiln/rungs.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

TEST(Baseline, ReportsThroughputMemoryAndPassesTheGate) {
  TempDir dir;
  Config config = gpt_config(dir.path(), {"baseline.warmup_steps=2", "baseline.steps=10",
                                          "baseline.peak_flops_per_second=1e12"});
  auto session = open_session(config, {{"kiln"}});
  RungResult r = run_baseline(*session);
  EXPECT_TRUE(r.passed) << r.verdict;
  auto j = nlohmann::json::parse(slurp(dir / "t" / "baseline.json"));
  EXPECT_EQ(j["measured_steps"], 10);
  EXPECT_NEAR(j["tokens_per_second"].get<double>(), j["samples_per_second"].get<double>() * 32,
              1e-6 * j["tokens_per_second"].get<double>());
  EXPECT_LE(j["step_seconds"]["p10"].get<double>(), j["step_seconds"]["median"].get<double>());
  EXPECT_LE(j["step_seconds"]["median"].get<double>(), j["step_seconds"]["p90"].get<double>());
  EXPECT_GE(j["data_wait_share"].get<double>(), 0);
  EXPECT_LT(j["data_wait_share"].get<double>(), 1);
  EXPECT_GT(j["peak_memory"]["allocated_bytes"].get<double>(), 0);
  // FLOPs per token, worked by hand for this shape (L = 2, C = 64, V = 256, block 256, T = 32):
  // N = wte 256*64 (the tied head) + 2 blocks * (12 C^2 + 13 C) + ln_f 2C = 16384 + 99968 + 128
  // = 116480 (the position embedding is a lookup, not counted); 6N = 698880; attention
  // 12 L C T = 12*2*64*32 = 49152; total 748032.
  EXPECT_DOUBLE_EQ(j["flops_per_token"].get<double>(), 748032.0);
  // tokens/s is the measured steps' tokens over their summed step time (metrics.jsonl's own).
  double measured_seconds = 0;
  int measured = 0;
  std::ifstream metrics(dir / "t" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("measured", false)) {
      measured_seconds += record["step_seconds"].get<double>();
      ++measured;
    }
  }
  ASSERT_EQ(measured, 10);
  const double tokens_per_second = 10 * 8 * 32 / measured_seconds;
  EXPECT_NEAR(j["tokens_per_second"].get<double>(), tokens_per_second, 1e-9 * tokens_per_second);
  // MFU against the configured peak: FLOPs per token x tokens/s / 1e12.
  EXPECT_NEAR(j["mfu"].get<double>(), 748032.0 * tokens_per_second / 1e12,
              1e-9 * j["mfu"].get<double>());
  EXPECT_EQ(j["losses"].size(), 12u);
  EXPECT_LT(j["val_loss_final"].get<double>(), j["val_loss_initial"].get<double>());
}

TEST(Baseline, GateTripsWhenTheLossCannotFall) {
  TempDir dir;
  Config config =
      gpt_config(dir.path(), {"optim.lr=0", "baseline.warmup_steps=1", "baseline.steps=6"});
  auto session = open_session(config, {{"kiln"}});
  RungResult r = run_baseline(*session);
  EXPECT_FALSE(r.passed);
  EXPECT_THAT(r.verdict, HasSubstr("did not fall"));
}

TEST(Baseline, SkippedNonFiniteStepsFailTheGate) {
  TempDir dir;
  // SGD at an absurd learning rate: the weights blow up after the first step, every later loss is
  // non-finite and, under the skip policy, skipped rather than aborting the run.
  Config config =
      mlp_config(dir.path(), {"optim.name=sgd", "optim.lr=1e30", "train.clip_grad_norm=0",
                              "train.nonfinite=skip", "train.max_skipped_steps=1000",
                              "baseline.warmup_steps=1", "baseline.steps=8"});
  auto session = open_session(config, {{"kiln"}});
  RungResult r = run_baseline(*session);
  EXPECT_FALSE(r.passed);
  EXPECT_THAT(r.verdict, HasSubstr("non-finite loss or gradient"));
  auto j = nlohmann::json::parse(slurp(dir / "t" / "baseline.json"));
  EXPECT_GT(j["skipped_steps"].get<int64_t>(), 0);
  // Every step, the untimed peak-memory step included, has the same record as `kiln train`'s.
  std::ifstream metrics(dir / "t" / "metrics.jsonl");
  std::string line;
  int64_t expected_step = 1;
  while (std::getline(metrics, line)) {
    auto record = nlohmann::json::parse(line);
    EXPECT_EQ(record["step"].get<int64_t>(), expected_step++);
    for (const char* key : {"loss", "lr", "grad_norm", "step_seconds", "data_wait_seconds",
                            "samples_per_second", "measured"}) {
      EXPECT_TRUE(record.contains(key)) << key << " in " << line;
    }
  }
  EXPECT_EQ(expected_step, 1 + 1 + 8 + 1);
}

TEST(Ladder, ARungThatThrowsStillLeavesAReport) {
  TempDir dir;
  write_text(dir / "not-a-directory", "x");
  Config config = gpt_config(dir.path(), {"baseline.warmup_steps=1", "baseline.steps=8",
                                          "profile.dir=" + (dir / "not-a-directory").string()});
  EXPECT_THROW(run_ladder(config, {{"kiln"}}), UserError);
  std::string report = slurp(dir / "t" / "report.md");
  EXPECT_THAT(report, HasSubstr("| baseline | passed |"));
  EXPECT_THAT(report, HasSubstr("| profile | **failed** | error: "));
  EXPECT_THAT(report, HasSubstr("## profile\n\nerror: "));  // no empty table for a rung that threw
}

TEST(Baseline, CliExitsNonZeroOnAFailedGate) {
  TempDir dir;
  auto r = run_kiln(
      "baseline " + (source_dir() / "configs/gpt-tiny.toml").string() + " --set optim.lr=0 " +
      "--set baseline.steps=4 --set baseline.warmup_steps=0 --set run.dir=" + dir.path().string());
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_THAT(r.err, HasSubstr("baseline gate failed"));
  EXPECT_THAT(r.out, HasSubstr("baseline — FAILED"));
}

// The whole ladder (every enabled rung in order, report.md against each <rung>.json): the CTest
// fixture report.ladder (tests/report/browser_test.py), one demo-ladder run that the report tests
// read too.

}  // namespace
}  // namespace kiln::testing
