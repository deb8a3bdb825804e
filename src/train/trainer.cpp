#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "core/clock.h"
#include "core/strings.h"
#include "kiln/comm.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/run.h"
#include "kiln/train.h"
#include "train/step_record.h"

namespace kiln {
namespace {

using Clock = SteadyClock;

// Progress: a bar with rate and ETA on a terminal, a log line every run.log_every steps otherwise.
class Progress {
 public:
  Progress(const Config& config, int64_t total, int rank)
      : total_(total), every_(config.get_int("run.log_every")) {
    const std::string& mode = config.get_string("run.progress");
    bar_ = rank == 0 && (mode == "bar" || (mode == "auto" && log::stderr_is_terminal()));
    off_ = mode == "off";
  }
  void update(const StepStats& s, double elapsed, int64_t first_step) {
    if (off_) return;
    const int64_t done = s.step - first_step;
    const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
    const double eta = rate > 0 ? static_cast<double>(total_ - s.step) / rate : 0;
    const double throughput = s.tokens > 0 ? static_cast<double>(s.tokens) / s.step_seconds
                                           : static_cast<double>(s.samples) / s.step_seconds;
    const char* unit = s.tokens > 0 ? "tok/s" : "samples/s";
    if (bar_) {
      const int width = 24;
      const int filled =
          static_cast<int>(width * static_cast<double>(s.step) / static_cast<double>(total_));
      log::status(fmt::format("[{}{}] {}/{} loss {:.4f} | {:.1f} it/s {:.0f} {} | ETA {}",
                              std::string(filled, '#'), std::string(width - filled, '.'), s.step,
                              total_, s.loss, rate, throughput, unit, format_duration(eta)));
    } else if (s.step % every_ == 0 || s.step == total_) {
      log::info(fmt::format(
          "step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} {:.1f} ms/step {:.0f} {} ETA {}",
          s.step, total_, s.loss, s.lr, s.grad_norm, 1e3 * s.step_seconds, throughput, unit,
          format_duration(eta)));
    }
  }
  void finish() {
    if (bar_) log::finish_status();
  }

