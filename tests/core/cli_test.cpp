// The CLI's user-facing errors: one line on stderr, non-zero exit, never a stack trace.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

void expect_one_line_error(const CommandResult& r, int code, const std::string& text) {
  EXPECT_EQ(r.exit_code, code) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr(text));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("terminate")));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("Exception raised from")));
}

TEST(Cli, UnknownKeyInFile) {
  TempDir dir;
  write_text(dir / "c.toml", "[optim]\nlrr = 1e-3\n");
  expect_one_line_error(run_kiln("config validate " + (dir / "c.toml").string()), 2,
                        "did you mean optim.lr?");
}

TEST(Cli, MissingConfigFile) {
  expect_one_line_error(run_kiln("train /nonexistent.toml"), 2, "/nonexistent.toml does not exist");
}

TEST(Cli, BadOverride) {
  expect_one_line_error(run_kiln("config show --set optim.lr=fast"), 2, "'fast' is not a float");
}

TEST(Cli, UnknownSubcommandOrFlag) {
  auto r = run_kiln("trian x.toml");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("kiln: error:"));
}

TEST(Cli, ConfigShowPrintsEveryKeyWithOverrides) {
  auto r = run_kiln("config show --set optim.lr=0.5");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("lr = 0.5"));
  EXPECT_THAT(r.out, HasSubstr("[baseline]"));
  EXPECT_THAT(r.out, HasSubstr("# peak learning rate"));
}

TEST(Cli, ValidateAcceptsEveryBundledConfig) {
  for (const auto& entry : std::filesystem::directory_iterator(source_dir() / "configs")) {
    // The hardware catalog is `kiln plan`'s data, not a training config (tests/plan load it).
    if (entry.path().filename() == "hardware.toml") continue;
    auto r = run_kiln("config validate " + entry.path().string());
    EXPECT_EQ(r.exit_code, 0) << entry.path() << ": " << r.err;
  }
}

TEST(Cli, NonFiniteLossStopsTheRunNamingTheStep) {
  TempDir dir;
  // SGD at an absurd learning rate diverges to inf/NaN within a few steps.
  auto r = run_kiln("train " + (source_dir() / "configs/mlp.toml").string() + " --set run.dir=" +
                    dir.path().string() + " --set optim.name=sgd --set optim.lr=1e12 --set " +
                    "train.clip_grad_norm=0 --set run.progress=off --set train.steps=200");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_THAT(r.err, HasSubstr("kiln: stopped: non-finite"));
  EXPECT_THAT(r.err, HasSubstr(" at step "));
}

TEST(Cli, ValidateRejectsWhatTrainingWouldAndTrainingWritesNothingFirst) {
  const std::string gpt = (source_dir() / "configs/gpt-tiny.toml").string();
  expect_one_line_error(run_kiln("config validate " + gpt + " --set model.n_head=3"), 2,
                        "gpt-tiny.toml: model.n_embd = 128 is not divisible by model.n_head = 3");
  TempDir dir;
  auto r = run_kiln("train " + (source_dir() / "configs/mlp.toml").string() + " --set run.dir=" +
                    dir.path().string() + " --set optim.name=sgd --set optim.nesterov=true");
  expect_one_line_error(r, 2, "optim.nesterov = true needs optim.momentum > 0");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a rejected config left a run directory";
  // Nesterov with adamw (the default optimizer) used to pass validate and fail in train.
  for (const std::string command : {"config validate", "train"}) {
    auto r = run_kiln(command + " " + (source_dir() / "configs/mlp.toml").string() +
                      " --set run.dir=" + dir.path().string() + " --set optim.nesterov=true");
    expect_one_line_error(r, 2, "optim.nesterov = true needs optim.name = \"sgd\"");
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a rejected config left a run directory";
}

TEST(Cli, NonUtf8NamesAndArgumentsAreRecordedNotFatal) {
  TempDir dir;
  // A Latin-1 run name (legal on Linux); the manifest records it with U+FFFD replacing the byte.
  auto r = run_kiln("train " + (source_dir() / "configs/mlp.toml").string() +
                    " --set run.dir=" + dir.path().string() +
                    " --set \"run.name=r$(printf '\\351')\" --set train.steps=3 " +
                    "--set run.progress=off --set train.eval_every=0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto run_dir = dir / "r\xe9";
  ASSERT_TRUE(std::filesystem::exists(run_dir / "manifest.json"));
  auto manifest = nlohmann::json::parse(slurp(run_dir / "manifest.json"));
  EXPECT_THAT(manifest["command_line"].get<std::string>(), HasSubstr("run.name=r\xef\xbf\xbd"));
}

// Determinism across processes, not only within one: global state (RNG, threads) must not leak.
TEST(Cli, TwoProcessesOfTheSameConfigLogBitwiseEqualLosses) {
  TempDir dir;
  std::vector<std::vector<double>> runs;
  for (const char* name : {"a", "b"}) {
    auto r = run_kiln("train " + (source_dir() / "configs/gpt-tiny.toml").string() +
                      " --set run.dir=" + dir.path().string() + " --set run.name=" + name +
                      " --set train.steps=6 --set train.eval_every=0 --set run.progress=off" +
                      " --set data.num_workers=" + (name[0] == 'a' ? "0" : "2"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::ifstream metrics(dir / name / "metrics.jsonl");
    std::vector<double> losses;
    for (std::string line; std::getline(metrics, line);) {
      auto record = nlohmann::json::parse(line);
      if (record.contains("loss")) losses.push_back(record["loss"].get<double>());
    }
    runs.push_back(losses);
  }
  ASSERT_EQ(runs[0].size(), 6u);
  EXPECT_EQ(runs[0], runs[1]);  // exact: bitwise-equal doubles
}

}  // namespace
}  // namespace kiln::testing
