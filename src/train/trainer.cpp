// The Trainer, top to bottom in the order a step runs: construction (model on the device,
// optimizer, loader), hooks and phases, one step (device work, then the host read-back and the
// non-finite policy), evaluation, and fit(). The state as a value is in state.cpp; the hooks kiln
// adds (progress, metrics) in hooks.cpp; process settings in runtime.cpp.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <exception>

#include "core/clock.h"
#include "core/strings.h"
#include "kiln/comm.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/run.h"
#include "kiln/train.h"
#include "train/activation_checkpointing.h"
#include "train/executors.h"
#include "train/hooks.h"
#include "train/precision.h"

namespace kiln {
namespace {

// Adds a hook to a trainer for one scope (fit's metrics and progress).
class ScopedHooks {
 public:
  ScopedHooks(std::vector<std::shared_ptr<TrainerHook>>& hooks)
      : hooks_(hooks), size_(hooks.size()) {}
  ~ScopedHooks() { hooks_.resize(size_); }

 private:
  std::vector<std::shared_ptr<TrainerHook>>& hooks_;
  size_t size_;
};

}  // namespace

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kDataWait:
      return "data_wait";
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kComm:
      return "comm";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kCheckpoint:
      return "checkpoint";
    case Phase::kEval:
      return "eval";
  }
  return "?";
}

Trainer::Trainer(const TrainerSetup& setup, std::shared_ptr<Model> model, Datasets data,
                 TrainerOptions options)
    : train_options_(setup.train),
      model_(std::move(model)),
      data_(std::move(data)),
      options_(options) {
  model_->to(options_.device);
  precision_ = std::make_unique<MixedPrecision>(train_options_.precision, options_.device);
  eager_ = make_eager_executor(*model_, *precision_);
  executor_ = eager_;
  direct_ = make_direct_runner();
  runner_ = direct_;
  layout_ = replicated_layout();
  optimizer_ = std::make_unique<Optimizer>(setup.optim, layout_->optimizer_parameters(*model_));
  LoaderOptions loader_options = setup.loader;
  loader_options.batch_size = train_options_.batch_size;
  loader_options.rank = options_.rank;
  loader_options.world_size = options_.world_size;
  loader_options.device = options_.device;
  loader_ = std::make_unique<Loader>(data_.train, loader_options);
  try {
    val_sampler_ = std::make_unique<Sampler>(data_.val->size(), loader_options.batch_size,
                                             options_.rank, options_.world_size,
                                             /*shuffle=*/false, 0);
  } catch (const UserError&) {
    throw UserError(
        "the validation split has " + std::to_string(data_.val->size()) +
        " samples, fewer than one global batch (train.batch_size " +
        std::to_string(loader_options.batch_size) + " x " + std::to_string(options_.world_size) +
        " processes); raise data.val_samples (synthetic) or data.val_fraction (text, tokens), "
        "or lower train.batch_size");
  }
  const auto counter = torch::TensorOptions().device(options_.device).dtype(torch::kFloat64);
  nonfinite_since_sync_ = torch::zeros({}, counter);
  first_nonfinite_step_ = torch::zeros({}, counter);
  device_step_number_ = torch::zeros({}, counter);
}

Trainer::~Trainer() = default;

const char* composition_stage_name(CompositionStage stage) {
  switch (stage) {
    case CompositionStage::kActivationCheckpointing:
      return "activation checkpointing";
    case CompositionStage::kTensorParallel:
      return "tensor parallelism";
    case CompositionStage::kParallelLayout:
      return "parallel layout";
    case CompositionStage::kCompilation:
      return "compilation";
    case CompositionStage::kCapture:
      return "capture";
  }
  return "?";
}