 private:
  int64_t total_, every_;
  bool bar_ = false, off_ = false;
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

void apply_runtime_settings(const Config& config) {
  if (int64_t threads = config.get_int("run.threads"); threads > 0) {
    at::set_num_threads(static_cast<int>(threads));
  }
  if (config.get_bool("run.deterministic")) {
    // cuBLAS needs a fixed workspace for deterministic results; set before CUDA initialises.
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  torch::manual_seed(static_cast<uint64_t>(config.get_int("run.seed")));
}

torch::Device resolve_device(const Config& config) {
  const std::string& device = config.get_string("run.device");
  const bool cuda = torch::cuda::is_available();
  if (device == "cuda" && !cuda) {
#ifdef KILN_WITH_CUDA
    const char* build = "a CUDA LibTorch, but the driver reports no device";
#else
    const char* build = "a CPU-only LibTorch";
#endif
    throw UserError(
        std::string("run.device = \"cuda\" but no CUDA device is available (kiln is built "
                    "with ") +
        build + "); set run.device = \"cpu\"");
  }
  if (device == "cuda" || (device == "auto" && cuda)) return torch::Device(torch::kCUDA, 0);
  return torch::kCPU;
}

Trainer::Trainer(const Config& config, std::shared_ptr<Model> model, Datasets data,
                 TrainerOptions options)
    : config_(std::make_unique<Config>(config)),
      model_(std::move(model)),
      data_(std::move(data)),
      options_(options) {
  model_->to(options_.device);
  NamedTensors params;
  for (auto& item : model_->named_parameters()) params.emplace_back(item.key(), item.value());
  optimizer_ = std::make_unique<Optimizer>(config, std::move(params));
  LoaderOptions loader_options;
  loader_options.batch_size = config.get_int("train.batch_size");
  loader_options.num_workers = static_cast<int>(config.get_int("data.num_workers"));
  loader_options.prefetch = static_cast<int>(config.get_int("data.prefetch"));
  loader_options.shuffle = config.get_bool("data.shuffle");
  loader_options.seed = data_seed(config);
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
}

Trainer::~Trainer() = default;

void Trainer::add_hook(std::shared_ptr<TrainerHook> hook) {
  hooks_.push_back(std::move(hook));
}

void Trainer::phase_begin(Phase phase) {
  for (auto& hook : hooks_) hook->on_phase_begin(*this, phase);
}

void Trainer::phase_end(Phase phase) {
  for (auto& hook : hooks_) hook->on_phase_end(*this, phase);
}

StepStats Trainer::train_step() {
  return run_step(static_cast<int>(config_->get_int("train.grad_accum_steps")), [this](int) {
    phase_begin(Phase::kDataWait);
    Batch batch = loader_->next();
    phase_end(Phase::kDataWait);
    return batch;
  });
}

StepStats Trainer::train_step_on(const std::vector<Batch>& micro_batches) {
  return run_step(static_cast<int>(micro_batches.size()), [&](int micro) {
    const Batch& batch = micro_batches[static_cast<size_t>(micro)];
    return Batch{batch.inputs.to(options_.device), batch.targets.to(options_.device)};
  });
}

StepStats Trainer::run_step(int accum, const std::function<Batch(int)>& next_batch) {
  const auto begin = Clock::now();
  for (auto& hook : hooks_) hook->on_step_begin(*this, step_);
  model_->train();
  optimizer_->zero_grad();
  StepStats stats;
  stats.step = step_ + 1;
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(options_.device));
  for (int micro = 0; micro < accum; ++micro) {
    const bool last = micro == accum - 1;
    for (auto& hook : hooks_) hook->on_micro_step_begin(*this, micro, last);
    const auto wait_begin = Clock::now();
    Batch batch = next_batch(micro);
    stats.data_wait_seconds += seconds_since(wait_begin);
    stats.samples += batch.samples();
    stats.tokens += data_.train->tokens_per_sample() * batch.samples();

    phase_begin(Phase::kForward);
    auto logits = model_->forward(batch.inputs);
    auto loss = model_->loss(logits, batch.targets) / static_cast<double>(accum);
    phase_end(Phase::kForward);

    phase_begin(Phase::kBackward);
    loss.backward();
    phase_end(Phase::kBackward);
    loss_sum += loss.detach();
  }
  for (auto& hook : hooks_) hook->on_gradients_ready(*this);
  if (options_.comm && options_.comm->world_size() > 1) {  // the logged loss: mean over every rank
    phase_begin(Phase::kComm);
    options_.comm->all_reduce_sum(loss_sum);
    loss_sum /= static_cast<double>(options_.comm->world_size());
    phase_end(Phase::kComm);
  }
  stats.samples *= options_.world_size;
  stats.tokens *= options_.world_size;

  // Global gradient norm (as torch.nn.utils.clip_grad_norm_), then clip in place.
  phase_begin(Phase::kOptimizer);
  std::vector<torch::Tensor> grads;
  for (auto& [name, p] : optimizer_->parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  auto norms = at::_foreach_norm(grads, 2);
  auto total_norm = at::linalg_vector_norm(at::stack(norms), 2);
  const double max_norm = config_->get_float("train.clip_grad_norm");
  if (max_norm > 0) {
    auto coef = at::clamp_max(max_norm / (total_norm + 1e-6), 1.0);
    at::_foreach_mul_(grads, coef);
  }
  stats.loss = loss_sum.item<double>();
  stats.grad_norm = total_norm.item<double>();
  stats.lr = learning_rate(*config_, step_);

  if (!std::isfinite(stats.loss) || !std::isfinite(stats.grad_norm)) {
    const std::string what = fmt::format("non-finite {} at step {} (loss {}, grad norm {})",
                                         std::isfinite(stats.loss) ? "gradient" : "loss",
                                         stats.step, stats.loss, stats.grad_norm);
    if (config_->get_string("train.nonfinite") == "abort") {
      phase_end(Phase::kOptimizer);
      throw TrainingError(what +
                          "; lower optim.lr, enable train.clip_grad_norm, or set "
                          "train.nonfinite = \"skip\"");
    }
    ++skipped_steps_;
    if (skipped_steps_ > config_->get_int("train.max_skipped_steps")) {
      phase_end(Phase::kOptimizer);
      throw TrainingError(what + "; " + std::to_string(skipped_steps_) +
                          " steps skipped, more than train.max_skipped_steps; lower optim.lr");
    }
    log::warn(what + "; step skipped (train.nonfinite = \"skip\")");
    optimizer_->zero_grad();
    stats.skipped = true;
  } else {
    optimizer_->step(stats.lr);
  }
  phase_end(Phase::kOptimizer);
  ++step_;
  stats.step_seconds = seconds_since(begin);
  for (auto& hook : hooks_) hook->on_step_end(*this, stats);
  return stats;
}

EvalStats Trainer::evaluate() {
  phase_begin(Phase::kEval);
  torch::NoGradGuard no_grad;
  model_->eval();
  int64_t batches =
      std::min(config_->get_int("train.eval_batches"), val_sampler_->batches_per_epoch());
  double loss_sum = 0;
  int64_t correct = 0, samples = 0;
  for (int64_t b = 0; b < batches; ++b) {
    Batch batch = data_.val->get(val_sampler_->indices(0, b));
    auto inputs = batch.inputs.to(options_.device);
    auto targets = batch.targets.to(options_.device);
    auto logits = model_->forward(inputs);
    loss_sum += model_->loss(logits, targets).item<double>();
    if (logits.dim() == 2) correct += logits.argmax(1).eq(targets).sum().item<int64_t>();
    samples += batch.samples();
  }
  model_->train();
  if (options_.comm && options_.comm->world_size() > 1) {  // every rank evaluated its own shard
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
  phase_end(Phase::kEval);
  EvalStats out;
  out.loss = loss_sum / static_cast<double>(batches);
  out.samples = samples;
  if (data_.train->tokens_per_sample() == 0) {
    out.accuracy = static_cast<double>(correct) / static_cast<double>(samples);
  }
  return out;
}

TrainSummary Trainer::fit(int64_t total_steps, Run* run) {
  for (auto& hook : hooks_) hook->on_train_begin(*this);
  const int64_t eval_every = config_->get_int("train.eval_every");
  Progress progress(*config_, total_steps, options_.rank);
  TrainSummary summary;
  const int64_t first_step = step_;
  const auto begin = Clock::now();
  int64_t samples = 0, tokens = 0;
  auto log_eval = [&](const EvalStats& eval) {
    std::string line = fmt::format("eval at step {}: val_loss {:.4f}", step_, eval.loss);
    if (eval.accuracy >= 0) line += fmt::format(" val_accuracy {:.2f}%", 100 * eval.accuracy);
    log::info(line);
    if (run) {
      nlohmann::json record = {{"step", step_}, {"val_loss", eval.loss}};
      if (eval.accuracy >= 0) record["val_accuracy"] = eval.accuracy;
      run->append_metrics(record);
    }
  };
  try {
    while (step_ < total_steps) {
      StepStats s = train_step();
      if (summary.steps == 0) summary.first_loss = s.loss;
      summary.last_loss = s.loss;
      ++summary.steps;
      samples += s.samples;
      tokens += s.tokens;
      if (run) {
        run->append_metrics(step_record(s));
      }
      progress.update(s, seconds_since(begin), first_step);
      if (eval_every > 0 && step_ % eval_every == 0 && step_ < total_steps) {
        progress.finish();
        log_eval(evaluate());
      }
    }
  } catch (...) {
    progress.finish();
    throw;
  }
  progress.finish();
  summary.seconds = seconds_since(begin);
  summary.final_eval = evaluate();
  log_eval(summary.final_eval);
  summary.samples_per_second = static_cast<double>(samples) / summary.seconds;
  summary.tokens_per_second = static_cast<double>(tokens) / summary.seconds;
  summary.skipped_steps = skipped_steps_;
  for (auto& hook : hooks_) hook->on_train_end(*this);
  return summary;
}

}  // namespace kiln
