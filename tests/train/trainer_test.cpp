#include <ATen/Context.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kiln/error.h"
#include "kiln/session.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

std::vector<double> losses_of(const Config& config, int64_t steps) {
  apply_runtime_settings(config);
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  std::vector<double> out;
  for (int64_t k = 0; k < steps; ++k) out.push_back(trainer.train_step().loss);
  return out;
}

TEST(Trainer, SeedMlpLearnsTheTeacherTaskAbove90Percent) {
  Config config = Config::load(source_dir() / "configs/mlp.toml",
                               {"run.progress=off", "train.eval_every=0", "run.dir=/tmp/unused"});
  apply_runtime_settings(config);
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  TrainSummary summary = trainer.fit(config.get_int("train.steps"), nullptr);
  EXPECT_GT(summary.final_eval.accuracy, 0.90);
  EXPECT_LT(summary.last_loss, summary.first_loss);
}

TEST(Trainer, TwoRunsOfTheSameConfigAreBitwiseIdentical) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"data.num_workers=2"});
  auto a = losses_of(config, 30);
  auto b = losses_of(config, 30);
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(a[k], b[k]) << "step " << k + 1;  // exact bits
  Config gpt = gpt_config(dir.path());
  EXPECT_EQ(losses_of(gpt, 5), losses_of(gpt, 5));
}

TEST(Trainer, DifferentSeedsGiveDifferentRuns) {
  TempDir dir;
  EXPECT_NE(losses_of(mlp_config(dir.path(), {"run.seed=1"}), 3),
            losses_of(mlp_config(dir.path(), {"run.seed=2"}), 3));
}

// run.fill_uninitialized_memory: PyTorch's NaN fill of every new tensor under deterministic
// mode, off by default. The step never reads memory it did not write: with the fill (a read of
// an uninitialized tensor would then be NaN in the loss) and without it, the losses are the same
// bits.
TEST(Trainer, TheUninitializedMemoryFillChangesNoLoss) {
  TempDir dir;
  const bool before = at::globalContext().deterministicFillUninitializedMemory();
  Config filled = gpt_config(dir.path(), {"run.fill_uninitialized_memory=true"});
  const auto with_fill = losses_of(filled, 4);
  EXPECT_TRUE(at::globalContext().deterministicFillUninitializedMemory());
  EXPECT_TRUE(torch::empty({8}).isnan().all().item<bool>());  // the fill is on: NaN
  Config plain = gpt_config(dir.path());
  const auto without = losses_of(plain, 4);
  EXPECT_FALSE(at::globalContext().deterministicFillUninitializedMemory());
  EXPECT_EQ(with_fill, without);
  at::globalContext().setDeterministicFillUninitializedMemory(before);
}

TEST(Trainer, LossSequenceDoesNotDependOnLoaderWorkers) {
  TempDir dir;
  auto sync = losses_of(mlp_config(dir.path(), {"data.num_workers=0"}), 20);
  EXPECT_EQ(sync, losses_of(mlp_config(dir.path(), {"data.num_workers=3", "data.prefetch=2"}), 20));
}

// A model that returns NaN logits from its k-th forward pass on.
class NanAfter final : public Model {
 public:
  NanAfter(std::shared_ptr<Model> inner, int poison_from)
      : inner_(std::move(inner)), poison_from_(poison_from) {
    register_module("inner", inner_);
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto y = inner_->forward(x);
    return ++calls_ >= poison_from_ ? y * std::numeric_limits<float>::quiet_NaN() : y;
  }
  std::string architecture() const override { return "nan"; }
  nlohmann::json describe() const override { return {}; }
  double train_flops_per_sample(int64_t) const override { return 0; }
  std::vector<ModelUnit> units() const override { return {}; }

 private:
  std::shared_ptr<Model> inner_;
  int poison_from_, calls_ = 0;
};

TEST(Trainer, InjectedNanAbortsNamingTheStep) {
  TempDir dir;
  Config config = mlp_config(dir.path());
  Trainer trainer(TrainerSetup::from_config(config),
                  std::make_shared<NanAfter>(make_model(config), 3), make_datasets(config));
  trainer.train_step();
  trainer.train_step();
  try {
    trainer.train_step();
    FAIL() << "no error";
  } catch (const TrainingError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("non-finite loss at step 3"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("train.nonfinite"));
  }
}

