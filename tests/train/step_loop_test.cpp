// The one step loop: the hook contract, device-side metrics (no host sync between read-backs),
// the non-finite policies across deferred read-backs, and the training state as one value.
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "kiln/comm.h"
#include "kiln/error.h"
#include "kiln/session.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records every hook call as a line.
class Recorder : public TrainerHook {
 public:
  std::vector<std::string> events;
  void on_train_begin(Trainer&) override { events.push_back("train_begin"); }
  void on_step_begin(Trainer&, int64_t step) override {
    events.push_back("step_begin " + std::to_string(step));
  }
  void on_micro_step_begin(Trainer&, int micro, bool last) override {
    events.push_back("micro " + std::to_string(micro) + (last ? " last" : ""));
  }
  void on_phase_begin(Trainer&, Phase phase) override {
    events.push_back(std::string("+") + phase_name(phase));
  }
  void on_phase_end(Trainer&, Phase phase) override {
    events.push_back(std::string("-") + phase_name(phase));
  }
  void on_gradients_ready(Trainer&) override { events.push_back("gradients_ready"); }
  void on_step_end(Trainer&, const StepStats& s) override {
    events.push_back("step_end " + std::to_string(s.step) + (s.synced ? " synced" : ""));
  }
  void on_step_failed(Trainer&, int64_t step) override {
    events.push_back("step_failed " + std::to_string(step));
  }
  void on_eval(Trainer&, const EvalStats&) override { events.push_back("eval"); }
  void on_train_end(Trainer&) override { events.push_back("train_end"); }
};

// Wraps a model: throws from forward on call `throw_on`, returns NaN logits from call
// `poison_from` on, and uses an extra parameter only for micro-batches whose first input is
// positive (so on some steps that parameter gets no gradient at all).
class Wrapped : public Model {
 public:
  explicit Wrapped(std::shared_ptr<Model> inner, int poison_from = 0, int throw_on = 0)
      : inner_(std::move(inner)), poison_from_(poison_from), throw_on_(throw_on) {
    register_module("inner", inner_);
    extra_ = register_parameter("extra", torch::full({1}, 0.5));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    ++calls_;
    if (calls_ == throw_on_) throw std::runtime_error("forward failed on purpose");
    auto y = inner_->forward(x);
    if (x.flatten()[0].item<float>() > 0) {
      y = y * extra_;
    } else {
      ++unused_;
    }
    return poison_from_ > 0 && calls_ >= poison_from_ ? y * std::numeric_limits<float>::quiet_NaN()
                                                      : y;
  }
  std::string architecture() const override { return "wrapped"; }
  nlohmann::json describe() const override { return {}; }
  double train_flops_per_sample(int64_t) const override { return 0; }
  std::vector<ModelUnit> units() const override { return {}; }
  int unused() const { return unused_; }
  void stop_poisoning() { poison_from_ = 0; }

 private:
  std::shared_ptr<Model> inner_;
  torch::Tensor extra_;
  int poison_from_, throw_on_, calls_ = 0, unused_ = 0;
};

TEST(StepLoop, HooksRunInTheDocumentedOrder) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"train.grad_accum_steps=2", "data.num_workers=0"});
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  auto recorder = std::make_shared<Recorder>();
  trainer.add_hook(recorder);
  trainer.train_step();
  EXPECT_THAT(recorder->events,
              ElementsAre("step_begin 0", "micro 0", "+data_wait", "-data_wait", "+forward",
                          "-forward", "+backward", "-backward", "micro 1 last", "+data_wait",
                          "-data_wait", "+forward", "-forward", "+backward", "-backward",
                          "gradients_ready", "+optimizer", "-optimizer", "step_end 1 synced"));
  recorder->events.clear();
  trainer.fit(2, nullptr);
  EXPECT_THAT(recorder->events.front(), "train_begin");
  EXPECT_THAT(recorder->events.back(), "train_end");
  EXPECT_EQ(recorder->events[recorder->events.size() - 2], "eval");
}

