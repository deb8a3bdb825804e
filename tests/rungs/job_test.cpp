// The composition root (kiln/job.h): one `kiln train --resume auto` resolves, locks, builds and
// reads once; a step composed out of its written order is refused.
#include "kiln/job.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "kiln/comm.h"
#include "kiln/data.h"
#include "kiln/dist.h"
#include "kiln/models.h"
#include "kiln/run.h"
#include "kiln/training_run.h"
#include "support/helpers.h"

namespace kiln {
namespace {

using ::testing::HasSubstr;
using namespace kiln::testing;

Config saving_config(const std::filesystem::path& dir, int64_t steps) {
  return mlp_config(dir, {"train.steps=" + std::to_string(steps), "checkpoint.every_steps=3",
                          "data.num_workers=0"});
}

std::vector<int64_t> logged_steps(const std::filesystem::path& metrics) {
  std::vector<int64_t> steps;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains("loss") && record.contains("step_seconds"))
      steps.push_back(record["step"].get<int64_t>());
  }
  return steps;
}

// The count of one resumed run: 4 model builds, 5 checkpoint directory resolutions, 2
// directory locks, 3 reads of the resume index. Now one each, and the run does continue.
TEST(Job, ResumeAutoBuildsTheModelResolvesLocksAndReadsTheIndexOnce) {
  TempDir dir;
  run_training(saving_config(dir.path(), 6), TrainingRunOptions{});

  reset_composition_counts();
  const TrainingRunResult resumed =
      run_training(saving_config(dir.path(), 9), TrainingRunOptions{.resume = "auto"});
  const CompositionCounts counts = composition_counts();
  EXPECT_EQ(counts.model_builds, 1);
  EXPECT_EQ(counts.checkpoint_dir_resolutions, 1);
  EXPECT_EQ(counts.directory_locks, 1);
  EXPECT_EQ(counts.resume_index_reads, 1);
  // It continued from step 6: the appended records run 1..6 then 7..9.
  const std::vector<int64_t> steps = logged_steps(resumed.run_dir / "metrics.jsonl");
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.back(), 9);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), 7), 1);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), 6), 1) << "step 6 trained again";
}

// A resumed run already at its last step trains nothing and says so: no "trained 0 steps | loss
// 0.0000 -> 0.0000 | 0 samples/s" line and no second final record in metrics.jsonl.
TEST(Job, AResumeAtTheLastStepSaysNothingToTrainAndAppendsNothing) {
  TempDir dir;
  const TrainingRunResult done = run_training(saving_config(dir.path(), 3), {});
  const std::string before = slurp(done.run_dir / "metrics.jsonl");
  const TrainingRunResult again =
      run_training(saving_config(dir.path(), 3), TrainingRunOptions{.resume = "auto"});
  EXPECT_EQ(again.already_at_step, 3);
  EXPECT_THAT(training_summary_text(again),
              HasSubstr("nothing to train: the run resumed at step 3"));
  EXPECT_EQ(slurp(done.run_dir / "metrics.jsonl"), before);
  // The control: one more step trains it.
  const TrainingRunResult more =
      run_training(saving_config(dir.path(), 4), TrainingRunOptions{.resume = "auto"});
  EXPECT_EQ(more.already_at_step, -1);
  EXPECT_EQ(more.summary.steps, 1);
  EXPECT_THAT(training_summary_text(more), HasSubstr("trained 1 steps"));
  EXPECT_THAT(training_summary_text(more), ::testing::Not(HasSubstr("mean of the last")));
  EXPECT_THAT(training_summary_text(more), ::testing::Not(HasSubstr("nothing saved")));
  // A run that saves nothing says how to keep its state.
  TempDir plain;
  const TrainingRunResult unsaved = run_training(mlp_config(plain.path(), {"train.steps=12"}), {});
  // Its end loss is the mean of the last 10 steps' (steps 3..12), worked from its own records.
  std::vector<double> losses;
  {
    std::ifstream in(unsaved.run_dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto r = nlohmann::json::parse(line);
      if (r.contains("loss") && r.contains("step_seconds"))
        losses.push_back(r["loss"].get<double>());
    }
  }
  ASSERT_EQ(losses.size(), 12u);
  double mean = 0;
  for (size_t k = 2; k < 12; ++k) mean += losses[k] / 10.0;
  EXPECT_NEAR(unsaved.summary.last_loss_mean, mean, 1e-6 * std::abs(mean));
  EXPECT_EQ(unsaved.summary.last_loss_mean_steps, 10);
  EXPECT_NE(unsaved.summary.last_loss_mean, unsaved.summary.last_loss);
  EXPECT_THAT(training_summary_text(unsaved), HasSubstr("(mean of the last 10 steps; the last "));
  EXPECT_THAT(training_summary_text(unsaved),
              HasSubstr("nothing saved (checkpoint.every_steps = 0): add --set "
                        "checkpoint.every_steps=N"));
  // The rate: the model's FLOPs per sample x samples/s; a CPU has no catalog row, and a run this
  // short times no matmul, so the summary has no FLOP/s line. With a measured matmul it has one.
  EXPECT_GT(unsaved.achieved_flops_per_second, 0);
  EXPECT_EQ(unsaved.catalog_peak_flops_per_second, 0);
  ASSERT_LT(unsaved.summary.seconds, TrainingRunResult::kRateMinSeconds);
  EXPECT_EQ(unsaved.matmul_peak_flops_per_second, 0);
  EXPECT_THAT(training_summary_text(unsaved), ::testing::Not(HasSubstr("FLOP/s per device")));
  TrainingRunResult timed = unsaved;
  timed.matmul_peak_flops_per_second = 4 * unsaved.achieved_flops_per_second;
  EXPECT_THAT(training_summary_text(timed),
              HasSubstr("FLOP/s per device: 25.0% of this device's measured matmul"));
  timed.catalog_peak_flops_per_second = 10 * unsaved.achieved_flops_per_second;
  EXPECT_THAT(training_summary_text(timed), HasSubstr(": MFU 10.0% of the catalog peak, 25.0%"));
}

