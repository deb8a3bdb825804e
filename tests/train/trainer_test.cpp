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
  Trainer trainer(config, make_model(config), make_datasets(config));
  std::vector<double> out;
  for (int64_t k = 0; k < steps; ++k) out.push_back(trainer.train_step().loss);
  return out;
}

TEST(Trainer, SeedMlpLearnsTheTeacherTaskAbove90Percent) {
  Config config = Config::load(source_dir() / "configs/mlp.toml",
                               {"run.progress=off", "train.eval_every=0", "run.dir=/tmp/unused"});
  apply_runtime_settings(config);
  Trainer trainer(config, make_model(config), make_datasets(config));
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
  Trainer trainer(config, std::make_shared<NanAfter>(make_model(config), 3), make_datasets(config));
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
  Trainer trainer(config, std::make_shared<NanAfter>(model, 2), make_datasets(config));
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
  Trainer trainer(config, model, make_datasets(config));
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
    Trainer trainer(config, model, make_datasets(config));
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

TEST(Schedule, WarmupThenCosineToTheFloor) {
  Config c = Config::parse("", "x",
                           {"optim.lr=1.0", "optim.warmup_steps=10", "optim.schedule=cosine",
                            "train.steps=110", "optim.min_lr_ratio=0.1"});
  EXPECT_DOUBLE_EQ(learning_rate(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(c, 9), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(c, 10), 1.0);
  EXPECT_NEAR(learning_rate(c, 60), 0.55, 1e-12);
  EXPECT_NEAR(learning_rate(c, 110), 0.1, 1e-12);
  Config constant = Config::parse("", "x", {"optim.lr=0.5"});
  EXPECT_DOUBLE_EQ(learning_rate(constant, 1000), 0.5);
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
  Trainer trainer(config, model, make_datasets(config));
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
