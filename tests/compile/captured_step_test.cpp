// The captured step's logic on the CPU: the same engine that drives CUDA graphs (warm-up, the
// host-sync probe, static input buffers, the device learning rate, recaptures per shape), with a
// recorder that re-runs the work on each replay. Replays must then equal an eager run bitwise.
// The CUDA recorder itself runs in scripts/gpu-check (tests labelled cuda).
#include <gtest/gtest.h>

#include "ckpt/thread_comm.h"
#include "compile/internal.h"
#include "kiln/compile.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

std::vector<float> losses_of(const std::vector<StepStats>& steps) {
  std::vector<float> out;
  for (const StepStats& s : steps) out.push_back(static_cast<float>(s.loss));
  return out;
}

void expect_same_parameters(Model& a, Model& b) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  }
}

TEST(Optimizer, ADeviceLearningRateStepsExactlyAsTheHostOne) {
  for (const char* name : {"adamw", "sgd"}) {
    torch::manual_seed(3);
    OptimOptions options;
    options.kind =
        std::string(name) == "adamw" ? OptimOptions::Kind::kAdamW : OptimOptions::Kind::kSGD;
    options.momentum = 0.9;
    options.weight_decay = 0.1;
    auto w1 = torch::randn({4, 3}), w2 = w1.clone();
    Optimizer host(options, {{"w", w1}});
    Optimizer device(options, {{"w", w2}});
    auto lr = torch::zeros({}, torch::kDouble);  // CPU kernels read it as a double
    device.use_lr_tensor(lr);
    for (double rate : {1e-2, 3e-3 / 7, 5e-2 / 3}) {
      auto g = torch::randn({4, 3});
      w1.mutable_grad() = g.clone();
      w2.mutable_grad() = g.clone();
      host.step(rate);
      lr.fill_(rate);
      device.step(/*lr=*/123.0);  // ignored: the tensor holds the rate
      EXPECT_TRUE(torch::equal(w1, w2)) << name << " at lr " << rate;
    }
  }
  OptimOptions reference;
  reference.fused = false;
  auto w = torch::zeros({2});
  Optimizer slow(reference, {{"w", w}});
  EXPECT_THROW(slow.use_lr_tensor(torch::zeros({})), UserError);
}

// The rerun recorder stands in for CUDA graphs on the CPU, where a config rule refuses
// compile.backend = "cudagraphs": the backend is set after the config is validated (the rule's own
// test is in config_rules_test; attach_captured_step still refuses a CPU device below).
Config captured_gpt(const std::filesystem::path& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> overrides = {"compile.warmup_steps=2", "train.grad_accum_steps=2",
                                        "optim.warmup_steps=4",   "data.num_workers=0",
                                        "model.n_layer=1",        "train.batch_size=4"};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  Config config = gpt_config(dir, overrides);
  config.set_from_string("compile.backend=cudagraphs");
  return config;
}

struct SideBySide {
  std::shared_ptr<StepLog> eager = std::make_shared<StepLog>();
  std::shared_ptr<StepLog> captured = std::make_shared<StepLog>();
};

// Trains `eager` and `captured` one synced step each in turn, `steps` times; their step logs.
SideBySide train_side_by_side(Trainer& eager, Trainer& captured, int steps) {
  SideBySide logs;
  eager.add_hook(logs.eager);
  captured.add_hook(logs.captured);
  for (int k = 0; k < steps; ++k) {
    eager.train_step(/*sync=*/true);
    captured.train_step(/*sync=*/true);
  }
  return logs;
}

