// Faults: SIGKILL at random points of a run that checkpoints every step, and during an async save
// for certain (sync and async: 20 trials), and a disk that fills up during a save. The newest
// committed checkpoint must always verify and resume; a failed save must leave the previous
// checkpoint intact and stop or continue as configured.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "ckpt/ckpt_helpers.h"
#include "kiln/checkpoint.h"
#include "kiln/error.h"
#include "kiln/session.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

Config cli_config(const std::vector<std::string>& args) {
  // The config `kiln train <mlp.toml> --set ...` resolves to, for an in-process resume.
  std::vector<std::string> overrides;
  for (size_t k = 0; k + 1 < args.size(); ++k) {
    if (args[k] == "--set") overrides.push_back(args[k + 1]);
  }
  return Config::load(source_dir() / "configs/mlp.toml", overrides);
}

// Whether `dir` holds a step-<N>.tmp directory (a save being written).
bool save_in_progress(const std::filesystem::path& dir) {
  const auto entries = list_checkpoints(dir);
  return std::any_of(entries.begin(), entries.end(), [](const auto& e) { return !e.committed; });
}

class CkptKill : public ::testing::TestWithParam<bool> {};

// 10 trials per mode (20 SIGKILLs). Sync: each kill at a random time. Async: odd trials kill at a
// random time too; even trials kill during a save for certain: once a step-<N>.tmp directory
// appears the child is stopped (SIGSTOP), and killed if the save is still unfinished then
// (else it continues and the next save is waited for).
TEST_P(CkptKill, TheNewestCommittedCheckpointAlwaysVerifiesAndResumes) {
  const bool async = GetParam();
  constexpr int kTrials = 10;
  std::mt19937 rng(async ? 2024 : 1129);
  int killed_mid_save = 0, meant_mid_save = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    TempDir dir;
    const auto args = mlp_train_args(
        dir.path(), "k",
        {"train.steps=1000000", "checkpoint.every_steps=1", "checkpoint.keep_last_k=2",
         std::string("checkpoint.async=") + (async ? "true" : "false"), "model.hidden_dim=2048",
         "data.num_workers=1"});
    const auto ckpts = dir / "k" / "checkpoints";
    KilnProcess process(args, dir / "train.log");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!std::filesystem::exists(ckpts / "latest")) {
      ASSERT_FALSE(process.exited()) << slurp(dir / "train.log");
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no checkpoint committed";
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const bool mid_save = async && trial % 2 == 0;
    if (mid_save) {
      ++meant_mid_save;
      while (true) {
        ASSERT_FALSE(process.exited()) << slurp(dir / "train.log");
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no save caught in progress";
        if (save_in_progress(ckpts)) {
          ::kill(process.pid(), SIGSTOP);
          int status = 0;  // wait until it has stopped for certain
          ASSERT_EQ(::waitpid(process.pid(), &status, WUNTRACED), process.pid());
          ASSERT_TRUE(WIFSTOPPED(status));
          if (save_in_progress(ckpts)) break;  // stopped while the save is unfinished
          ::kill(process.pid(), SIGCONT);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400000));
    }
    process.kill_now();

    const bool unfinished_save = save_in_progress(ckpts);
    killed_mid_save += unfinished_save;
    EXPECT_TRUE(unfinished_save || !mid_save) << "the kill meant to land mid-save did not";
    const auto entries = list_checkpoints(ckpts);
    auto newest =
        std::find_if(entries.rbegin(), entries.rend(), [](const auto& e) { return e.committed; });
    ASSERT_NE(newest, entries.rend());
    const VerifyReport report = verify_checkpoint(newest->path);
    ASSERT_TRUE(report.ok()) << report.problems.front();

    // A fresh trainer resumes from it (no fallback needed) and trains on.
    Config config = cli_config(args);
    Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
    auto loaded = restore_training_state(trainer, *single_process_communicator(), ckpts,
                                         /*dir_fallback=*/true);
    ASSERT_TRUE(loaded.has_value());
    EXPECT_EQ(loaded->path, newest->path);
    EXPECT_EQ(trainer.step(), newest->step);
    trainer.train_step();
  }
  std::cout << "[ kill ] " << kTrials << " trials, " << killed_mid_save
            << " killed while a save was being written (" << meant_mid_save << " on purpose)\n";
  EXPECT_GE(killed_mid_save, meant_mid_save);
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsync, CkptKill, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Async" : "Sync"; });

