// Resuming training: bitwise equality with an uninterrupted run across processes (in the middle of
// an epoch, with prefetching loader threads), DDP state resharded 2 -> 1 and 1 -> 2 with the loader
// position converted, and the fallback to an older checkpoint when the newest is damaged.
#include "ckpt/resume.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <map>

#include "ckpt/ckpt_helpers.h"
#include "ckpt/internal.h"
#include "ckpt/thread_comm.h"
#include "kiln/checkpoint.h"
#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/run.h"
#include "kiln/session.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

bool bitwise_equal(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                   const std::vector<std::pair<std::string, torch::Tensor>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].first != b[k].first || a[k].second.sizes() != b[k].second.sizes() ||
        a[k].second.scalar_type() != b[k].second.scalar_type() ||
        std::memcmp(a[k].second.data_ptr(), b[k].second.data_ptr(), a[k].second.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

int run_kiln_args(const std::vector<std::string>& args, const std::filesystem::path& log) {
  KilnProcess process(args, log);
  return process.wait();
}

// K steps, save, a fresh process resumes and trains K more: the losses and the final parameters
// and optimizer state equal 2K uninterrupted steps bit for bit. 8 batches per epoch, K = 5: the
// resume lands in the middle of epoch 0 and the run crosses into epoch 1.
TEST(CkptResume, FreshProcessContinuesBitwiseInTheMiddleOfAnEpoch) {
  TempDir dir;
  const std::vector<std::string> common = {"train.steps=10", "data.num_workers=2",
                                           "data.prefetch=3", "train.batch_size=32"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  ASSERT_EQ(
      run_kiln_args(mlp_train_args(dir.path(), "straight", with({"checkpoint.every_steps=5"})),
                    dir / "a.log"),
      0)
      << slurp(dir / "a.log");
  const auto step5 = dir / "straight" / "checkpoints" / "step-5";
  CheckpointIndex index = read_checkpoint_index(step5);
  EXPECT_EQ(index.ranks[0]["loader"]["epoch"], 0);
  EXPECT_EQ(index.ranks[0]["loader"]["batch"], 5);
  EXPECT_EQ(index.ranks[0]["loader"]["batches_per_epoch"], 8);
  EXPECT_EQ(index.training_state["optimizer_steps"], 5);
  EXPECT_TRUE(index.training_state["grad_scaler"].is_null());
  EXPECT_TRUE(index.find("rng/rank-0/cpu") != nullptr);

  auto resume_args = mlp_train_args(dir.path(), "resumed", with({"checkpoint.every_steps=10"}));
  resume_args.insert(resume_args.end(), {"--resume", step5.string()});
  ASSERT_EQ(run_kiln_args(resume_args, dir / "b.log"), 0) << slurp(dir / "b.log");
  EXPECT_THAT(slurp(dir / "b.log"),
              HasSubstr("resumed from " + step5.string() + " at step 5 (epoch 0, batch 5)"));

  const auto straight = read_step_losses(dir / "straight" / "metrics.jsonl");
  const auto resumed = read_step_losses(dir / "resumed" / "metrics.jsonl");
  ASSERT_EQ(resumed.size(), 5u);
  for (const auto& [step, loss] : resumed) {
    ASSERT_TRUE(straight.count(step));
    EXPECT_EQ(loss, straight.at(step)) << "step " << step;  // bitwise: same double
  }
  const auto a = dir / "straight" / "checkpoints" / "step-10";
  const auto b = dir / "resumed" / "checkpoints" / "step-10";
  EXPECT_TRUE(bitwise_equal(read_checkpoint_tensors(a, "model/", true),
                            read_checkpoint_tensors(b, "model/", true)));
  EXPECT_TRUE(bitwise_equal(read_checkpoint_tensors(a, "optim/", true),
                            read_checkpoint_tensors(b, "optim/", true)));
  EXPECT_EQ(read_checkpoint_index(b).ranks[0]["loader"]["epoch"], 1);
}

// train.stop_after_step ends the process early (a slice of a longer job: the pilot's restore
// check, a time-limited allocation) while the learning-rate schedule still spans train.steps:
// the slice's saved step resumes to the same losses as the job run straight through, past the
// cosine warm-up. (The pilot set train.steps to its last step instead, which moved the schedule
// and failed its restore check once the pilot ran past warm-up.)
TEST(CkptResume, ASliceStoppedAfterAStepResumesOnTheWholeJobsSchedule) {
  TempDir dir;
  const std::vector<std::string> job = {"train.steps=8", "optim.schedule=cosine",
                                        "optim.warmup_steps=2", "data.num_workers=0",
                                        "checkpoint.every_steps=100"};  // the end's saves only
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), job.begin(), job.end());
    return extra;
  };
  ASSERT_EQ(run_kiln_args(mlp_train_args(dir.path(), "straight", with({})), dir / "a.log"), 0)
      << slurp(dir / "a.log");
  ASSERT_EQ(run_kiln_args(mlp_train_args(dir.path(), "slice", with({"train.stop_after_step=4"})),
                          dir / "b.log"),
            0)
      << slurp(dir / "b.log");
  EXPECT_EQ(read_step_losses(dir / "slice" / "metrics.jsonl").size(), 4u);
  const auto step4 = dir / "slice" / "checkpoints" / "step-4";  // the end's save
  ASSERT_TRUE(std::filesystem::exists(step4)) << slurp(dir / "b.log");
  auto resume_args = mlp_train_args(dir.path(), "slice", with({}));
  resume_args.insert(resume_args.end(), {"--resume", step4.string()});
  ASSERT_EQ(run_kiln_args(resume_args, dir / "c.log"), 0) << slurp(dir / "c.log");
  const auto straight = read_step_losses(dir / "straight" / "metrics.jsonl");
  const auto sliced = read_step_losses(dir / "slice" / "metrics.jsonl");
  ASSERT_EQ(sliced.size(), 8u);
  for (const auto& [step, loss] : straight) {
    EXPECT_EQ(sliced.at(step), loss) << "step " << step;  // bitwise: same double
  }
}