TEST(Trainer, SkipPolicySkipsNonFiniteStepsThenGivesUp) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"train.nonfinite=skip", "train.max_skipped_steps=2"});
  auto model = make_model(config);
  Trainer trainer(TrainerSetup::from_config(config), std::make_shared<NanAfter>(model, 2),
                  make_datasets(config));
  EXPECT_FALSE(trainer.train_step().skipped);
  auto before = model->parameters()[0].clone();
  EXPECT_TRUE(trainer.train_step().skipped);
  EXPECT_TRUE(trainer.train_step().skipped);
  EXPECT_TRUE(torch::equal(before, model->parameters()[0]));  // skipped steps change nothing
  EXPECT_THROW(trainer.train_step(), TrainingError);
}

TEST(Trainer, GradAccumulationMatchesOneLargeBatch) {
  // Two micro-batches of 16 give the same update as one batch of 32 on the same samples.
  TempDir dir;
  Config big = mlp_config(dir.path(),
                          {"train.batch_size=32", "data.shuffle=false", "train.clip_grad_norm=0"});
  Config accum = mlp_config(dir.path(), {"train.batch_size=16", "train.grad_accum_steps=2",
                                         "data.shuffle=false", "train.clip_grad_norm=0"});
  auto a = losses_of(big, 5);
  auto b = losses_of(accum, 5);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(a[k], b[k], 1e-5 * std::abs(a[k])) << k;
}

TEST(Trainer, ClippingBoundsTheUpdateNormButReportsTheRawNorm) {
  TempDir dir;
  Config config =
      mlp_config(dir.path(), {"train.clip_grad_norm=1e-3", "optim.name=sgd", "optim.lr=1.0"});
  auto model = make_model(config);
  Trainer trainer(TrainerSetup::from_config(config), model, make_datasets(config));
  std::vector<torch::Tensor> before;
  for (auto& p : model->parameters()) before.push_back(p.detach().clone());
  StepStats s = trainer.train_step();
  double squared = 0;
  auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k)
    squared += (params[k] - before[k]).pow(2).sum().item<double>();
  EXPECT_GT(s.grad_norm, 1e-2);
  EXPECT_NEAR(std::sqrt(squared), 1e-3, 1e-5);  // SGD at lr 1: the update is the clipped gradient
}

// The Trainer goes through its ParallelLayout for the optimizer's tensors, the gradient norm and
// the state: a layout that steps only fc2, doubles the norm and hides fc1 from the state is obeyed
// in all three (and the default layout is the replicated one: the same run without it differs).
TEST(Trainer, AParallelLayoutOwnsTheOptimizedTensorsTheNormAndTheState) {
  class Fc2Only final : public ParallelLayout {
   public:
    NamedTensors optimizer_parameters(Model& model) override {
      NamedTensors out;
      for (auto& item : model.named_parameters())
        if (item.key().rfind("fc2.", 0) == 0) out.emplace_back(item.key(), item.value());
      return out;
    }
    torch::Tensor global_gradient_norm(const std::vector<torch::Tensor>& grads,
                                       torch::Tensor& overflow) override {
      ++norms;
      grads_seen = grads.size();
      const torch::Tensor n = replicated_->global_gradient_norm(grads, overflow);
      inner = n.item<double>();
      return 2 * n;
    }
    void add_state(Model& model, const NamedTensors& optimizer_state, TrainState& state) override {
      replicated_->add_state(model, optimizer_state, state);
      std::erase_if(state.model, [](const auto& item) { return item.first.rfind("fc1.", 0) == 0; });
    }
    int norms = 0;
    size_t grads_seen = 0;  // the gradients of the tensors it gave the optimizer
    double inner = 0;       // their norm

   private:
    std::shared_ptr<ParallelLayout> replicated_ = replicated_layout();
  };
  TempDir dir;
  Config config = mlp_config(dir.path(), {"optim.name=sgd"});
  auto run = [&](std::shared_ptr<Fc2Only> layout) {
    auto model = make_model(config);
    Trainer trainer(TrainerSetup::from_config(config), model, make_datasets(config));
    if (layout) trainer.set_parallel_layout(layout);
    const auto fc1 = model->named_parameters()["fc1.weight"].detach().clone();
    const StepStats s = trainer.train_step(/*sync=*/true);
    const bool fc1_moved = !model->named_parameters()["fc1.weight"].equal(fc1);
    std::vector<std::string> names;
    for (const auto& item : trainer.state().model) names.push_back(item.first);
    return std::tuple{s.grad_norm, fc1_moved, names};
  };
  const auto [norm, fc1_moved, names] = run(nullptr);
  auto layout = std::make_shared<Fc2Only>();
  const auto [layout_norm, layout_fc1_moved, layout_names] = run(layout);
  EXPECT_TRUE(fc1_moved);
  EXPECT_FALSE(layout_fc1_moved) << "the optimizer stepped a tensor the layout did not give it";
  EXPECT_EQ(layout->norms, 1);
  EXPECT_EQ(layout->grads_seen, 2u);  // fc2.weight, fc2.bias
  EXPECT_DOUBLE_EQ(layout_norm, 2 * layout->inner);
  EXPECT_GT(norm, layout->inner);  // the replicated norm is over fc1 and fc2
  EXPECT_THAT(names, ::testing::Contains("fc1.weight"));
  EXPECT_THAT(layout_names, ::testing::Not(::testing::Contains("fc1.weight")));
  EXPECT_THAT(layout_names, ::testing::Contains("fc2.weight"));
}