TEST(StepLoop, AThrowingStepClosesItsPhasesThenReportsTheFailedStep) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"data.num_workers=0"});
  Trainer trainer(TrainerSetup::from_config(config),
                  std::make_shared<Wrapped>(make_model(config), 0, /*throw_on=*/2),
                  make_datasets(config));
  auto recorder = std::make_shared<Recorder>();
  trainer.add_hook(recorder);
  trainer.train_step();
  recorder->events.clear();
  EXPECT_THROW(trainer.train_step(), std::runtime_error);
  EXPECT_THAT(recorder->events, ElementsAre("step_begin 1", "micro 0 last", "+data_wait",
                                            "-data_wait", "+forward", "-forward", "step_failed 2"));
  EXPECT_EQ(trainer.step(), 1);  // the failed step does not count
}

TEST(StepLoop, AHookThrowingAtPhaseBeginStillClosesThatPhase) {
  TempDir dir;
  // A hook throws in on_phase_begin(data_wait), after the phase opened for the hooks before it:
  // those hooks see it closed before step_failed.
  class ThrowOnDataWait : public TrainerHook {
   public:
    void on_phase_begin(Trainer&, Phase phase) override {
      if (phase == Phase::kDataWait) throw UserError("no data");
    }
  };
  Config config = mlp_config(dir.path(), {"data.num_workers=0"});
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  auto recorder = std::make_shared<Recorder>();
  trainer.add_hook(recorder);
  trainer.add_hook(std::make_shared<ThrowOnDataWait>());
  EXPECT_THROW(trainer.train_step(), UserError);
  EXPECT_THAT(recorder->events, ElementsAre("step_begin 0", "micro 0 last", "+data_wait",
                                            "-data_wait", "step_failed 1"));
}

TEST(StepLoop, AHookThrowingAtPhaseEndPropagatesInsteadOfAborting) {
  TempDir dir;
  // FSDP's on_phase_end frees a group and can raise a CommunicationError. Outside unwinding that
  // exception leaves ~PhaseScope (noexcept(false)): the step fails with it, and the CLI exits 3;
  // a destructor that is noexcept would call std::terminate (SIGABRT) instead.
  class ThrowOnBackwardEnd : public TrainerHook {
   public:
    void on_phase_end(Trainer&, Phase phase) override {
      if (phase == Phase::kBackward) throw CommunicationError("free_group: the peer went away");
    }
  };
  Config config = mlp_config(dir.path(), {"data.num_workers=0"});
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  auto recorder = std::make_shared<Recorder>();
  trainer.add_hook(recorder);
  trainer.add_hook(std::make_shared<ThrowOnBackwardEnd>());
  EXPECT_THROW(trainer.train_step(), CommunicationError);
  EXPECT_THAT(recorder->events,
              ElementsAre("step_begin 0", "micro 0 last", "+data_wait", "-data_wait", "+forward",
                          "-forward", "+backward", "-backward", "step_failed 1"));
  EXPECT_EQ(trainer.step(), 0);
}

// Counts the scalar reads (aten::item, a host sync on a device) that kiln's own code makes on
// this thread: top-level ones only. Reads inside another op are that op's business (ATen's CPU
// fused AdamW reads its CPU step counts with item(); its CUDA kernel does not).
std::atomic<int> scalar_reads{0};
thread_local int op_depth = 0;
std::unique_ptr<at::ObserverContext> on_op_begin(const at::RecordFunction& fn) {
  if (op_depth == 0 && (std::string_view(fn.name()) == "aten::item" ||
                        std::string_view(fn.name()) == "aten::_local_scalar_dense")) {
    ++scalar_reads;
  }
  ++op_depth;
  return nullptr;
}
void on_op_end(const at::RecordFunction&, at::ObserverContext*) {
  --op_depth;
}

TEST(StepLoop, StepsBetweenReadBacksNeverReadAScalar) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"train.metrics_every=4", "data.num_workers=0"});
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(on_op_begin, on_op_end).needsInputs(false));
  for (int k = 1; k <= 3; ++k) {
    const StepStats s = trainer.train_step();
    EXPECT_FALSE(s.synced) << "step " << k;
    EXPECT_TRUE(std::isnan(s.loss));
  }
  EXPECT_EQ(scalar_reads.load(), 0);
  const StepStats fourth = trainer.train_step();
  EXPECT_TRUE(fourth.synced);
  EXPECT_TRUE(std::isfinite(fourth.loss) && std::isfinite(fourth.grad_norm));
  (void)torch::ones({}).item<float>();  // the counter does see a scalar read
  EXPECT_GE(scalar_reads.load(), 1);
  at::removeCallback(handle);
}

