// train.precision (bf16-mixed, fp16-mixed with its loss scaler) and train.activation_checkpointing
// in the step loop. bf16 on this AVX2-only CPU is several times slower than fp32, so the GPT runs
// here are a 2-layer, 64-wide GPT tiny at seq 16 or 32 (gpt_config); the peer test against
// torch.autocast is tests/peer's peer.gpt_bf16_mixed_matches_pytorch_autocast.
#include "train/precision.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <set>

#include "ckpt/ckpt_helpers.h"
#include "kiln/checkpoint.h"
#include "kiln/error.h"
#include "kiln/memory.h"
#include "kiln/run.h"
#include "kiln/session.h"
#include "support/compose.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Trainer> make_trainer(const Config& config) {
  apply_runtime_settings(config);
  auto trainer = std::make_unique<Trainer>(TrainerSetup::from_config(config), make_model(config),
                                           make_datasets(config));
  install_configured_checkpointing(*trainer);
  return trainer;
}

std::vector<torch::Tensor> gradients(Trainer& trainer) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, p] : trainer.optimizer().parameters()) out.push_back(p.grad().clone());
  return out;
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// ---- options
// -------------------------------------------------------------------------------------

TEST(Precision, OptionsParseAndUnknownValuesAreRefused) {
  TempDir dir;
  Config config = mlp_config(
      dir.path(), {"train.precision=bf16-mixed", "train.activation_checkpointing=block"});
  const TrainOptions o = TrainOptions::from_config(config);
  EXPECT_EQ(o.precision, TrainOptions::Precision::kBf16Mixed);
  EXPECT_EQ(o.activation_checkpointing, TrainOptions::ActivationCheckpointing::kBlock);
  EXPECT_STREQ(precision_name(TrainOptions::Precision::kFp16Mixed), "fp16-mixed");
  EXPECT_EQ(TrainOptions::from_config(mlp_config(dir.path())).precision,
            TrainOptions::Precision::kFp32);
  EXPECT_THROW(mlp_config(dir.path(), {"train.precision=bf16"}), UserError);
}

// ---- bf16-mixed
// ----------------------------------------------------------------------------------

// A model-level probe: the model the Trainer trains, around the built one, recording the dtype of
// the activations the training forward hands back (the logits, lm_head's matmul: bf16 under
// autocast) and of the loss (cross-entropy: fp32 under autocast).
class ForwardDtypeProbe final : public Model {
 public:
  explicit ForwardDtypeProbe(std::shared_ptr<Model> inner)
      : inner_(register_module("inner", std::move(inner))) {}
  torch::Tensor forward(const torch::Tensor& inputs) override {
    torch::Tensor logits = inner_->forward(inputs);
    if (is_training()) logits_dtypes.insert(logits.scalar_type());
    return logits;
  }
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const override {
    torch::Tensor loss = inner_->loss(logits, targets);
    loss_dtypes.insert(loss.scalar_type());
    return loss;
  }
  std::string architecture() const override { return inner_->architecture(); }
  nlohmann::json describe() const override { return inner_->describe(); }
  double train_flops_per_sample(int64_t seq_len) const override {
    return inner_->train_flops_per_sample(seq_len);
  }
  std::set<c10::ScalarType> logits_dtypes;
  mutable std::set<c10::ScalarType> loss_dtypes;

 private:
  std::shared_ptr<Model> inner_;
};

// The bf16 run is proven by the probe (its training forwards produced bf16 logits; fp32's
// float); the loss stays within 2% of fp32's after 50 steps.
TEST(Precision, Bf16MixedTrainsGptTinyWithin2PercentOfFp32AndKeepsFp32State) {
  TempDir dir;
  std::vector<double> final_loss;
  for (const char* precision : {"fp32", "bf16-mixed"}) {
    Config config =
        gpt_config(dir.path(), {"model.preset=tiny", "train.steps=50", "data.seq_len=16",
                                fmt::format("train.precision={}", precision)});
    apply_runtime_settings(config);
    auto probe = std::make_shared<ForwardDtypeProbe>(make_model(config));
    auto trainer =
        std::make_unique<Trainer>(TrainerSetup::from_config(config), probe, make_datasets(config));
    install_configured_checkpointing(*trainer);
    StepStats last;
    for (int k = 0; k < 50; ++k) last = trainer->train_step();
    ASSERT_TRUE(std::isfinite(last.loss));
    final_loss.push_back(last.loss);
    const bool bf16 = std::string(precision) == "bf16-mixed";
    EXPECT_EQ(probe->logits_dtypes,
              std::set<c10::ScalarType>{bf16 ? torch::kBFloat16 : torch::kFloat})
        << precision;
    EXPECT_EQ(probe->loss_dtypes, std::set<c10::ScalarType>{torch::kFloat}) << precision;
    for (const auto& [name, p] : trainer->optimizer().parameters()) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat) << name;
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat) << name;
    }
    for (const auto& [name, t] : trainer->optimizer().state()) {
      EXPECT_EQ(t.scalar_type(), torch::kFloat) << name;
    }
  }
  std::cout << "final loss fp32 " << final_loss[0] << ", bf16-mixed " << final_loss[1] << "\n";
  EXPECT_LT(final_loss[0], 4.0);  // it learned (ln 256 = 5.5 at the start)
  EXPECT_NEAR(final_loss[1], final_loss[0], 0.02 * final_loss[0]);
}