// The Trainer runs every micro-step through its StepExecutor and every step through its
// StepRunner: an executor that delegates to eager trains bitwise as the default; one that
// declines a batch hands it to eager; one whose forward_backward adds no gradient leaves the
// parameters where they were (so its result, not an eager pass of the Trainer's own, is used);
// evaluation goes through the executor's evaluate.
TEST(Trainer, TheStepExecutorAndRunnerRunEveryStepAndADeclinedBatchRunsEager) {
  class Executor final : public StepExecutor {
   public:
    enum class Mode { kDelegate, kDecline, kNoGradients };
    explicit Executor(Mode mode) : mode_(mode) {}
    torch::Tensor forward_backward(Trainer& trainer, const Batch& batch, double scale,
                                   const torch::Tensor& loss_scale) override {
      ++calls;
      if (mode_ == Mode::kDecline) return {};
      if (mode_ == Mode::kNoGradients) {  // zero gradients: SGD without decay stays put
        torch::NoGradGuard no_grad;
        for (auto& p : trainer.model().parameters()) {
          if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        }
        return trainer.model().loss(trainer.model().forward(batch.inputs), batch.targets) * scale;
      }
      return trainer.eager_executor().forward_backward(trainer, batch, scale, loss_scale);
    }
    EvalOutputs evaluate(const Batch& batch) override {
      if (mode_ == Mode::kDecline) return {};
      return {torch::tensor(42.0), torch::tensor(batch.samples(), torch::kInt64)};
    }
    int calls = 0;

   private:
    Mode mode_;
  };
  class Runner final : public StepRunner {
   public:
    torch::Tensor run(int micro_steps, const Fetch& fetch, double /*lr*/,
                      const DeviceWork& work) override {
      ++steps;
      micro += micro_steps;
      return work(fetch);
    }
    int steps = 0, micro = 0;
  };
  struct Phases final : TrainerHook {
    void on_phase_begin(Trainer&, Phase phase) override {
      if (phase == Phase::kBackward) ++backward;
    }
    int backward = 0;
  };
  TempDir dir;
  const Config config = mlp_config(
      dir.path(), {"optim.name=sgd", "optim.weight_decay=0", "train.grad_accum_steps=2"});
  struct Outcome {
    std::vector<double> losses;
    bool moved = false;
    int backward_phases = 0;
    double eval_loss = 0, eval_accuracy = 0;
  };
  auto run = [&](std::shared_ptr<StepExecutor> executor, std::shared_ptr<StepRunner> runner) {
    apply_runtime_settings(config);
    auto model = make_model(config);
    Trainer trainer(TrainerSetup::from_config(config), model, make_datasets(config));
    auto phases = std::make_shared<Phases>();
    trainer.add_hook(phases);
    trainer.set_step_executor(std::move(executor));
    trainer.set_step_runner(std::move(runner));
    const auto before = model->parameters()[0].detach().clone();
    Outcome out;
    for (int k = 0; k < 3; ++k) out.losses.push_back(trainer.train_step(/*sync=*/true).loss);
    out.moved = !model->parameters()[0].equal(before);
    out.backward_phases = phases->backward;
    const EvalStats eval = trainer.evaluate();
    out.eval_loss = eval.loss;
    out.eval_accuracy = eval.accuracy;
    return out;
  };
  const Outcome eager = run(nullptr, nullptr);
  auto delegate = std::make_shared<Executor>(Executor::Mode::kDelegate);
  auto runner = std::make_shared<Runner>();
  const Outcome delegated = run(delegate, runner);
  EXPECT_EQ(delegated.losses, eager.losses);  // bitwise
  EXPECT_EQ(delegate->calls, 6);              // 3 steps x 2 micro-steps
  EXPECT_EQ(runner->steps, 3);
  EXPECT_EQ(runner->micro, 6);
  EXPECT_EQ(delegated.eval_loss, 42.0);  // the executor's evaluate
  EXPECT_EQ(delegated.eval_accuracy, 1.0);
  EXPECT_NE(eager.eval_loss, 42.0);

  auto decline = std::make_shared<Executor>(Executor::Mode::kDecline);
  const Outcome declined = run(decline, nullptr);
  EXPECT_EQ(declined.losses, eager.losses);
  EXPECT_EQ(decline->calls, 6);
  EXPECT_EQ(declined.backward_phases, 6);  // eager ran every declined micro-batch
  EXPECT_EQ(declined.eval_loss, eager.eval_loss);

  auto frozen = std::make_shared<Executor>(Executor::Mode::kNoGradients);
  const Outcome no_gradients = run(frozen, nullptr);
  EXPECT_TRUE(eager.moved);
  EXPECT_FALSE(no_gradients.moved) << "the Trainer ran its own backward instead of the executor";
  EXPECT_EQ(no_gradients.backward_phases, 0);
  EXPECT_EQ(no_gradients.losses.front(), eager.losses.front());
}