TEST(StepLoop, SkipPolicyCountsDeferredNonFiniteStepsAtTheReadBack) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"train.metrics_every=4", "train.nonfinite=skip",
                                          "train.max_skipped_steps=5", "data.num_workers=0"});
  auto inner = make_model(config);
  Trainer trainer(TrainerSetup::from_config(config),
                  std::make_shared<Wrapped>(inner, /*poison_from=*/2), make_datasets(config));
  trainer.train_step();
  const auto after_first = inner->parameters()[0].clone();
  trainer.train_step();
  trainer.train_step();
  EXPECT_EQ(trainer.skipped_steps(), 0);  // not read back yet
  const StepStats fourth = trainer.train_step();
  EXPECT_TRUE(fourth.synced && fourth.skipped);
  EXPECT_EQ(trainer.skipped_steps(), 3);
  EXPECT_TRUE(torch::equal(after_first, inner->parameters()[0]));  // skipped on the device
  trainer.train_step();
  trainer.train_step();
  trainer.train_step();
  EXPECT_THROW(trainer.train_step(), TrainingError);  // 7 skipped > 5
}

TEST(StepLoop, AbortPolicyStopsAtTheReadBackNamingTheFirstBadStep) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"train.metrics_every=4", "data.num_workers=0"});
  auto inner = make_model(config);
  Trainer trainer(TrainerSetup::from_config(config),
                  std::make_shared<Wrapped>(inner, /*poison_from=*/2), make_datasets(config));
  trainer.train_step();
  const auto after_first = inner->parameters()[0].clone();
  trainer.train_step();
  trainer.train_step();
  try {
    trainer.train_step();
    FAIL() << "no error";
  } catch (const TrainingError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("non-finite loss or gradient at step 2"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("train.nonfinite"));
  }
  EXPECT_TRUE(torch::equal(after_first, inner->parameters()[0]));
}

// ---- the training state ------------------------------------------------------------------------

NamedTensors cloned(const NamedTensors& tensors) {
  NamedTensors out;
  for (const auto& [name, t] : tensors) out.emplace_back(name, t.clone());
  return out;
}

TrainState deep_copy(const TrainState& s) {
  TrainState out = s;
  out.model = cloned(s.model);
  out.optimizer = cloned(s.optimizer);
  out.rng = cloned(s.rng);
  return out;
}

struct Outcome {
  std::vector<double> losses;
  NamedTensors model, optimizer;
};

// Six steps straight, or three, a state copied into a fresh trainer, and three more.
Outcome run(const Config& config, bool split) {
  apply_runtime_settings(config);
  auto first_model = std::make_shared<Wrapped>(make_model(config));
  auto first = std::make_unique<Trainer>(TrainerSetup::from_config(config), first_model,
                                         make_datasets(config));
  Outcome out;
  Trainer* trainer = first.get();
  std::unique_ptr<Trainer> second;
  for (int k = 0; k < 6; ++k) {
    if (split && k == 3) {
      TrainState saved = deep_copy(first->state());
      first.reset();            // nothing of the first trainer survives but the copied state
      torch::manual_seed(999);  // the restored RNG state must win over this
      auto model = std::make_shared<Wrapped>(make_model(config));
      second = std::make_unique<Trainer>(TrainerSetup::from_config(config), model,
                                         make_datasets(config));
      second->load_state(saved);
      trainer = second.get();
    }
    out.losses.push_back(trainer->train_step(/*sync=*/true).loss);
  }
  out.model = cloned(trainer->state().model);
  out.optimizer = cloned(trainer->state().optimizer);
  return out;
}

void expect_bitwise_equal(const NamedTensors& a, const NamedTensors& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].first, b[k].first) << what;
    EXPECT_TRUE(torch::equal(a[k].second, b[k].second)) << what << " " << a[k].first;
  }
}