TEST(CapturedStep, ReplaysTrainExactlyAsTheEagerStep) {
  TempDir dir;
  const Config config = captured_gpt(dir.path());
  Trainer eager(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  Trainer captured(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  auto step = std::make_shared<CapturedGraphStep>(config, captured, rerun_recorders());
  captured.set_step_runner(step);
  const SideBySide logs = train_side_by_side(eager, captured, 7);
  const auto& eager_log = logs.eager;
  const auto& captured_log = logs.captured;
  // The learning rate changes every step (warm-up): replays read it from the device tensor.
  EXPECT_EQ(losses_of(captured_log->steps), losses_of(eager_log->steps));
  expect_same_parameters(captured.model(), eager.model());
  EXPECT_EQ(step->eager_steps(), 2);  // compile.warmup_steps
  EXPECT_EQ(step->replays(), 5);      // the capture, then four replays
  ASSERT_EQ(step->report().graphs.size(), 1u);
  EXPECT_TRUE(step->report().breaks.empty());
  EXPECT_EQ(captured_log->steps.back().samples, eager_log->steps.back().samples);
  EXPECT_EQ(captured.state().optimizer_steps, 7);
}

// DDP inside the captured step (ranks as threads): the gradient hooks fire inside the captured
// work and start the bucket all-reduces there, as a CUDA capture records them on its stream.
TEST(CapturedStep, UnderDdpReplaysTrainExactlyAsEagerDdp) {
  TempDir dir;
  const Config config =
      captured_gpt(dir.path(), {"dist.bucket_mb=0.05", "dist.first_bucket_mb=0.05"});
  constexpr int kWorld = 2;
  std::vector<std::vector<float>> eager_losses(kWorld), captured_losses(kWorld);
  std::vector<int64_t> eager_reduces(kWorld), captured_reduces(kWorld), replays(kWorld);
  run_ranks(kWorld, [&](Communicator& borrowed) {
    const int rank = borrowed.rank();
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    const TrainerOptions options{torch::kCPU, rank, kWorld, comm};
    Trainer eager(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                  options);
    Trainer captured(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                     options);
    auto eager_ddp = DataParallel::attach(eager, comm, data_parallel_options(config));
    auto captured_ddp = DataParallel::attach(captured, comm, data_parallel_options(config));
    auto step = std::make_shared<CapturedGraphStep>(config, captured, rerun_recorders());
    captured.set_step_runner(step);
    const SideBySide logs = train_side_by_side(eager, captured, 6);
    const auto r = static_cast<size_t>(rank);
    eager_losses[r] = losses_of(logs.eager->steps);
    captured_losses[r] = losses_of(logs.captured->steps);
    eager_reduces[r] = eager_ddp->bucket_all_reduces();
    captured_reduces[r] = captured_ddp->bucket_all_reduces();
    replays[r] = step->replays();
  });
  for (int r = 0; r < kWorld; ++r) {
    const auto k = static_cast<size_t>(r);
    EXPECT_EQ(captured_losses[k], eager_losses[k]) << "rank " << r;
    EXPECT_EQ(replays[k], 4) << "rank " << r;        // 2 warm-up steps, the capture, 3 replays
    EXPECT_GT(eager_reduces[k], 6) << "rank " << r;  // more than one bucket per step
    EXPECT_EQ(captured_reduces[k], eager_reduces[k]) << "rank " << r;
  }
  EXPECT_EQ(eager_losses[0], eager_losses[1]);  // the logged loss is the mean over ranks
}

TEST(CapturedStep, EachNewShapeIsARecaptureUpToTheLimit) {
  TempDir dir;
  const Config config =
      captured_gpt(dir.path(), {"compile.recompile_limit=2", "train.grad_accum_steps=1"});
  Trainer captured(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  auto step = std::make_shared<CapturedGraphStep>(config, captured, rerun_recorders());
  captured.set_step_runner(step);
  const Batch full = captured.next_batch();
  auto cut = [&](int64_t length) {
    return Batch{full.inputs.narrow(1, 0, length).contiguous(),
                 full.targets.narrow(1, 0, length).contiguous()};
  };
  for (int64_t length : {32, 32, 32, 16, 16, 16, 8, 8}) captured.train_step_on({cut(length)});
  const auto& report = step->report();
  ASSERT_EQ(report.graphs.size(), 2u);  // 32 and 16 captured; 8 over the limit
  ASSERT_EQ(report.recompiles.size(), 2u);
  EXPECT_TRUE(report.recompiles[0].compiled);
  EXPECT_NE(report.recompiles[0].reason.find("32 -> 16"), std::string::npos)
      << report.recompiles[0].reason;
  EXPECT_FALSE(report.recompiles[1].compiled);
  EXPECT_EQ(report.eager_micro_steps, 2);
  EXPECT_EQ(step->replays(), 2);  // one capture (and no replay yet) per captured shape
}

TEST(CapturedStep, AHostSynchronisationIsAGraphBreakNamedByOperator) {
  TempDir dir;
  for (bool fullgraph : {true, false}) {
    Config config = mlp_config(
        dir.path(), {"model.data_dependent_branch=true", "compile.warmup_steps=1",
                     "data.num_workers=0", fmt::format("compile.fullgraph={}", fullgraph)});
    config.set_from_string("compile.backend=cudagraphs");  // after the rules, as captured_gpt
    Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
    auto step = std::make_shared<CapturedGraphStep>(config, trainer, rerun_recorders());
    trainer.set_step_runner(step);
    if (fullgraph) {
      try {
        trainer.train_step(/*sync=*/true);
        ADD_FAILURE() << "a host synchronisation must stop a fullgraph capture";
      } catch (const TrainingError& e) {
        EXPECT_NE(std::string(e.what()).find("aten::_local_scalar_dense in aten::item (forward)"),
                  std::string::npos)
            << e.what();
      }
      continue;
    }
    trainer.run_steps(4);
    ASSERT_EQ(step->report().breaks.size(), 1u);
    EXPECT_NE(step->report().breaks[0].reason.find("aten::item"), std::string::npos);
    EXPECT_EQ(step->report().breaks[0].where, "forward");
    EXPECT_TRUE(step->report().fallback_to_eager);
    EXPECT_EQ(step->eager_steps(), 4);
    EXPECT_EQ(step->replays(), 0);
  }
}

TEST(CapturedStep, RefusedWhereItCannotRun) {
  TempDir dir;
  const Config config = captured_gpt(dir.path());
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  try {  // the CPU: CUDA graphs capture GPU work
    attach_captured_step(trainer, config);
    ADD_FAILURE() << "cudagraphs on the CPU must be refused";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("run.device = \"cuda\""), std::string::npos) << e.what();
  }
  EXPECT_TRUE(trainer.eager_step());
  const Config slow = captured_gpt(dir.path(), {"optim.fused=false"});
  Trainer reference(TrainerSetup::from_config(slow), make_model(slow), make_datasets(slow));
  EXPECT_THROW(CapturedGraphStep(slow, reference, rerun_recorders()), UserError);
  // The CLI says so in one line and exits 2 before writing anything.
  const CommandResult r = run_kiln("train " + (source_dir() / "configs/mlp.toml").string() +
                                   " --set run.dir=" + dir.path().string() +
                                   " --set run.name=cg --set compile.backend=cudagraphs");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("needs a CUDA device (run.device = \"cuda\")"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "cg" / "metrics.jsonl"));
}

}  // namespace
}  // namespace kiln::testing