// The same across processes with SGD momentum, gradient accumulation, the loader in the training
// thread and the loss read back every 3 steps (the save at step 4 reads the device counters first).
TEST(CkptResume, SgdMomentumWithAccumulationContinuesBitwiseInAFreshProcess) {
  TempDir dir;
  const std::vector<std::string> common = {
      "train.steps=8",  "data.num_workers=0", "train.batch_size=16", "train.grad_accum_steps=2",
      "optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.05",       "train.metrics_every=3"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  ASSERT_EQ(
      run_kiln_args(mlp_train_args(dir.path(), "straight", with({"checkpoint.every_steps=4"})),
                    dir / "a.log"),
      0)
      << slurp(dir / "a.log");
  const auto step4 = dir / "straight" / "checkpoints" / "step-4";
  auto resume_args = mlp_train_args(dir.path(), "resumed", with({"checkpoint.every_steps=8"}));
  resume_args.insert(resume_args.end(), {"--resume", step4.string()});
  ASSERT_EQ(run_kiln_args(resume_args, dir / "b.log"), 0) << slurp(dir / "b.log");
  const auto straight = read_step_losses(dir / "straight" / "metrics.jsonl");
  const auto resumed = read_step_losses(dir / "resumed" / "metrics.jsonl");
  ASSERT_FALSE(resumed.empty());
  for (const auto& [step, loss] : resumed) {
    ASSERT_TRUE(straight.count(step)) << "step " << step;
    EXPECT_EQ(loss, straight.at(step)) << "step " << step;
  }
  const auto a = dir / "straight" / "checkpoints" / "step-8";
  const auto b = dir / "resumed" / "checkpoints" / "step-8";
  EXPECT_TRUE(bitwise_equal(read_checkpoint_tensors(a, "model/", true),
                            read_checkpoint_tensors(b, "model/", true)));
  EXPECT_TRUE(bitwise_equal(read_checkpoint_tensors(a, "optim/", true),
                            read_checkpoint_tensors(b, "optim/", true)));
}

// A gradient-averaging hook: enough DDP to keep thread-backed replicas identical.
class AverageGradients : public TrainerHook {
 public:
  explicit AverageGradients(Communicator& comm) : comm_(comm) {}
  void on_gradients_ready(Trainer& trainer) override {
    for (const auto& [name, p] : trainer.optimizer().parameters()) {
      torch::Tensor grad = p.grad();
      comm_.all_reduce_sum(grad);
      grad.div_(comm_.world_size());
    }
  }

 private:
  Communicator& comm_;
};

std::unique_ptr<Trainer> make_trainer(const Config& config, Communicator& comm) {
  TrainerOptions options;
  options.rank = comm.rank();
  options.world_size = comm.world_size();
  auto trainer = std::make_unique<Trainer>(TrainerSetup::from_config(config), make_model(config),
                                           make_datasets(config), options);
  trainer->add_hook(std::make_shared<AverageGradients>(comm));
  return trainer;
}

std::vector<std::pair<std::string, torch::Tensor>> parameters_of(Trainer& trainer) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [name, p] : trainer.optimizer().parameters())
    out.emplace_back(name, p.detach().clone());
  return out;
}