struct DiskFullCase {
  std::string on_save_error;
  bool want_tmpfs;
};

void PrintTo(const DiskFullCase& c, std::ostream* os) {
  *os << (c.want_tmpfs ? "tmpfs" : "RLIMIT_FSIZE") << ", on_save_error = " << c.on_save_error;
}

class CkptDiskFull : public ::testing::TestWithParam<DiskFullCase> {};

// Two checkpoints (~350 KB each) fit; the third does not. With a tmpfs that is a real ENOSPC; where
// mounting is refused (or for the rlimit case) RLIMIT_FSIZE makes the write fail with EFBIG.
TEST_P(CkptDiskFull, AFailedSaveKeepsThePreviousCheckpointAndStopsOrContinues) {
  const auto& param = GetParam();
  TempDir dir;
  SmallDisk disk(800 << 10);
  const bool tmpfs = param.want_tmpfs && disk.mounted();
  if (param.want_tmpfs && !tmpfs)
    std::cout << "[ note ] tmpfs mount refused (" << disk.why() << "); using RLIMIT_FSIZE\n";
  const auto ckpts = tmpfs ? disk.path() / "ckpt" : dir / "ckpt";
  const std::vector<std::string> common = {"checkpoint.dir=" + ckpts.string(),
                                           "checkpoint.every_steps=1", "checkpoint.keep_last_k=2",
                                           "checkpoint.on_save_error=" + param.on_save_error};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  {
    KilnProcess first(mlp_train_args(dir.path(), "r", with({"train.steps=2"})), dir / "first.log");
    ASSERT_EQ(first.wait(), 0) << slurp(dir / "first.log");
  }
  ASSERT_TRUE(verify_checkpoint(ckpts / "step-2").ok());
  auto args = mlp_train_args(dir.path(), "r", with({"train.steps=5"}));
  args.insert(args.end(), {"--resume", "auto"});
  KilnProcess second(args, dir / "second.log", tmpfs ? 0 : 100 << 10);
  const int code = second.wait();
  const std::string log = slurp(dir / "second.log");
  EXPECT_THAT(log, HasSubstr(tmpfs ? "No space left on device" : "File too large"));
  if (param.on_save_error == "stop") {
    EXPECT_EQ(code, 3) << log;
    EXPECT_THAT(log, HasSubstr("the previous checkpoints are intact"));
    EXPECT_THAT(log, HasSubstr("checkpoint.on_save_error = \"continue\""));
    // Advice that fits the cause: free space (ENOSPC), or the file-size limit (EFBIG).
    EXPECT_THAT(log, HasSubstr(tmpfs ? "free space in " + ckpts.string() : "ulimit -f"));
    EXPECT_THAT(log, Not(HasSubstr("second run")));
  } else {
    EXPECT_EQ(code, 0) << log;
    EXPECT_EQ(read_step_losses(dir / "r" / "metrics.jsonl").rbegin()->first, 5)
        << "training went on to the last step";
  }
  const auto entries = list_checkpoints(ckpts);
  ASSERT_FALSE(entries.empty());
  EXPECT_TRUE(entries.back().committed) << "no .tmp left behind";
  EXPECT_EQ(entries.back().step, 2);
  EXPECT_TRUE(verify_checkpoint(ckpts / "step-2").ok());
  EXPECT_EQ(slurp(ckpts / "latest"), "step-2\n");
}

INSTANTIATE_TEST_SUITE_P(Policies, CkptDiskFull,
                         ::testing::Values(DiskFullCase{"stop", true},
                                           DiskFullCase{"continue", true},
                                           DiskFullCase{"stop", false}),
                         [](const auto& info) {
                           return (info.param.want_tmpfs ? "Tmpfs_" : "FileSizeLimit_") +
                                  info.param.on_save_error;
                         });

}  // namespace
}  // namespace kiln::testing