void Trainer::enter_composition_stage(CompositionStage stage, const std::string& what) {
  if (stage <= last_stage_) {
    throw std::logic_error(fmt::format(
        "cannot install {} ({}) after {}: a step is composed in the order activation "
        "checkpointing -> tensor parallelism -> parallel layout (DDP/FSDP) -> compilation -> "
        "capture, one piece each "
        "(kiln/job.h compose_training; kiln/train.h CompositionStage says why)",
        what, composition_stage_name(stage),
        composition_.empty() ? std::string("?") : composition_.back()));
  }
  last_stage_ = stage;
  composition_.push_back(what);
}

void install_activation_checkpointing(Trainer& trainer) {
  trainer.enter_composition_stage(CompositionStage::kActivationCheckpointing,
                                  "activation checkpointing (block)");
  Model& model = trainer.model();
  const std::vector<ModelUnit> units = model.units();
  if (units.empty()) {
    log::warn(fmt::format(
        "train.activation_checkpointing = \"block\": model {} has no units, so nothing is "
        "recomputed (an exported package imported with --units none, or without a module list)",
        model.architecture()));
    return;
  }
  model.add_unit_wrapper(make_activation_checkpointing(model, units));
  log::info(fmt::format("activation checkpointing: {} units ({} .. {}) recomputed in backward",
                        units.size(), units.front().name, units.back().name));
}

void Trainer::set_parallel_layout(std::shared_ptr<ParallelLayout> layout) {
  layout_ = std::move(layout);
  optimizer_ =
      std::make_unique<Optimizer>(optimizer_->options(), layout_->optimizer_parameters(*model_));
}

void Trainer::set_step_executor(std::shared_ptr<StepExecutor> executor) {
  executor_ = executor ? std::move(executor) : eager_;
}

void Trainer::set_step_runner(std::shared_ptr<StepRunner> runner) {
  runner_ = runner ? std::move(runner) : direct_;
}

void Trainer::add_hook(std::shared_ptr<TrainerHook> hook) {
  hooks_.push_back(std::move(hook));
}

template <class Call>
void Trainer::for_each_hook(Call call) {
  for (auto& hook : hooks_) call(*hook);
}

void Trainer::phase_begin(Phase phase) {
  size_t begun = 0;
  try {
    for (; begun < hooks_.size(); ++begun) hooks_[begun]->on_phase_begin(*this, phase);
  } catch (...) {  // the hooks that saw the phase open see it closed
    for (size_t k = 0; k < begun; ++k) {
      try {
        hooks_[k]->on_phase_end(*this, phase);
      } catch (...) {
      }
    }
    throw;
  }
}

void Trainer::phase_end(Phase phase) {
  for_each_hook([&](TrainerHook& h) { h.on_phase_end(*this, phase); });
}

PhaseScope::PhaseScope(Trainer& trainer, Phase phase)
    : trainer_(trainer), phase_(phase), uncaught_(std::uncaught_exceptions()) {
  trainer_.phase_begin(phase_);
}

PhaseScope::~PhaseScope() noexcept(false) {
  if (std::uncaught_exceptions() == uncaught_) {
    trainer_.phase_end(phase_);  // may throw: the destructor is noexcept(false)
    return;
  }
  try {  // unwinding: close the phase for every hook, but never throw a second exception
    trainer_.phase_end(phase_);
  } catch (...) {
  }
}

Trainer::PausedData::PausedData(Trainer& trainer) : loader_(*trainer.loader_) {
  loader_.pause_workers();
}

Trainer::PausedData::~PausedData() {
  loader_.resume_workers();
}

int64_t Trainer::batches_per_epoch() const {
  return loader_->sampler().batches_per_epoch();
}

// ---- one step ----------------------------------------------------------------------------------

StepStats Trainer::train_step(bool sync) {
  return run_step(
      train_options_.grad_accum_steps,
      [this](int) {
        PhaseScope phase(*this, Phase::kDataWait);
        return loader_->next();
      },
      sync);
}