TEST(CkptResume, DdpStateReshardsTwoRanksToOneAndConvertsTheLoaderPosition) {
  TempDir dir;
  const Config config =
      mlp_config(dir.path(), {"data.num_samples=256", "train.batch_size=32", "data.num_workers=0"});
  std::vector<std::pair<std::string, torch::Tensor>> saved;
  run_ranks(2, [&](Communicator& comm) {
    auto trainer = make_trainer(config, comm);
    for (int k = 0; k < 3; ++k) trainer->train_step();
    Checkpointer checkpointer(checkpoint_options(config, dir / "t"), comm);
    checkpointer.save(capture_training_state(*trainer, comm, {}));
    checkpointer.wait();
    if (comm.rank() == 0) saved = parameters_of(*trainer);
  });
  const auto index = read_checkpoint_index(dir / "t" / "checkpoints" / "step-3");
  ASSERT_EQ(index.world_size, 2);
  ASSERT_NE(index.find("rng/rank-1/cpu"), nullptr);

  auto comm = single_process_communicator();
  auto trainer = make_trainer(config, *comm);
  auto loaded =
      restore_training_state(*trainer, *comm, dir / "t" / "checkpoints", /*dir_fallback=*/true);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(trainer->step(), 3);
  EXPECT_EQ(trainer->optimizer().steps_taken(), 3);
  EXPECT_TRUE(bitwise_equal(parameters_of(*trainer), saved));
  // World 2 at batch 3 of 4 consumed 3 x 32 x 2 = 192 samples: world 1 resumes at batch 6 of 8.
  EXPECT_EQ(trainer->state().loader, (LoaderPosition{0, 6}));
  trainer->train_step();  // and trains on
}

TEST(CkptResume, DdpStateReshardsOneRankToTwo) {
  TempDir dir;
  const Config config =
      mlp_config(dir.path(), {"data.num_samples=256", "train.batch_size=32", "data.num_workers=0"});
  std::vector<std::pair<std::string, torch::Tensor>> saved;
  {
    auto comm = single_process_communicator();
    auto trainer = make_trainer(config, *comm);
    for (int k = 0; k < 4; ++k) trainer->train_step();
    Checkpointer checkpointer(checkpoint_options(config, dir / "t"), *comm);
    checkpointer.save(capture_training_state(*trainer, *comm, {}));
    checkpointer.wait();
    saved = parameters_of(*trainer);
  }
  run_ranks(2, [&](Communicator& comm) {
    auto trainer = make_trainer(config, comm);
    restore_training_state(*trainer, comm, dir / "t" / "checkpoints" / "step-4",
                           /*dir_fallback=*/false);
    if (!bitwise_equal(parameters_of(*trainer), saved))
      throw std::runtime_error("parameters differ");
    if (trainer->optimizer().steps_taken() != 4) throw std::runtime_error("optimizer steps differ");
    // World 1 at batch 4 consumed 128 samples = 2 global batches of 2 x 32.
    if (!(trainer->state().loader == LoaderPosition{0, 2}))
      throw std::runtime_error("loader position");
    trainer->train_step();
  });
}