TEST(Schedule, WarmupThenCosineToTheFloor) {
  Config c = Config::parse("", "x",
                           {"optim.lr=1.0", "optim.warmup_steps=10", "optim.schedule=cosine",
                            "train.steps=110", "optim.min_lr_ratio=0.1"});
  const OptimOptions o = OptimOptions::from_config(c);
  const int64_t steps = TrainOptions::from_config(c).steps;
  EXPECT_DOUBLE_EQ(learning_rate(o, steps, 0), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, steps, 9), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, steps, 10), 1.0);
  EXPECT_NEAR(learning_rate(o, steps, 60), 0.55, 1e-12);
  EXPECT_NEAR(learning_rate(o, steps, 110), 0.1, 1e-12);
  Config constant = Config::parse("", "x", {"optim.lr=0.5"});
  EXPECT_DOUBLE_EQ(learning_rate(OptimOptions::from_config(constant),
                                 TrainOptions::from_config(constant).steps, 1000),
                   0.5);
}

TEST(Optimizer, FusedAndReferenceKernelsAgree) {
  for (std::string name : {"adamw", "sgd"}) {
    TempDir dir;
    std::vector<std::string> common = {"optim.name=" + name, "optim.weight_decay=0.1",
                                       "optim.momentum=0.9"};
    auto fused = common, reference = common;
    fused.push_back("optim.fused=true");
    reference.push_back("optim.fused=false");
    auto a = losses_of(mlp_config(dir.path(), fused), 10);
    auto b = losses_of(mlp_config(dir.path(), reference), 10);
    for (size_t k = 0; k < a.size(); ++k)
      EXPECT_NEAR(a[k], b[k], 1e-5 * std::abs(a[k])) << name << " step " << k;
  }
}

TEST(Optimizer, StateRoundTripsThroughLoadState) {
  TempDir dir;
  Config config = mlp_config(dir.path());
  auto model = make_model(config);
  Trainer trainer(TrainerSetup::from_config(config), model, make_datasets(config));
  trainer.train_step();
  NamedTensors saved;
  for (auto& [name, t] : trainer.optimizer().state()) saved.emplace_back(name, t.clone());
  ASSERT_EQ(saved.size(), 8u);  // 4 parameters x (exp_avg, exp_avg_sq)
  trainer.train_step();
  trainer.optimizer().load_state(saved, 1);
  EXPECT_EQ(trainer.optimizer().steps_taken(), 1);
  auto live = trainer.optimizer().state();
  for (size_t k = 0; k < saved.size(); ++k)
    EXPECT_TRUE(torch::equal(live[k].second, saved[k].second));
}

}  // namespace
}  // namespace kiln::testing
