// The CLI's user-facing errors: one line on stderr, non-zero exit, never a stack trace.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kiln/config.h"
#include "kiln/run.h"
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
  // A boolean names its two spellings (TOML's: lower case).
  expect_one_line_error(run_kiln("config show --set run.deterministic=True"), 2,
                        "'True' is not a boolean (true or false)");
}

TEST(Cli, UnknownSubcommandOrFlag) {
  expect_one_line_error(run_kiln("trian x.toml"), 2,
                        "kiln: error: unknown subcommand 'trian': did you mean 'train'?");
  expect_one_line_error(run_kiln("xyzzy"), 2, "kiln: error: unknown subcommand 'xyzzy' (see");
  // One level down too: the group's own subcommands.
  expect_one_line_error(run_kiln("ckpt verfy runs/x"), 2,
                        "kiln: error: unknown subcommand 'verfy' of 'kiln ckpt': did you mean "
                        "'verify'?");
  expect_one_line_error(run_kiln("config shwo x.toml"), 2, "did you mean 'show'?");
  expect_one_line_error(run_kiln("train --frobnicate x.toml"), 2, "kiln: error:");
  auto help = run_kiln("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("baseline -> compile -> profile -> scale -> checkpoint"));
  EXPECT_THAT(help.out, ::testing::Not(HasSubstr("planned")));
}

TEST(Cli, ConfigShowPrintsEveryKeyWithOverridesAndTheirDefaults) {
  auto r = run_kiln("config show --set optim.lr=0.5");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("lr = 0.5"));
  EXPECT_THAT(r.out, HasSubstr("[baseline]"));
  EXPECT_THAT(r.out, HasSubstr("# peak learning rate"));
  // Beside a value that differs from its default, the default; nowhere else.
  const std::string lr_default = value_to_toml(find_key("optim.lr")->default_value);
  std::istringstream lines(r.out);
  int with_default = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("lr = 0.5", 0) == 0) {
      EXPECT_THAT(line, ::testing::EndsWith(" (default " + lr_default + ")"));
    }
    with_default += line.find(" (default ") != std::string::npos;
  }
  EXPECT_EQ(with_default, 1) << r.out;
  // KILN_SET (docs/config.md) applies after --set.
  auto env = run_shell("KILN_SET='optim.lr=0.25 train.steps=7' " + std::string(KILN_CLI) +
                       " config show --set optim.lr=0.5");
  ASSERT_EQ(env.exit_code, 0) << env.err;
  EXPECT_THAT(env.out, HasSubstr("\nlr = 0.25 "));
  EXPECT_THAT(env.out, HasSubstr("\nsteps = 7 "));
}