TEST(CkptResume, FallsBackWhenTheNewestIsDamagedAndVerifyFails) {
  TempDir dir;
  ASSERT_EQ(
      run_kiln_args(mlp_train_args(dir.path(), "r", {"train.steps=6", "checkpoint.every_steps=2"}),
                    dir / "a.log"),
      0)
      << slurp(dir / "a.log");
  const auto ckpts = dir / "r" / "checkpoints";
  flip_byte(ckpts / "step-6" / "rank-0.safetensors", -100);
  auto verify = run_kiln("ckpt verify " + (ckpts / "step-6").string());
  EXPECT_EQ(verify.exit_code, 2);
  EXPECT_THAT(verify.out, HasSubstr("does not match the index"));
  EXPECT_THAT(verify.err, HasSubstr("failed verification (1 problem);"));
  EXPECT_EQ(run_kiln("ckpt verify " + (ckpts / "step-4").string()).exit_code, 0);
  // The run directory given for its checkpoint directory: pointed at the one inside it.
  auto run_dir = run_kiln("ckpt verify " + (dir / "r").string());
  EXPECT_EQ(run_dir.exit_code, 2);
  EXPECT_THAT(run_dir.err, HasSubstr("is a run directory, not a checkpoint directory: its "
                                     "checkpoints are in " +
                                     ckpts.string()));

  auto resume = [&](const std::string& log) {
    // Saving off: a resumed run keeps saving as it did, and a save beside the damaged newer
    // checkpoint would mix two histories (refused: RefusesToMixHistories...).
    auto args = mlp_train_args(dir.path(), "r", {"train.steps=7", "checkpoint.every_steps=0"});
    args.insert(args.end(), {"--resume", "auto"});
    EXPECT_EQ(run_kiln_args(args, dir / log), 0) << slurp(dir / log);
    return slurp(dir / log);
  };
  std::string log = resume("b.log");
  EXPECT_THAT(log, HasSubstr("falling back to the previous checkpoint"));
  EXPECT_THAT(log, HasSubstr("resumed from " + (ckpts / "step-4").string() + " at step 4"));

  truncate_file(ckpts / "step-4" / "rank-0.safetensors", 16);
  EXPECT_EQ(run_kiln("ckpt verify " + (ckpts / "step-4").string()).exit_code, 2);
  log = resume("c.log");
  EXPECT_THAT(log, HasSubstr("resumed from " + (ckpts / "step-2").string() + " at step 2"));

  // An explicit step directory is loaded or refused, never silently replaced.
  auto args = mlp_train_args(dir.path(), "r", {"train.steps=7"});
  args.insert(args.end(), {"--resume", (ckpts / "step-6").string()});
  EXPECT_EQ(run_kiln_args(args, dir / "d.log"), 2);
  EXPECT_THAT(slurp(dir / "d.log"), HasSubstr("xxh3 does not match"));
}

// One checkpoint.dir holds one history. Bad input (a fresh start into it, a resume from an older
// step, a typo in --resume, --resume auto falling back past a damaged newest) is refused before
// anything is written: every checkpoint file and metrics.jsonl stay byte for byte. Once the newer
// checkpoints are moved away, the resume from the older step goes on and appends to metrics.jsonl.
TEST(CkptResume, RefusesToMixHistoriesAndBadInputNeverLosesSavedState) {
  TempDir dir;
  const auto ckpts = dir / "r" / "checkpoints";
  const auto metrics = dir / "r" / "metrics.jsonl";
  auto train = [&](const std::string& steps, const std::vector<std::string>& flags,
                   const std::string& log) {
    auto args =
        mlp_train_args(dir.path(), "r", {"train.steps=" + steps, "checkpoint.every_steps=1"});
    args.insert(args.end(), flags.begin(), flags.end());
    return run_kiln_args(args, dir / log);
  };
  auto saved_state = [&] {
    std::map<std::string, std::string> files = {{"metrics.jsonl", slurp(metrics)}};
    for (const auto& item : std::filesystem::recursive_directory_iterator(ckpts)) {
      // The run lock's record names its latest holder (every run takes the lock first).
      if (item.is_regular_file() && item.path().filename() != kRunLockFile)
        files[std::filesystem::relative(item.path(), ckpts).string()] = slurp(item.path());
    }
    return files;
  };
  auto step_records = [&] {
    int records = 0;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) records += line.find("\"loss\"") != line.npos;
    return records;
  };
  ASSERT_EQ(train("3", {}, "a.log"), 0) << slurp(dir / "a.log");
  ASSERT_EQ(step_records(), 3);
  const auto before = saved_state();
  ASSERT_EQ(before.count("step-1/index.json") + before.count("step-3/index.json"), 2u);

  EXPECT_EQ(train("5", {}, "fresh.log"), 2);
  EXPECT_THAT(slurp(dir / "fresh.log"),
              HasSubstr("checkpoint.dir " + ckpts.string() +
                        " holds committed checkpoints up to step 3 of an earlier run; continue it "
                        "with --resume auto"));
  EXPECT_EQ(saved_state(), before);

  EXPECT_EQ(train("5", {"--resume", (ckpts / "step-1").string()}, "older.log"), 2);
  EXPECT_THAT(slurp(dir / "older.log"),
              HasSubstr("holds newer checkpoints (" + (ckpts / "step-2").string() + ", " +
                        (ckpts / "step-3").string() + "); "));
  EXPECT_EQ(saved_state(), before);

  EXPECT_EQ(train("5", {"--resume", (ckpts / "step-9").string()}, "typo.log"), 2);
  EXPECT_THAT(slurp(dir / "typo.log"), HasSubstr("no such checkpoint"));
  EXPECT_EQ(saved_state(), before) << "a bad --resume truncated metrics.jsonl";

  flip_byte(ckpts / "step-3" / "rank-0.safetensors", -100);
  const auto damaged = saved_state();
  EXPECT_EQ(train("5", {"--resume", "auto"}, "auto.log"), 2);
  const std::string auto_log = slurp(dir / "auto.log");
  EXPECT_THAT(auto_log, HasSubstr("falling back to the previous checkpoint"));
  EXPECT_THAT(auto_log,
              HasSubstr("resuming at step 2, but checkpoint.dir " + ckpts.string() +
                        " holds newer checkpoints (" + (ckpts / "step-3").string() + ")"));
  EXPECT_EQ(saved_state(), damaged);

  std::filesystem::create_directories(dir / "moved");
  for (const char* name : {"step-2", "step-3"})
    std::filesystem::rename(ckpts / name, dir / "moved" / name);
  ASSERT_EQ(train("5", {"--resume", (ckpts / "step-1").string()}, "resume.log"), 0)
      << slurp(dir / "resume.log");
  EXPECT_EQ(step_records(), 3 + 4) << "the resumed run appends to metrics.jsonl";
  std::vector<int64_t> steps;
  for (const auto& entry : list_checkpoints(ckpts)) {
    EXPECT_TRUE(entry.committed);
    steps.push_back(entry.step);
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(slurp(ckpts / "latest"), "step-5\n");
  EXPECT_TRUE(verify_checkpoint(ckpts / "step-5").ok());
}