// dist.strategy = "fsdp" in one process without a launcher trains alone: said so.
TEST(Job, AStrategyWithoutALauncherIsSaid) {
  TempDir dir;
  const std::string train = "train " + (source_dir() / "configs/mlp.toml").string() +
                            " --set run.dir=" + (dir / "runs").string() +
                            " --set train.steps=2 --set run.progress=off";
  const CommandResult fsdp = run_kiln(train + " --set run.name=f --set dist.strategy=fsdp");
  EXPECT_EQ(fsdp.exit_code, 0) << fsdp.err;
  EXPECT_THAT(fsdp.err, HasSubstr("dist.strategy = \"fsdp\" but this is one process without a "
                                  "launcher: it trains alone"));
  const CommandResult plain = run_kiln(train + " --set run.name=a");  // the control: auto
  EXPECT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_THAT(plain.err, ::testing::Not(HasSubstr("without a launcher")));
}

// Negative controls: the counters see work done twice, and a fresh run reads no index.
TEST(Job, TheCountersSeeWorkDoneTwice) {
  TempDir dir;
  run_training(saving_config(dir.path(), 3), TrainingRunOptions{});
  reset_composition_counts();
  const Config config = saving_config(dir.path(), 6);
  resolve_job(config, {.resume = "auto"});
  resolve_job(config, {.resume = "auto"});
  make_model(config);
  make_model(config);
  CompositionCounts counts = composition_counts();
  EXPECT_EQ(counts.checkpoint_dir_resolutions, 2);
  EXPECT_EQ(counts.resume_index_reads, 2);
  EXPECT_EQ(counts.model_builds, 2);
  EXPECT_EQ(counts.directory_locks, 0);

  TempDir fresh;
  reset_composition_counts();
  run_training(saving_config(fresh.path(), 3), TrainingRunOptions{});
  counts = composition_counts();
  EXPECT_EQ(counts.resume_index_reads, 0);
  EXPECT_EQ(counts.directory_locks, 1);
  EXPECT_EQ(counts.model_builds, 1);
}

// A run's saved config.toml names its run: trained again, it lands in the same directory (an empty
// run.name takes the config file's stem, which would be "config" there).
TEST(Job, ASavedConfigTrainsIntoItsOwnRunDirectoryAgain) {
  TempDir dir;
  write_text(dir / "mine.toml", "[run]\ndir = \"" + (dir / "runs").string() +
                                    "\"\nprogress = \"off\"\n[train]\nsteps = 2\n");
  const TrainingRunResult first = run_training(Config::load(dir / "mine.toml"), {});
  EXPECT_EQ(first.run_dir, dir / "runs" / "mine");
  const Config saved = Config::load(first.run_dir / "config.toml");
  EXPECT_EQ(saved.get_string("run.name"), "mine");
  EXPECT_EQ(run_directory(saved), dir / "runs" / "mine");
  // The control: the file as given leaves the name to its stem.
  EXPECT_EQ(Config::load(dir / "mine.toml").get_string("run.name"), "");
}

std::unique_ptr<Trainer> bare_trainer(const Config& config) {
  return std::make_unique<Trainer>(TrainerSetup::from_config(config), make_model(config),
                                   make_datasets(config), TrainerOptions{});
}

// Checkpointing outside the layout outside the compiled unit: a program composing by hand in
// another order gets a refusal naming the order, not a step that recomputes without gathering.
TEST(Job, APieceInstalledOutOfOrderIsRefusedNamingTheOrder) {
  TempDir dir;
  const Config config = gpt_config(dir.path());
  auto comm = single_process_communicator();

  auto wrong = bare_trainer(config);
  DataParallel::attach(*wrong, comm, data_parallel_options(config));
  try {
    install_activation_checkpointing(*wrong);
    ADD_FAILURE() << "activation checkpointing installed after DDP";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot install activation checkpointing"));
    EXPECT_THAT(e.what(), HasSubstr("after DDP"));
    EXPECT_THAT(e.what(),
                HasSubstr("activation checkpointing -> tensor parallelism -> parallel layout"));
  }
  // One layout each: FSDP over DDP is refused too.
  EXPECT_THROW(FullyShardedDataParallel::attach(*wrong, comm, fsdp_options(config)),
               std::logic_error);

  // The control: the written order composes, and the Trainer records it.
  auto right = bare_trainer(config);
  install_activation_checkpointing(*right);
  EXPECT_NO_THROW(DataParallel::attach(*right, comm, data_parallel_options(config)));
  EXPECT_THAT(right->composition(),
              ::testing::ElementsAre("activation checkpointing (block)", "DDP"));
  EXPECT_NO_THROW(right->train_step());
}

}  // namespace
}  // namespace kiln
