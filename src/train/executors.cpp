// The eager step executor, the direct step runner, and CapturedStep's fetch-then-run.
#include "train/executors.h"

#include <cmath>

#include "train/precision.h"

namespace kiln {
namespace {

class EagerExecutor final : public StepExecutor {
 public:
  EagerExecutor(Model& model, const MixedPrecision& precision)
      : model_(model), precision_(precision) {}

  torch::Tensor forward_backward(Trainer& trainer, const Batch& batch, double scale,
                                 const torch::Tensor& /*loss_scale: precision_'s own*/) override {
    return autograd_micro_step(
        trainer, precision_.precision(), precision_.device().type(), scale, precision_.loss_scale(),
        [&] { return model_.loss(model_.forward(batch.inputs), batch.targets); });
  }

  EvalOutputs evaluate(const Batch& batch) override {
    const auto autocast = precision_.autocast_scope();  // train.precision
    auto logits = model_.forward(batch.inputs);
    EvalOutputs out;
    out.loss = model_.loss(logits, batch.targets);
    if (model_.classifier()) out.correct = model_.correct_predictions(logits, batch.targets);
    return out;
  }

 private:
  Model& model_;
  const MixedPrecision& precision_;
};

class DirectRunner final : public StepRunner {
 public:
  torch::Tensor run(int /*micro_steps*/, const Fetch& fetch, double /*lr*/,
                    const DeviceWork& work) override {
    return work(fetch);
  }
};

}  // namespace

torch::Tensor autograd_micro_step(Trainer& trainer, TrainOptions::Precision precision,
                                  c10::DeviceType device_type, double scale,
                                  const torch::Tensor& loss_scale,
                                  const std::function<torch::Tensor()>& forward_loss) {
  const double micro_steps = std::round(1.0 / scale);
  torch::Tensor loss;
  {
    PhaseScope phase(trainer, Phase::kForward);
    const auto autocast = precision_autocast(precision, device_type);
    loss = forward_loss() / micro_steps;
  }
  {
    PhaseScope phase(trainer, Phase::kBackward);
    (loss_scale.defined() ? loss * loss_scale.reshape({}) : loss).backward();
  }
  return loss;
}

std::shared_ptr<StepExecutor> make_eager_executor(Model& model, const MixedPrecision& precision) {
  return std::make_shared<EagerExecutor>(model, precision);
}

std::shared_ptr<StepRunner> make_direct_runner() {
  return std::make_shared<DirectRunner>();
}

torch::Tensor CapturedStep::run(int micro_steps, const Fetch& fetch, double lr,
                                const DeviceWork& work) {
  std::vector<Batch> batches;  // fetched first: a replay runs the device work at once
  batches.reserve(static_cast<size_t>(micro_steps));
  for (int micro = 0; micro < micro_steps; ++micro) batches.push_back(fetch(micro));
  return run_captured(batches, lr, [&](const std::vector<Batch>& in) {
    return work([&](int micro) { return in[static_cast<size_t>(micro)]; });
  });
}

}  // namespace kiln