TEST(CkptResume, AutoWithoutCheckpointsStartsFreshAndBadPathsAreOneLineErrors) {
  TempDir dir;
  auto args = mlp_train_args(dir.path(), "r", {"train.steps=2"});
  args.insert(args.end(), {"--resume", "auto"});
  ASSERT_EQ(run_kiln_args(args, dir / "a.log"), 0) << slurp(dir / "a.log");
  EXPECT_THAT(slurp(dir / "a.log"), HasSubstr("no checkpoint in"));

  auto r = run_kiln("train " + (source_dir() / "configs/mlp.toml").string() + " --set run.dir=" +
                    dir.path().string() + " --resume " + (dir / "nowhere").string());
  EXPECT_EQ(r.exit_code, 2);
  // The error is the last line, one line (log lines of the session opening come before it).
  const std::string last_line = r.err.substr(r.err.rfind('\n', r.err.size() - 2) + 1);
  EXPECT_THAT(last_line,
              ::testing::StartsWith("kiln: error: --resume " + (dir / "nowhere").string() +
                                    ": no such checkpoint"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("terminate")));
}

// A checkpoint written by format version 1 (kiln at 4d9eb90, before the Trainer owned its state
// and each parameter had its own step count) still loads: resumed at step 3, the next losses are
// the ones that version's uninterrupted run logged. Bit for bit on the AVX2 CPU that logged them;
// a CPU with AVX-512 runs other ATen kernels whose float sums round differently (seen: step 5
// off by one ulp), so the comparison allows 1e-6 relative: a few ulps of a float loss.
TEST(CkptResume, AVersion1CheckpointLoadsAndContinuesAsItsOwnRunDid) {
  TempDir dir;
  const auto fixture = source_dir() / "tests/ckpt/fixtures/v1";
  ASSERT_EQ(
      run_kiln_args({"train", (fixture / "config.toml").string(), "--set",
                     "run.dir=" + dir.path().string(), "--resume", (fixture / "step-3").string()},
                    dir / "v1.log"),
      0)
      << slurp(dir / "v1.log");
  const nlohmann::json expected = nlohmann::json::parse(slurp(fixture / "expected.json"));
  const auto losses = read_step_losses(dir / "v1-fixture" / "metrics.jsonl");
  ASSERT_EQ(losses.size(), 3u) << slurp(dir / "v1.log");
  for (const auto& [step, loss] : losses) {
    const double want = expected["losses"][std::to_string(step)].get<double>();
    EXPECT_NEAR(loss, want, 1e-6 * std::abs(want)) << "step " << step;
  }
}