StepStats Trainer::train_step_on(const std::vector<Batch>& micro_batches) {
  return run_step(
      static_cast<int>(micro_batches.size()),
      [&](int micro) {
        const Batch& batch = micro_batches[static_cast<size_t>(micro)];
        return Batch{batch.inputs.to(options_.device), batch.targets.to(options_.device)};
      },
      /*sync=*/true);
}

Batch Trainer::next_batch() {
  return loader_->next();
}

void Trainer::run_steps(int64_t count) {
  for (int64_t k = 0; k < count; ++k) train_step(/*sync=*/k == count - 1);
}

StepStats Trainer::run_step(int micro_steps, const std::function<Batch(int)>& next_batch,
                            bool sync) {
  const auto begin = SteadyClock::now();
  StepStats stats;
  stats.step = step_ + 1;
  stats.lr = learning_rate(optimizer_->options(), train_options_.steps, step_);
  for_each_hook([&](TrainerHook& h) { h.on_step_begin(*this, step_); });
  try {
    const StepRunner::Fetch fetch = [&](int micro) {
      const auto wait_begin = SteadyClock::now();
      Batch batch = next_batch(micro);
      stats.data_wait_seconds += seconds_since(wait_begin);
      count_samples(batch, stats);
      return batch;
    };
    const torch::Tensor values = runner_->run(
        micro_steps, fetch, stats.lr,
        [&](const StepRunner::Fetch& batches) { return device_step(micro_steps, batches); });
    if (sync || stats.step % train_options_.metrics_every == 0) sync_counters(&stats, values);
  } catch (...) {
    for_each_hook([&](TrainerHook& h) { h.on_step_failed(*this, stats.step); });
    throw;
  }
  ++step_;
  stats.step_seconds = seconds_since(begin);
  for_each_hook([&](TrainerHook& h) { h.on_step_end(*this, stats); });
  return stats;
}

void Trainer::count_samples(const Batch& batch, StepStats& stats) const {
  stats.samples += batch.samples() * options_.world_size;
  stats.tokens += data_.train->tokens_per_sample() * batch.samples() * options_.world_size;
}

torch::Tensor Trainer::device_step(int micro_steps, const StepRunner::Fetch& fetch) {
  model_->train();
  optimizer_->zero_grad();
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(options_.device));
  const double scale = 1.0 / static_cast<double>(micro_steps);
  for (int micro = 0; micro < micro_steps; ++micro) {
    const bool last = micro == micro_steps - 1;
    for_each_hook([&](TrainerHook& h) { h.on_micro_step_begin(*this, micro, last); });
    const Batch batch = fetch(micro);
    const torch::Tensor& loss_scale = precision_->loss_scale();
    torch::Tensor loss = executor_->forward_backward(*this, batch, scale, loss_scale);
    if (!loss.defined()) loss = eager_->forward_backward(*this, batch, scale, loss_scale);
    loss_sum += loss.detach();
  }
  for_each_hook([&](TrainerHook& h) { h.on_gradients_ready(*this); });
  if (options_.comm && options_.comm->world_size() > 1) {  // the logged loss: mean over ranks
    PhaseScope phase(*this, Phase::kComm);
    options_.comm->all_reduce_sum(loss_sum);
    loss_sum /= static_cast<double>(options_.comm->world_size());
  }

  PhaseScope phase(*this, Phase::kOptimizer);
  // Global gradient norm (as torch.nn.utils.clip_grad_norm_), then clip in place.
  std::vector<torch::Tensor> grads;
  for (auto& [name, p] : optimizer_->parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  // fp16-mixed: unscale in place; an overflow skips the step through the non-finite guard.
  torch::Tensor overflow = precision_->unscale_gradients(grads);
  const torch::Tensor total_norm = layout_->global_gradient_norm(grads, overflow);
  if (train_options_.clip_grad_norm > 0) {
    at::_foreach_mul_(grads,
                      at::clamp_max(train_options_.clip_grad_norm / (total_norm + 1e-6), 1.0));
  }
  // The non-finite guard, on the device: the optimizer update becomes a no-op.
  torch::Tensor finite = at::logical_and(at::isfinite(loss_sum), at::isfinite(total_norm));
  if (overflow.defined()) finite = at::logical_and(finite, overflow == 0);
  const torch::Tensor nonfinite = at::logical_not(finite).to(torch::kFloat);
  // The step's learning rate, as run_step computed it (step_ advances after the step).
  optimizer_->step(learning_rate(optimizer_->options(), train_options_.steps, step_), nonfinite);
  if (overflow.defined()) precision_->update(overflow, loss_sum);  // grow or back off the scale
  // In place, with the step number from the device: a captured step replays these as they are.
  const torch::Tensor counted = nonfinite.to(torch::kFloat64);
  device_step_number_.add_(1.0);
  first_nonfinite_step_.copy_(at::where(at::logical_and(first_nonfinite_step_ == 0, counted > 0),
                                        device_step_number_, first_nonfinite_step_));
  nonfinite_since_sync_.add_(counted);
  return at::stack({loss_sum.to(torch::kFloat64), total_norm.to(torch::kFloat64), counted});
}

