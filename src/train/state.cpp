// The training state as one value: Trainer::state() and Trainer::load_state().
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/cuda.h>

#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/train.h"
#include "train/precision.h"

namespace kiln {
namespace {

std::vector<std::pair<std::string, at::Generator>> generators() {
  std::vector<std::pair<std::string, at::Generator>> out = {
      {"cpu", at::detail::getDefaultCPUGenerator()}};
  const int devices =
      torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  for (int d = 0; d < devices; ++d) {
    out.emplace_back("cuda-" + std::to_string(d),
                     at::globalContext().defaultGenerator(
                         at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d))));
  }
  return out;
}

}  // namespace

TrainState Trainer::state() {
  StepStats now;
  now.step = step_;
  sync_counters(&now, torch::zeros({3}, nonfinite_since_sync_.options()));
  TrainState state;
  state.step = step_;
  state.skipped_steps = skipped_steps_;
  state.optimizer_steps = optimizer_->steps_taken();
  state.loader = loader_->position();
  state.batch_size = loader_->options().batch_size;
  state.world_size = options_.world_size;
  state.batches_per_epoch = loader_->sampler().batches_per_epoch();
  layout_->add_state(*model_, optimizer_->state(), state);
  for (auto& entry : optimizer_->step_counts()) state.optimizer.push_back(std::move(entry));
  for (auto& [name, generator] : generators()) {
    std::lock_guard lock(generator.mutex());
    state.rng.emplace_back(name, generator.get_state());
  }
  const OptimOptions& o = optimizer_->options();
  state.lr_schedule = {{"kind", "function of the step (kiln::learning_rate)"},
                       {"schedule", o.cosine ? "cosine" : "constant"},
                       {"peak_lr", o.lr},
                       {"warmup_steps", o.warmup_steps},
                       {"min_lr_ratio", o.min_lr_ratio},
                       {"total_steps", train_options_.steps},
                       {"next_lr", learning_rate(o, train_options_.steps, step_)}};
  state.grad_scaler = precision_->state();
  return state;
}

void Trainer::load_state(const TrainState& state) {
  torch::NoGradGuard no_grad;
  // Check everything before changing anything.
  const TrainState live = this->state();
  auto check = [](const NamedTensors& given, const NamedTensors& mine, const char* what) {
    if (given.size() != mine.size()) {
      throw UserError(
          fmt::format("{} state has {} tensors, this trainer {} (another model or "
                      "optimizer config?)",
                      what, given.size(), mine.size()));
    }
    for (size_t k = 0; k < given.size(); ++k) {
      if (given[k].first != mine[k].first ||
          !given[k].second.sizes().equals(mine[k].second.sizes())) {
        throw UserError(fmt::format("{} state tensor {} {} does not match {} {}", what,
                                    given[k].first, shape_text(given[k].second.sizes().vec()),
                                    mine[k].first, shape_text(mine[k].second.sizes().vec())));
      }
    }
  };
  check(state.model, live.model, "model");
  check(state.optimizer, live.optimizer, "optimizer");
  if (state.world_size != options_.world_size ||
      state.batch_size != loader_->options().batch_size) {
    throw UserError(fmt::format(
        "loader position counts batches of {} x {} ranks; this trainer has {} x {} (convert it)",
        state.batch_size, state.world_size, loader_->options().batch_size, options_.world_size));
  }
  auto copy_into = [](const NamedTensors& from, const NamedTensors& to) {
    for (size_t k = 0; k < from.size(); ++k) {
      if (!to[k].second.is_same(from[k].second)) to[k].second.copy_(from[k].second);
    }
  };
  copy_into(state.model, live.model);
  copy_into(state.optimizer, live.optimizer);  // moments, then each parameter's step count
  optimizer_->set_steps_taken(state.optimizer_steps);
  precision_->load_state(state.grad_scaler);
  step_ = state.step;
  device_step_number_.fill_(static_cast<double>(state.step));
  skipped_steps_ = state.skipped_steps;
  loader_->seek(state.loader);
  for (auto& [name, generator] : generators()) {
    for (const auto& [saved_name, tensor] : state.rng) {
      if (saved_name != name) continue;
      std::lock_guard lock(generator.mutex());
      generator.set_state(tensor);
    }
  }
}

}  // namespace kiln