TEST(Cli, ValidateAcceptsEveryBundledConfig) {
  TempDir dir;
  const std::string tokens = (dir / "tokens.bin").string();
  write_text(tokens, std::string(4096, '\1'));
  for (const auto& entry : std::filesystem::directory_iterator(source_dir() / "configs")) {
    // The hardware catalog is `kiln plan`'s data, not a training config (tests/plan load it).
    if (entry.path().filename() == "hardware.toml") continue;
    // Token configs name data/train.bin, which a fresh checkout lacks (validate checks it).
    auto r = run_kiln("config validate " + entry.path().string() + " --set data.path=" + tokens +
                      " --set data.val_path=" + tokens);
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

// `kiln config validate` refuses what `kiln train` refuses of the machine and the data (a CUDA
// device on a CPU-only build, a token file that is not there), with the same line, and neither
// writes anything. Cheap checks: the file is opened, never hashed.
TEST(Cli, ValidateRefusesAMissingDeviceOrDataFileAsTrainDoes) {
  TempDir dir;
  const std::string gpt = (source_dir() / "configs/gpt-tiny.toml").string() +
                          " --set run.dir=" + (dir / "runs").string();
  std::vector<std::pair<std::string, std::string>> cases = {
      {" --set data.name=tokens --set data.path=" + (dir / "none.bin").string(),
       "token file " + (dir / "none.bin").string() +
           " cannot be opened: No such file or directory"},
      {" --set data.name=text --set data.path=" + (dir / "none.txt").string(),
       "data.path = \"" + (dir / "none.txt").string() + "\" does not exist"}};
  if (!torch::cuda::is_available()) {
    cases.push_back({" --set run.device=cuda", "run.device = \"cuda\" but no CUDA device"});
  }
  for (const auto& [sets, message] : cases) {
    for (const std::string command : {"config validate ", "train "}) {
      SCOPED_TRACE(command + sets);
      expect_one_line_error(run_kiln(command + gpt + sets), 2, "kiln: error: " + message);
      EXPECT_FALSE(std::filesystem::exists(dir / "runs"));
    }
  }
}

// "Nothing written" on every refusal of a command that would write a run: bad input of each kind
// (a --resume that names nothing, conflicting flags, a bad key, a missing data file, a compile
// backend this machine cannot run, a failed rule) leaves no run directory behind, lock included.
TEST(Cli, EveryRefusalLeavesNoRunDirectory) {
  TempDir dir;
  std::filesystem::create_directories(dir / "empty");
  const std::string mlp = (source_dir() / "configs/mlp.toml").string();
  const std::string gpt = (source_dir() / "configs/gpt-tiny.toml").string();
  const std::string at = " --set run.dir=" + (dir / "runs").string();
  const std::vector<std::pair<std::string, std::string>> refusals = {
      {"train " + mlp + at + " --resume " + (dir / "missing").string(), "no such checkpoint"},
      {"train " + mlp + at + " --resume " + (dir / "empty").string(),
       "holds no committed checkpoint"},
      {"train " + mlp + at + " --resume auto --overwrite", "give one"},
      {"train " + mlp + at + " --set optim.lrr=1", "did you mean optim.lr?"},
      {"train " + mlp + at + " --set optim.nesterov=true", "optim.nesterov = true needs"},
      {"baseline " + gpt + at + " --set data.name=tokens --set data.path=/nonexistent.bin",
       "token file /nonexistent.bin cannot be opened"},
      {"compile " + gpt + at + " --set data.name=tokens --set data.path=/nonexistent.bin",
       "token file /nonexistent.bin cannot be opened"},
      {"profile " + gpt + at + " --set data.name=text --set data.path=/nonexistent.txt",
       "does not exist"},
      {"compile " + mlp + at + " --set compile.backend=cudagraphs", "compile.backend"},
      {"train " + gpt + at + " --set data.name=tokens --set data.path=" +
           (dir / "prepared").string() + " --set model.vocab_size=1000",
       "smaller than the tokenizer's (5000 tokens"},
      {"config validate " + gpt + at + " --set data.name=tokens --set data.path=" +
           (dir / "prepared").string() + " --set model.vocab_size=1000",
       "smaller than the tokenizer's (5000 tokens"},
  };
  // A `kiln data prepare` directory whose tokenizer is larger than the model's vocabulary.
  std::filesystem::create_directories(dir / "prepared");
  write_text(dir / "prepared" / "data.json", R"({"tokenizer": {"vocab_size": 5000}})");
  for (const auto& [command, message] : refusals) {
    SCOPED_TRACE(command);
    auto r = run_kiln(command);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(message));
    EXPECT_FALSE(std::filesystem::exists(dir / "runs")) << command << " left " << (dir / "runs");
  }
}

// One history per run directory: a fresh `kiln train` into a directory holding another run's
// records is refused (nothing changes); --overwrite moves them into previous-<time>/ first, and
// --resume auto with no checkpoint to continue does the same. TensorBoard never sees two runs
// in one directory.
TEST(Cli, AFreshRunDoesNotMixWithAnotherRunsRecords) {
  TempDir dir;
  const std::string train = "train " + (source_dir() / "configs/mlp.toml").string() +
                            " --set run.dir=" + dir.path().string() +
                            " --set train.steps=2 --set run.progress=off --set train.eval_every=0";
  const auto run = dir / "mlp";
  ASSERT_EQ(run_kiln(train).exit_code, 0);
  const std::string metrics = slurp(run / "metrics.jsonl"), log = slurp(run / "train.log");
  auto events = [&](const std::filesystem::path& at) {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(at))
      n += e.path().filename().string().starts_with("events.out.tfevents.");
    return n;
  };
  ASSERT_EQ(events(run), 1);

  auto again = run_kiln(train + " --set train.steps=3");
  expect_one_line_error(again, 2,
                        "kiln: error: run directory " + run.string() +
                            " holds another run's records (events.out.tfevents.");
  EXPECT_THAT(again.err,
              HasSubstr("metrics.jsonl, train.log); continue that run with --resume "
                        "auto, move its records aside with --overwrite, or set run.name"));
  EXPECT_EQ(slurp(run / "metrics.jsonl"), metrics);
  EXPECT_EQ(slurp(run / "train.log"), log);

  auto overwrite = run_kiln(train + " --set train.steps=3 --overwrite");
  ASSERT_EQ(overwrite.exit_code, 0) << overwrite.err;
  std::vector<std::filesystem::path> previous;
  for (const auto& e : std::filesystem::directory_iterator(run)) {
    if (e.path().filename().string().starts_with("previous-")) previous.push_back(e.path());
  }
  ASSERT_EQ(previous.size(), 1u);
  EXPECT_THAT(overwrite.err, HasSubstr("into " + previous[0].string()));
  EXPECT_EQ(slurp(previous[0] / "metrics.jsonl"), metrics);
  EXPECT_EQ(slurp(previous[0] / "train.log"), log);
  EXPECT_EQ(events(previous[0]), 1);
  EXPECT_EQ(events(run), 1);
  EXPECT_EQ(read_step_losses(run / "metrics.jsonl").size(), 3u);

  // --resume auto, no checkpoint: a fresh start that keeps the earlier records aside too.
  ASSERT_EQ(run_kiln(train + " --resume auto").exit_code, 0);
  int aside = 0;
  for (const auto& e : std::filesystem::directory_iterator(run))
    aside += e.path().filename().string().starts_with("previous-");
  EXPECT_EQ(aside, 2);
  EXPECT_EQ(read_step_losses(run / "metrics.jsonl").size(), 2u);
}