TEST(Precision, AutocastRunsTheGptInBf16AndTheLossInFp32) {
  TempDir dir;
  Config config = gpt_config(dir.path());
  auto model = make_model(config);
  const auto idx = torch::randint(0, 256, {2, 8}, torch::kLong);
  {
    AutocastGuard autocast(AutocastState{c10::DeviceType::CPU, true, torch::kBFloat16, true});
    const auto logits = model->forward(idx);
    EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(model->loss(logits, idx).scalar_type(), torch::kFloat);  // cross-entropy: fp32
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  EXPECT_EQ(model->forward(idx).scalar_type(), torch::kFloat);
  EXPECT_EQ(compute_dtype(TrainOptions::Precision::kFp16Mixed), torch::kHalf);
}

TEST(Precision, Bf16MixedChangesTheStepNotTheStateOrTheAutocastOutsideIt) {
  TempDir dir;
  Config config = gpt_config(dir.path(), {"train.precision=bf16-mixed"});
  auto trainer = make_trainer(config);
  const auto before = trainer->model().parameters()[0].clone();
  // Autocast is on for the forward only: it is off again after a step.
  StepStats stats = trainer->train_step();
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  EXPECT_TRUE(std::isfinite(stats.loss));
  EXPECT_FALSE(torch::equal(before, trainer->model().parameters()[0]));
  // The same step in fp32 gives a different (but close) loss: bf16 really ran.
  auto fp32 = make_trainer(gpt_config(dir.path()));
  const double fp32_loss = fp32->train_step().loss;
  EXPECT_NE(stats.loss, fp32_loss);
  EXPECT_NEAR(stats.loss, fp32_loss, 1e-2 * fp32_loss);
  EXPECT_TRUE(trainer->state().grad_scaler.is_null());  // no loss scaler under bf16
}

// A checkpoint under bf16-mixed holds fp32 parameters and optimizer state, and a fresh process
// resuming from it continues bitwise.
TEST(Precision, Bf16MixedCheckpointsKeepFp32ParametersAndResumeBitwise) {
  TempDir dir;
  const std::vector<std::string> common = {"train.steps=6", "train.precision=bf16-mixed",
                                           "data.num_workers=0", "train.batch_size=32"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  KilnProcess straight(mlp_train_args(dir.path(), "straight", with({"checkpoint.every_steps=3"})),
                       dir / "a.log");
  ASSERT_EQ(straight.wait(), 0) << slurp(dir / "a.log");
  const auto step3 = dir / "straight" / "checkpoints" / "step-3";
  for (const auto& [name, tensor] : read_checkpoint_tensors(step3, "model/", true)) {
    EXPECT_EQ(tensor.scalar_type(), torch::kFloat) << name;
  }
  for (const auto& [name, tensor] : read_checkpoint_tensors(step3, "optim/", true)) {
    EXPECT_EQ(tensor.scalar_type(), torch::kFloat) << name;
  }
  auto args = mlp_train_args(dir.path(), "resumed", with({"checkpoint.every_steps=6"}));
  args.insert(args.end(), {"--resume", step3.string()});
  KilnProcess resumed(args, dir / "b.log");
  ASSERT_EQ(resumed.wait(), 0) << slurp(dir / "b.log");
  const auto a = read_step_losses(dir / "straight" / "metrics.jsonl");
  const auto b = read_step_losses(dir / "resumed" / "metrics.jsonl");
  ASSERT_EQ(b.size(), 3u);
  for (const auto& [step, loss] : b) EXPECT_EQ(loss, a.at(step)) << "step " << step;
  const auto end_a = read_checkpoint_tensors(dir / "straight" / "checkpoints" / "step-6", "", true);
  const auto end_b = read_checkpoint_tensors(dir / "resumed" / "checkpoints" / "step-6", "", true);
  ASSERT_EQ(end_a.size(), end_b.size());
  for (size_t k = 0; k < end_a.size(); ++k) {
    EXPECT_TRUE(bitwise_equal(end_a[k].second, end_b[k].second)) << end_a[k].first;
  }
}

// ---- fp16-mixed and the loss scaler
// --------------------------------------------------------------

// Sets one gradient element to +inf at a chosen step, after backward (an fp16 overflow).
class InjectOverflow final : public TrainerHook {
 public:
  explicit InjectOverflow(int64_t at_step) : at_step_(at_step) {}
  void on_step_begin(Trainer&, int64_t step) override { step_ = step + 1; }
  void on_gradients_ready(Trainer& trainer) override {
    if (step_ != at_step_) return;
    trainer.optimizer().parameters()[0].second.grad().view({-1})[0].fill_(
        std::numeric_limits<float>::infinity());
  }

 private:
  int64_t at_step_, step_ = 0;
};

TEST(Precision, Fp16MixedSkipsAnOverflowedStepBacksOffAndTheStateRoundTrips) {
  TempDir dir;
  // train.nonfinite stays "abort": a scaler overflow is a skip, not a failure.
  Config config = mlp_config(dir.path(), {"train.precision=fp16-mixed"});
  auto trainer = make_trainer(config);
  trainer->add_hook(std::make_shared<InjectOverflow>(3));
  const nlohmann::json initial = trainer->state().grad_scaler;
  ASSERT_TRUE(initial.is_object());
  EXPECT_EQ(initial["scale"], 65536.0);
  EXPECT_EQ(initial["growth_interval"], 2000);
  for (int k = 0; k < 2; ++k) trainer->train_step();
  const nlohmann::json before = trainer->state().grad_scaler;
  const int64_t skipped_before = trainer->skipped_steps();
  std::vector<torch::Tensor> params_before;
  for (const auto& p : trainer->model().parameters()) params_before.push_back(p.clone());

  const StepStats overflowed = trainer->train_step();
  EXPECT_TRUE(overflowed.skipped);
  EXPECT_TRUE(std::isfinite(overflowed.loss));
  EXPECT_EQ(trainer->skipped_steps(), skipped_before + 1);
  const nlohmann::json after = trainer->state().grad_scaler;
  EXPECT_EQ(after["scale"].get<double>(), before["scale"].get<double>() * 0.5);  // backed off
  EXPECT_EQ(after["growth_tracker"], 0);
  EXPECT_EQ(after["overflow_steps"], before["overflow_steps"].get<int64_t>() + 1);
  for (size_t k = 0; k < params_before.size(); ++k) {  // the skipped step changed nothing
    EXPECT_TRUE(torch::equal(params_before[k], trainer->model().parameters()[k])) << k;
  }
  const StepStats next = trainer->train_step();
  EXPECT_FALSE(next.skipped);
  EXPECT_EQ(trainer->state().grad_scaler["growth_tracker"], 1);

  // The scaler's state goes with the training state: a fresh trainer continues identically.
  auto fresh = make_trainer(config);
  fresh->load_state(trainer->state());
  EXPECT_EQ(fresh->state().grad_scaler, trainer->state().grad_scaler);
  EXPECT_EQ(fresh->skipped_steps(), trainer->skipped_steps());
  for (int k = 0; k < 3; ++k) EXPECT_EQ(fresh->train_step().loss, trainer->train_step().loss);
}

TEST(Precision, Fp16MixedScalerStateRoundTripsThroughACheckpoint) {
  TempDir dir;
  const std::vector<std::string> common = {"train.steps=6", "train.precision=fp16-mixed",
                                           "data.num_workers=0", "train.batch_size=32"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  KilnProcess straight(mlp_train_args(dir.path(), "straight", with({"checkpoint.every_steps=3"})),
                       dir / "a.log");
  ASSERT_EQ(straight.wait(), 0) << slurp(dir / "a.log");
  const auto step3 = dir / "straight" / "checkpoints" / "step-3";
  const nlohmann::json saved = read_checkpoint_index(step3).training_state["grad_scaler"];
  ASSERT_TRUE(saved.is_object()) << saved.dump();
  EXPECT_GT(saved["scale"].get<double>(), 0);
  auto args = mlp_train_args(dir.path(), "resumed", with({"checkpoint.every_steps=6"}));
  args.insert(args.end(), {"--resume", step3.string()});
  KilnProcess resumed(args, dir / "b.log");
  ASSERT_EQ(resumed.wait(), 0) << slurp(dir / "b.log");
  const auto a = read_step_losses(dir / "straight" / "metrics.jsonl");
  const auto b = read_step_losses(dir / "resumed" / "metrics.jsonl");
  for (const auto& [step, loss] : b) EXPECT_EQ(loss, a.at(step)) << "step " << step;
  EXPECT_EQ(read_checkpoint_index(dir / "resumed" / "checkpoints" / "step-6")
                .training_state["grad_scaler"],
            read_checkpoint_index(dir / "straight" / "checkpoints" / "step-6")
                .training_state["grad_scaler"]);
}

// ---- activation checkpointing
// --------------------------------------------------------------------

void expect_checkpointing_is_bitwise(const std::vector<std::string>& extra, int steps) {
  TempDir dir;
  auto with = [&](const char* mode) {
    std::vector<std::string> out = extra;
    out.push_back(fmt::format("train.activation_checkpointing={}", mode));
    return out;
  };
  const bool gpt = std::find(extra.begin(), extra.end(), "model.name=mlp") == extra.end();
  auto config_for = [&](const char* mode) {
    return gpt ? gpt_config(dir.path(), with(mode)) : mlp_config(dir.path(), with(mode));
  };
  auto plain = make_trainer(config_for("none"));
  auto recomputed = make_trainer(config_for("block"));
  EXPECT_FALSE(plain->model().has_unit_wrappers());
  EXPECT_TRUE(recomputed->model().has_unit_wrappers());
  for (int k = 0; k < steps; ++k) {
    const StepStats a = plain->train_step();
    const StepStats b = recomputed->train_step();
    EXPECT_EQ(a.loss, b.loss) << "step " << k + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << k + 1;
    const auto ga = gradients(*plain), gb = gradients(*recomputed);
    ASSERT_EQ(ga.size(), gb.size());
    for (size_t i = 0; i < ga.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(ga[i], gb[i]))
          << "step " << k + 1 << " " << plain->optimizer().parameters()[i].first;
    }
  }
  EXPECT_EQ(plain->evaluate().loss, recomputed->evaluate().loss);
}

TEST(ActivationCheckpointing, GptLossesAndGradientsAreBitwiseThoseWithout) {
  expect_checkpointing_is_bitwise({"train.grad_accum_steps=2", "train.batch_size=4"}, 10);
}

TEST(ActivationCheckpointing, MlpFirstLayerWithoutInputGradientStillTrainsBitwise) {
  expect_checkpointing_is_bitwise({"model.name=mlp"}, 5);
}

TEST(ActivationCheckpointing, RecomputesUnderTheForwardsAutocastState) {
  expect_checkpointing_is_bitwise(
      {"train.precision=bf16-mixed", "data.seq_len=16", "train.batch_size=4"}, 2);
}

// gpt small at seq 256, micro-batch 8: the peak of live tensor bytes in a step (plain SGD: no
// optimizer state is created inside the measured step, so the peak is activations and gradients).
TEST(ActivationCheckpointing, StepPeakMemoryIsAtMost70PercentOfWithout) {
  TempDir dir;
  std::vector<int64_t> peaks;
  for (const char* mode : {"none", "block"}) {
    Config config =
        gpt_config(dir.path(),
                   {"model.preset=small", "model.n_layer=0", "model.n_embd=0", "model.n_head=0",
                    "data.seq_len=256", "train.batch_size=8", "data.num_workers=0", "run.threads=2",
                    "optim.name=sgd", fmt::format("train.activation_checkpointing={}", mode)});
    auto trainer = make_trainer(config);
    MemoryMeter meter;
    trainer->train_step();
    meter.stop();
    peaks.push_back(meter.peak_bytes());
  }
  const double ratio = static_cast<double>(peaks[1]) / static_cast<double>(peaks[0]);
  std::cout << "step peak: none " << peaks[0] << " B, block " << peaks[1] << " B, ratio " << ratio
            << "\n";
  EXPECT_GT(peaks[1], 0);
  EXPECT_LE(ratio, 0.7);
}

}  // namespace
}  // namespace kiln::testing