// Every file under `dir` but the run lock's record (every run takes the lock first): its size and
// a hash of its bytes, by path (short enough for a failure message to print).
std::map<std::string, std::string> files_under(const std::filesystem::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& item : std::filesystem::recursive_directory_iterator(dir)) {
    if (!item.is_regular_file() || item.path().filename() == kRunLockFile) continue;
    const std::string bytes = slurp(item.path());
    files[std::filesystem::relative(item.path(), dir).string()] =
        std::to_string(bytes.size()) + " bytes, hash " +
        std::to_string(std::hash<std::string>{}(bytes));
  }
  return files;
}

// Issue 28's scenario: checkpoints of a 5-layer gpt-tiny, resumed with model.n_layer = 3. The
// resume stops with one line naming the first tensor that differs, exit 2, before anything is
// written: no 3-layer checkpoint beside the 5-layer ones, no retention, no metrics, the run
// directory's config.toml and manifest.json unchanged. The same run resumes fine afterwards.
TEST(CkptResume, ADifferentModelIsRefusedBeforeAnythingIsWritten) {
  TempDir dir;
  auto gpt_tiny = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"train", (source_dir() / "configs/gpt-tiny.toml").string()};
    for (const std::string& set :
         {"run.dir=" + dir.path().string(), std::string("run.progress=off"),
          std::string("train.eval_every=0"), std::string("train.eval_batches=1"),
          std::string("train.batch_size=4"), std::string("data.seq_len=16"),
          std::string("checkpoint.every_steps=2"), std::string("checkpoint.keep_last_k=2")}) {
      args.insert(args.end(), {"--set", set});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  ASSERT_EQ(run_kiln_args(gpt_tiny({"--set", "train.steps=6"}), dir / "a.log"), 0)
      << slurp(dir / "a.log");
  const auto run_dir = dir / "gpt-tiny";
  const auto before = files_under(run_dir);
  ASSERT_EQ(
      before.count("checkpoints/step-4/index.json") + before.count("checkpoints/step-6/index.json"),
      2u);

  auto shallower =
      gpt_tiny({"--set", "train.steps=10", "--set", "model.n_layer=3", "--resume", "auto"});
  EXPECT_EQ(run_kiln_args(shallower, dir / "b.log"), 2);
  const std::string log = slurp(dir / "b.log");
  EXPECT_THAT(log, HasSubstr("kiln: error: --resume auto: " +
                             (run_dir / "checkpoints" / "step-6").string() +
                             " holds another training state than this config builds ("));
  // Sorted by name, the first difference is block 3's first tensor, which the 3-layer model lacks.
  EXPECT_THAT(log, HasSubstr("the first: 'model/transformer.h.3.attn.c_attn.bias' [384] is in the "
                             "checkpoint but not in the training state here"));
  EXPECT_THAT(log, HasSubstr("--resume restores a run exactly"));
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << log;
  EXPECT_EQ(files_under(run_dir), before) << "a refused resume wrote into " << run_dir;

  // A narrower model: the shapes differ (the first by name: block 0's attention bias, 3 x n_embd).
  EXPECT_EQ(run_kiln_args(gpt_tiny({"--set", "model.n_embd=64", "--set", "model.n_head=4",
                                    "--resume", (run_dir / "checkpoints").string()}),
                          dir / "c.log"),
            2);
  EXPECT_THAT(
      slurp(dir / "c.log"),
      HasSubstr("the first: 'model/transformer.h.0.attn.c_attn.bias' has shape [384] in the "
                "checkpoint but [192] here"));
  // Another optimizer: its state is another set of tensors.
  EXPECT_EQ(run_kiln_args(gpt_tiny({"--set", "optim.name=sgd", "--set", "optim.momentum=0.9",
                                    "--resume", "auto"}),
                          dir / "d.log"),
            2);
  EXPECT_THAT(slurp(dir / "d.log"), HasSubstr(".exp_avg' "));
  EXPECT_EQ(files_under(run_dir), before);

  ASSERT_EQ(run_kiln_args(gpt_tiny({"--set", "train.steps=8", "--resume", "auto"}), dir / "e.log"),
            0)
      << slurp(dir / "e.log");
  EXPECT_TRUE(checkpoint_committed(run_dir / "checkpoints" / "step-8"));
}