void Trainer::sync_counters(StepStats* stats, const torch::Tensor& step_values) {
  // One device-to-host copy for everything the host needs.
  const torch::Tensor host =
      at::cat({step_values, nonfinite_since_sync_.reshape({1}), first_nonfinite_step_.reshape({1}),
               precision_->sync_values()})
          .cpu();
  const double* v = host.const_data_ptr<double>();
  stats->synced = true;
  stats->loss = v[0];
  stats->grad_norm = v[1];
  stats->skipped = v[2] != 0;
  const auto all_nonfinite = static_cast<int64_t>(v[3]);
  if (all_nonfinite == 0) return;
  const auto first = static_cast<int64_t>(v[4]);
  nonfinite_since_sync_.zero_();
  first_nonfinite_step_.zero_();
  precision_->reset_since_sync();
  // fp16-mixed: gradient overflows with a finite loss are the loss scaler's business (it backed
  // off): skipped and counted, whatever train.nonfinite says, and not held against
  // train.max_skipped_steps.
  const auto overflows = static_cast<int64_t>(v[5]);
  if (overflows > 0) {
    skipped_steps_ += overflows;
    precision_->add_overflow_steps(overflows);
    log::info(
        fmt::format("fp16 loss scaler: {} step(s) up to step {} skipped on a gradient "
                    "overflow; loss scale now {}",
                    overflows, stats->step, v[6]));
  }
  const int64_t nonfinite = all_nonfinite - overflows;
  if (nonfinite == 0) return;
  std::string what =
      first == stats->step
          ? fmt::format("non-finite {} at step {} (loss {}, grad norm {})",
                        std::isfinite(stats->loss) ? "gradient" : "loss", first, stats->loss,
                        stats->grad_norm)
          : fmt::format(
                "non-finite loss or gradient at step {} ({} non-finite step(s) since the "
                "last read-back; the read-back at step {} found them)",
                first, nonfinite, stats->step);
  if (train_options_.nonfinite == TrainOptions::NonFinite::kAbort) {
    throw TrainingError(what +
                        "; lower optim.lr, enable train.clip_grad_norm, or set "
                        "train.nonfinite = \"skip\"");
  }
  skipped_steps_ += nonfinite;
  if (skipped_steps_ - precision_->overflow_steps() > train_options_.max_skipped_steps) {
    throw TrainingError(what + "; " +
                        std::to_string(skipped_steps_ - precision_->overflow_steps()) +
                        " steps skipped, more than train.max_skipped_steps; lower optim.lr");
  }
  log::warn(what + "; step skipped (train.nonfinite = \"skip\")");
}

// ---- evaluation and the loop -------------------------------------------------------------------