// The README's order (kiln train, then a rung of the same config) keeps the training run's
// records: the rung writes its own (metrics-<rung>.jsonl, <rung>.log, and beside a training run
// config-<rung>.toml and manifest-<rung>.json); alone in a fresh directory it writes config.toml
// and manifest.json as before (plan.pilot and kiln report read them).
TEST(Cli, ARungRunAloneKeepsATrainingRunsRecords) {
  TempDir dir;
  const std::string tiny = (source_dir() / "configs/gpt-tiny.toml").string() +
                           " --set run.dir=" + dir.path().string() +
                           " --set train.steps=3 --set train.eval_every=0 --set run.progress=off"
                           " --set train.batch_size=2 --set data.seq_len=32 --set run.threads=1"
                           " --set baseline.warmup_steps=1 --set baseline.steps=3";
  const auto run = dir / "gpt-tiny";
  ASSERT_EQ(run_kiln("train " + tiny).exit_code, 0);
  std::map<std::string, std::string> trained;
  for (const char* name : {"metrics.jsonl", "config.toml", "manifest.json", "train.log"})
    trained[name] = slurp(run / name);
  auto baseline = run_kiln("baseline " + tiny);
  ASSERT_EQ(baseline.exit_code, 0) << baseline.err;
  for (const auto& [name, text] : trained) EXPECT_EQ(slurp(run / name), text) << name;
  EXPECT_GE(read_step_losses(run / "metrics-baseline.jsonl").size(), 4u);  // warm-up + timed
  for (const char* name :
       {"config-baseline.toml", "manifest-baseline.json", "baseline.log", "baseline.json"})
    EXPECT_TRUE(std::filesystem::is_regular_file(run / name)) << name;
  EXPECT_THAT(slurp(run / "manifest-baseline.json"), HasSubstr("baseline"));  // its command line

  // Alone in a fresh directory: the shared names, and still its own step records.
  ASSERT_EQ(run_kiln("baseline " + tiny + " --set run.name=alone").exit_code, 0);
  for (const char* name : {"config.toml", "manifest.json", "metrics-baseline.jsonl"})
    EXPECT_TRUE(std::filesystem::is_regular_file(dir / "alone" / name)) << name;
  EXPECT_FALSE(std::filesystem::exists(dir / "alone" / "metrics.jsonl"));
}