// The trainer-side check (a library caller that skips check_train_start): restoring a checkpoint
// of another model throws StateMismatch naming the difference and leaves the trainer as it was;
// restoring from the directory does not fall back to an older checkpoint (it holds the same).
TEST(CkptResume, RestoreIntoAnotherModelThrowsWithoutFallingBack) {
  TempDir dir;
  Config saved_config = gpt_config(dir.path(), {"train.steps=2", "checkpoint.every_steps=1"});
  {
    auto session = open_session(saved_config, {{"kiln"}});
    attach_checkpointing(*session->trainer, *session->comm, session->job.checkpoint,
                         session->job.resume);
    session->trainer->fit(2, session->run.get());
  }
  const auto ckpts = dir / "t" / "checkpoints";
  ASSERT_TRUE(checkpoint_committed(ckpts / "step-2"));
  Config other = gpt_config(dir.path(), {"run.name=other", "model.n_layer=1"});
  auto session = open_session(other, {{"kiln"}});
  const auto weights = weights_hash(session->trainer->model());
  try {
    restore_training_state(*session->trainer, *session->comm, ckpts, /*dir_fallback=*/true);
    ADD_FAILURE() << "a checkpoint of a 2-layer model restored into a 1-layer one";
  } catch (const ckpt::StateMismatch& e) {
    EXPECT_THAT(e.what(), HasSubstr((ckpts / "step-2").string() + " holds another training state"));
    EXPECT_THAT(e.what(), HasSubstr("'model/transformer.h.1."));
  }
  EXPECT_EQ(weights_hash(session->trainer->model()), weights);
  EXPECT_EQ(session->trainer->step(), 0);
}

// What check_train_start predicts from the run's model (before the Trainer exists) is what the
// Trainer built from it holds: the same names, shapes and dtypes (gpt with AdamW, mlp with SGD
// momentum, and gpt under bf16-mixed).
TEST(CkptResume, TheConfigsPredictedStateIsTheTrainersState) {
  TempDir dir;
  for (const Config& config :
       {gpt_config(dir.path()), mlp_config(dir.path(), {"optim.name=sgd", "optim.momentum=0.9"}),
        gpt_config(dir.path(), {"train.precision=bf16-mixed"})}) {
    auto session = open_session(config, {{"kiln"}});
    const auto live = ckpt::live_state_shapes(session->trainer->state(), *session->comm);
    EXPECT_EQ(ckpt::model_state_shapes(*make_model(config), session->job.trainer.optim), live);
    EXPECT_GT(live.size(), 4u);
  }
}

// A resumed run keeps the checkpoint settings it was saved with (README: `--set
// checkpoint.every_steps=500`, then `--resume auto`); --set still wins, and a resumed run that
// saves nothing while its directory holds checkpoints says so.
TEST(CkptResume, AResumedRunKeepsSavingAsItDid) {
  TempDir dir;
  const auto ckpts = dir / "r" / "checkpoints";
  auto train = [&](const std::vector<std::string>& sets, const std::string& log) {
    auto args = mlp_train_args(dir.path(), "r", sets);
    args.insert(args.end(), {"--resume", "auto"});
    return run_kiln_args(args, dir / log);
  };
  ASSERT_EQ(train({"train.steps=4", "checkpoint.every_steps=2"}, "a.log"), 0)
      << slurp(dir / "a.log");
  EXPECT_EQ(read_checkpoint_index(ckpts / "step-4").training_state["checkpointing"]["every_steps"],
            2);
  ASSERT_EQ(train({"train.steps=6"}, "b.log"), 0) << slurp(dir / "b.log");
  EXPECT_THAT(slurp(dir / "b.log"), HasSubstr("keeps the saved run's checkpoint.every_steps = 2"));
  EXPECT_TRUE(checkpoint_committed(ckpts / "step-6")) << slurp(dir / "b.log");
  EXPECT_THAT(slurp(dir / "r" / "config.toml"), HasSubstr("every_steps = 2"));

  ASSERT_EQ(train({"train.steps=8", "checkpoint.every_steps=0"}, "c.log"), 0)
      << slurp(dir / "c.log");
  EXPECT_FALSE(checkpoint_committed(ckpts / "step-8"));
  EXPECT_THAT(slurp(dir / "c.log"),
              HasSubstr("--resume: this run saves no checkpoints (checkpoint.every_steps = 0), "
                        "though " +
                        ckpts.string() + " holds them up to step 6"));
}

}  // namespace
}  // namespace kiln::testing