EvalStats Trainer::evaluate() {
  EvalStats out;
  {
    PhaseScope phase(*this, Phase::kEval);
    torch::NoGradGuard no_grad;
    model_->eval();
    int64_t batches = std::min(train_options_.eval_batches, val_sampler_->batches_per_epoch());
    double loss_sum = 0;
    int64_t correct = 0, samples = 0;
    for (int64_t b = 0; b < batches; ++b) {
      Batch batch = data_.val->get(val_sampler_->indices(0, b));
      auto inputs = batch.inputs.to(options_.device);
      auto targets = batch.targets.to(options_.device);
      samples += batch.samples();
      const Batch on_device{inputs, targets};
      auto out = executor_->evaluate(on_device);
      if (!out.loss.defined() || (model_->classifier() && !out.correct.defined())) {
        out = eager_->evaluate(on_device);  // declined by the executor
      }
      loss_sum += out.loss.item<double>();
      if (model_->classifier()) correct += out.correct.item<int64_t>();
    }
    model_->train();
    if (options_.comm && options_.comm->world_size() > 1) {  // every rank evaluated its shard
      auto totals = torch::tensor({loss_sum, static_cast<double>(correct),
                                   static_cast<double>(samples), static_cast<double>(batches)},
                                  torch::kFloat64)
                        .to(options_.device);
      options_.comm->all_reduce_sum(totals);
      totals = totals.cpu();
      loss_sum = totals[0].item<double>();
      correct = static_cast<int64_t>(totals[1].item<double>());
      samples = static_cast<int64_t>(totals[2].item<double>());
      batches = static_cast<int64_t>(totals[3].item<double>());
    }
    out.loss = loss_sum / static_cast<double>(batches);
    out.samples = samples;
    if (model_->classifier()) {
      out.accuracy = static_cast<double>(correct) / static_cast<double>(samples);
    }
  }
  for_each_hook([&](TrainerHook& h) { h.on_eval(*this, out); });
  return out;
}

TrainSummary Trainer::fit(int64_t total_steps, Run* run) {
  ScopedHooks scoped(hooks_);
  if (run) add_hook(std::make_shared<MetricsHook>(*run));
  auto log = std::make_shared<StepLog>();
  add_hook(log);
  add_hook(make_progress_hook(train_options_, total_steps, options_.rank, step_));
  for_each_hook([&](TrainerHook& h) { h.on_train_begin(*this); });
  const auto begin = SteadyClock::now();
  const int64_t eval_every = train_options_.eval_every;
  while (step_ < total_steps) {
    train_step(/*sync=*/step_ + 1 == total_steps);
    if (eval_every > 0 && step_ % eval_every == 0 && step_ < total_steps) evaluate();
  }
  TrainSummary summary;
  summary.seconds = seconds_since(begin);
  summary.final_eval = evaluate();
  int64_t samples = 0, tokens = 0;
  bool seen_loss = false;
  std::vector<double> finite_losses;
  for (const StepStats& s : log->steps) {
    samples += s.samples;
    tokens += s.tokens;
    if (!s.synced) continue;
    if (!seen_loss) summary.first_loss = s.loss;
    seen_loss = true;
    summary.last_loss = s.loss;
    if (std::isfinite(s.loss)) finite_losses.push_back(s.loss);
  }
  const size_t tail =
      std::min(finite_losses.size(), static_cast<size_t>(TrainSummary::kSummaryLossSteps));
  for (size_t k = finite_losses.size() - tail; k < finite_losses.size(); ++k)
    summary.last_loss_mean += finite_losses[k] / static_cast<double>(tail);
  summary.last_loss_mean_steps = static_cast<int64_t>(tail);
  summary.steps = static_cast<int64_t>(log->steps.size());
  summary.samples_per_second = static_cast<double>(samples) / summary.seconds;
  summary.tokens_per_second = static_cast<double>(tokens) / summary.seconds;
  summary.skipped_steps = skipped_steps_;
  for_each_hook([&](TrainerHook& h) { h.on_train_end(*this); });
  return summary;
}

}  // namespace kiln