TEST(TrainState, RestoringIntoAFreshTrainerContinuesBitwise) {
  struct Case {
    std::string name;
    std::vector<std::string> overrides;
  };
  const std::vector<Case> cases = {
      {"adamw", {"data.num_workers=0"}},
      {"adamw, 2 workers, accumulation", {"data.num_workers=2", "train.grad_accum_steps=2"}},
      {"sgd momentum", {"optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.05"}},
      {"sgd reference kernels, accumulation",
       {"optim.name=sgd", "optim.momentum=0.9", "optim.fused=false", "train.grad_accum_steps=2"}},
      {"adamw reference kernels", {"optim.fused=false", "data.num_workers=2"}},
  };
  for (const auto& c : cases) {
    TempDir dir;
    std::vector<std::string> overrides = {"train.batch_size=8", "optim.weight_decay=0.1"};
    overrides.insert(overrides.end(), c.overrides.begin(), c.overrides.end());
    Config config = mlp_config(dir.path(), overrides);
    const Outcome straight = run(config, /*split=*/false);
    const Outcome resumed = run(config, /*split=*/true);
    ASSERT_EQ(straight.losses.size(), resumed.losses.size());
    for (size_t k = 0; k < straight.losses.size(); ++k) {
      EXPECT_EQ(straight.losses[k], resumed.losses[k]) << c.name << " step " << k + 1;
    }
    expect_bitwise_equal(straight.model, resumed.model, c.name + " model");
    expect_bitwise_equal(straight.optimizer, resumed.optimizer, c.name + " optimizer");
  }
}

TEST(TrainState, ASkippedStepAndAParameterWithoutGradientSurviveTheRestore) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"train.batch_size=4", "train.nonfinite=skip",
                                          "data.num_workers=0", "data.shuffle=false"});
  apply_runtime_settings(config);
  // Straight: step 2 skipped (its forward poisoned), six steps.
  auto run_six = [&](bool split) {
    auto model = std::make_shared<Wrapped>(make_model(config), /*poison_from=*/2);
    auto trainer =
        std::make_unique<Trainer>(TrainerSetup::from_config(config), model, make_datasets(config));
    std::vector<double> losses;
    int unused = 0;
    for (int k = 0; k < 6; ++k) {
      if (k == 2) model->stop_poisoning();  // only step 2 is non-finite
      if (split && k == 3) {
        TrainState saved = deep_copy(trainer->state());
        unused += model->unused();
        trainer.reset();
        model = std::make_shared<Wrapped>(make_model(config));
        trainer = std::make_unique<Trainer>(TrainerSetup::from_config(config), model,
                                            make_datasets(config));
        trainer->load_state(saved);
      }
      losses.push_back(trainer->train_step(true).loss);
    }
    unused += model->unused();
    TrainState state = trainer->state();
    return std::make_tuple(losses, cloned(state.model), cloned(state.optimizer),
                           trainer->skipped_steps(), unused);
  };
  const auto [losses_a, model_a, optim_a, skipped_a, unused_a] = run_six(false);
  const auto [losses_b, model_b, optim_b, skipped_b, unused_b] = run_six(true);
  EXPECT_EQ(skipped_a, 1);
  EXPECT_EQ(skipped_b, 1);
  ASSERT_EQ(losses_a.size(), losses_b.size());
  for (size_t k = 0; k < losses_a.size(); ++k) {
    if (k == 1) continue;  // NaN at the skipped step
    EXPECT_EQ(losses_a[k], losses_b[k]) << "step " << k + 1;
  }
  expect_bitwise_equal(model_a, model_b, "model");
  expect_bitwise_equal(optim_a, optim_b, "optimizer");
  // The extra parameter's own step count: the steps where it had a gradient and that were not
  // skipped. Fewer than the 5 updates when some micro-batch left it without a gradient.
  double extra_steps = -1;
  for (const auto& [name, t] : optim_a) {
    if (name == "extra.step") extra_steps = t.item<double>();
  }
  EXPECT_GE(unused_a, 1) << "the data never left the extra parameter without a gradient";
  EXPECT_LT(extra_steps, 5.0);
  EXPECT_GE(extra_steps, 1.0);
}

}  // namespace
}  // namespace kiln::testing