// `kiln report` writes report.html only into a run directory; anything else is refused, naming
// what a run directory holds.
TEST(Cli, ReportRefusesADirectoryThatIsNotARun) {
  TempDir dir;
  for (const auto& target : {dir.path(), source_dir() / "docs"}) {
    expect_one_line_error(run_kiln("report " + target.string()), 2,
                          target.string() + " is not a run directory: a run directory");
    EXPECT_FALSE(std::filesystem::exists(target / "report.html"));
  }
  expect_one_line_error(run_kiln("report " + (dir / "none").string()), 2, "is not a directory");
  write_text(dir / "metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n");
  auto r = run_kiln("report " + dir.path().string());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir / "report.html"));
}

// Determinism across processes, not only within one: global state (RNG, threads) must not leak.
std::vector<double> logged_losses(const std::filesystem::path& metrics_file) {
  std::ifstream metrics(metrics_file);
  std::vector<double> losses;
  for (std::string line; std::getline(metrics, line);) {
    auto record = nlohmann::json::parse(line);
    if (record.contains("loss")) losses.push_back(record["loss"].get<double>());
  }
  return losses;
}

// The bundled small configs warm up without a spike: no step's loss 0.5 above the median of the
// five before it over the first 30 steps (gpt-tiny's former lr 3e-3 jumped from 3.5 to 7.3 at
// step 15; --set optim.lr=3e-3 shows it).
TEST(Cli, TheSmallConfigsWarmUpWithoutALossSpike) {
  TempDir dir;
  for (const char* name : {"gpt-tiny", "llama-tiny"}) {
    auto r =
        run_kiln("train " + (source_dir() / "configs" / (std::string(name) + ".toml")).string() +
                 " --set run.dir=" + dir.path().string() +
                 " --set train.steps=30 --set train.eval_every=0 --set run.progress=off");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const std::vector<double> losses = logged_losses(dir / name / "metrics.jsonl");
    ASSERT_EQ(losses.size(), 30u) << name;
    for (size_t i = 5; i < losses.size(); ++i) {
      std::vector<double> before(losses.begin() + static_cast<std::ptrdiff_t>(i) - 5,
                                 losses.begin() + static_cast<std::ptrdiff_t>(i));
      std::nth_element(before.begin(), before.begin() + 2, before.end());
      EXPECT_LE(losses[i], before[2] + 0.5) << name << " step " << i + 1;
    }
  }
}

TEST(Cli, TwoProcessesOfTheSameConfigLogBitwiseEqualLosses) {
  TempDir dir;
  std::vector<std::vector<double>> runs;
  for (const char* name : {"a", "b"}) {
    auto r = run_kiln("train " + (source_dir() / "configs/gpt-tiny.toml").string() +
                      " --set run.dir=" + dir.path().string() + " --set run.name=" + name +
                      " --set train.steps=6 --set train.eval_every=0 --set run.progress=off" +
                      " --set data.num_workers=" + (name[0] == 'a' ? "0" : "2"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    runs.push_back(logged_losses(dir / name / "metrics.jsonl"));
  }
  ASSERT_EQ(runs[0].size(), 6u);
  EXPECT_EQ(runs[0], runs[1]);  // exact: bitwise-equal doubles
}

}  // namespace
}  // namespace kiln::testing
