#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <variant>

#include "core/clock.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/plan.h"
#include "kiln/results.h"
#include "kiln/rungs.h"
#include "rungs/device_rate.h"
#include "rungs/options.h"

namespace kiln {
namespace {

using nlohmann::json;

double mean_of(const std::vector<double>& values, size_t first, size_t count) {
  double sum = 0;
  for (size_t k = first; k < first + count; ++k) sum += values[k];
  return sum / static_cast<double>(count);
}

// Writes baseline.json through the result's to_json and returns the rung's outcome, its table
// rendered from the same result.
RungResult finish_baseline(Session& session, const BaselineResult& out) {
  RungResult result;
  result.rung = "baseline";
  result.passed = out.status.passed;
  result.verdict = out.status.verdict;
  result.numbers = out;
  result.table = result_rows(out);
  session.run->write_json("baseline.json", json(out));
  return result;
}

}  // namespace

const RungStatus* RungResult::status() const {
  return std::visit(
      [](const auto& typed) -> const RungStatus* {
        if constexpr (std::is_same_v<std::decay_t<decltype(typed)>, std::monostate>) {
          return nullptr;
        } else {
          return &typed.status;
        }
      },
      numbers);
}

void print_rung(const RungResult& result) {
  size_t width = 0;
  for (const auto& [key, value] : result.table) width = std::max(width, key.size());
  fmt::print("\n{} — {}\n", result.rung, result.passed ? "PASSED" : "FAILED");
  for (const auto& [key, value] : result.table) fmt::print("  {:<{}}  {}\n", key, width, value);
  fmt::print("  {:<{}}  {}\n", "verdict", width, result.verdict);
  std::fflush(stdout);
}

RungResult run_baseline(Session& session) {
  Trainer& trainer = *session.trainer;
  const Config& config = session.job.config;
  const BaselineRungOptions rung = BaselineRungOptions::from_config(config);
  const TrainOptions& train = session.job.trainer.train;
  const int64_t warmup = rung.warmup_steps;
  const int64_t measured = rung.steps;
  log::info(fmt::format("baseline: {} warm-up + {} measured steps, eager, one process on {}",
                        warmup, measured, session.device.str()));
  const EvalStats initial_eval = trainer.evaluate();
  // The shared step loop; the hooks record every step and its metrics record.
  auto log_hook = std::make_shared<StepLog>();
  bool measuring = false, peak_memory_step = false;
  trainer.add_hook(log_hook);
  trainer.add_hook(std::make_shared<MetricsHook>(
      *session.run,
      [&](json& record) {
        record["measured"] = measuring;
        if (peak_memory_step) record["peak_memory_step"] = true;
      },
      /*record_evals=*/false));
  std::string failure;
  PeakMemory peak;
  EvalStats final_eval;
  try {
    trainer.run_steps(warmup);
    measuring = true;
    trainer.run_steps(measured);
    measuring = false;
    // Peak memory of one full optimizer step (data, forward, backward, optimizer), not timed.
    reset_peak_memory(session.device);
    peak_memory_step = true;
    trainer.run_steps(1);
    peak = read_peak_memory(session.device);
    final_eval = trainer.evaluate();
  } catch (const TrainingError& e) {
    failure = e.what();
  }
  std::vector<double> losses, step_seconds, wait_seconds;
  int64_t samples = 0, tokens = 0;
  const auto& steps = log_hook->steps;
  for (size_t k = 0; k < steps.size() && k < static_cast<size_t>(warmup + measured); ++k) {
    if (steps[k].synced) losses.push_back(steps[k].loss);
    if (k < static_cast<size_t>(warmup)) continue;
    step_seconds.push_back(steps[k].step_seconds);
    wait_seconds.push_back(steps[k].data_wait_seconds);
    samples += steps[k].samples;
    tokens += steps[k].tokens;
  }
  // The result, written once through its struct (kiln/results.h).
  BaselineResult out;
  out.losses = losses;
  if (!failure.empty()) {
    out.status = {kResultSchemaVersion, false, failure, /*measured=*/false};
    return finish_baseline(session, out);
  }

  const double total_seconds = std::accumulate(step_seconds.begin(), step_seconds.end(), 0.0);
  const double total_wait = std::accumulate(wait_seconds.begin(), wait_seconds.end(), 0.0);
  const size_t window = std::max<size_t>(1, std::min<size_t>(5, losses.size() / 4));
  const double loss_start = mean_of(losses, 0, window);
  const double loss_end = mean_of(losses, losses.size() - window, window);
  const double samples_per_second = static_cast<double>(samples) / total_seconds;
  const double tokens_per_second = static_cast<double>(tokens) / total_seconds;
  const int64_t seq_len = trainer.data().train->tokens_per_sample();
  const double flops_per_sample = trainer.model().train_flops_per_sample(seq_len);
  const double achieved_flops = flops_per_sample * samples_per_second;
  // The device's peak for MFU: baseline.peak_flops_per_second overrides; else the hardware
  // catalog's dense peak for the training precision when the device is in it (kiln/plan.h).
  double peak_flops = rung.peak_flops_per_second;
  std::string peak_source = "baseline.peak_flops_per_second";
  if (peak_flops <= 0)
    peak_flops = run_catalog_peak_flops(config, session.run->dir() / session.run->manifest_file(),
                                        session.device, peak_source);
  const double min_drop = rung.min_loss_drop;
  // The device's achievable matmul at the job's shape and precision, timed as the pilot times it
  // (kiln/plan.h): an MFU that means something where no catalog row does. A short budget (at
  // least 5 repetitions): the baseline is run often. Informational: a model the plan's shapes do
  // not describe leaves it out (null), with a warning.
  const std::optional<MatmulPeak> matmul =
      time_job_matmul(config, session.device, 0.05, "baseline");

  // Parameter, gradient and optimizer-state bytes: the model state a step must hold.
  double param_bytes = 0, state_bytes = 0;
  for (const auto& p : trainer.model().parameters()) param_bytes += static_cast<double>(p.nbytes());
  for (const auto& [name, t] : trainer.optimizer().state())
    state_bytes += static_cast<double>(t.nbytes());

  out.device = session.device.str();
  out.warmup_steps = warmup;
  out.measured_steps = measured;
  out.batch_size = train.batch_size;
  out.grad_accum_steps = train.grad_accum_steps;
  out.seq_len = seq_len;
  out.samples_per_second = samples_per_second;
  if (seq_len > 0) out.tokens_per_second = tokens_per_second;
  out.step_seconds = {percentile(step_seconds, 0.5), percentile(step_seconds, 0.1),
                      percentile(step_seconds, 0.9),
                      total_seconds / static_cast<double>(step_seconds.size())};
  out.data_wait_share = total_wait / total_seconds;
  out.peak_memory_method = peak.method;
  out.peak_allocated_bytes = peak.allocated_bytes;
  out.peak_reserved_bytes = peak.reserved_bytes;
  out.resident_after_bytes = peak.resident_after_bytes;
  out.parameters_bytes = param_bytes;
  out.gradients_bytes = param_bytes;
  out.optimizer_bytes = state_bytes;
  out.flops_per_sample = flops_per_sample;
  if (seq_len > 0) out.flops_per_token = flops_per_sample / static_cast<double>(seq_len);
  out.achieved_flops_per_second = achieved_flops;
  if (peak_flops > 0) {
    out.mfu = achieved_flops / peak_flops;
    out.peak_flops_per_second = peak_flops;
    out.peak_flops_source = peak_source;
  }
  out.loss_start = loss_start;
  out.loss_end = loss_end;
  out.val_loss_initial = initial_eval.loss;
  out.val_loss_final = final_eval.loss;
  if (final_eval.accuracy >= 0) out.val_accuracy_final = final_eval.accuracy;
  out.skipped_steps = trainer.skipped_steps();
  if (matmul && matmul->flops_per_second > 0) {
    out.matmul_peak = matmul_peak_record(*matmul);
    out.mfu_of_matmul_peak = achieved_flops / matmul->flops_per_second;
  }

  // The gate.
  std::vector<std::string> problems;
  const auto first_nonfinite =
      std::find_if(losses.begin(), losses.end(), [](double v) { return !std::isfinite(v); });
  if (first_nonfinite != losses.end() || trainer.skipped_steps() > 0) {
    problems.push_back(fmt::format(
        "non-finite loss or gradient ({} step(s) skipped{}); lower optim.lr or enable "
        "train.clip_grad_norm",
        trainer.skipped_steps(),
        first_nonfinite != losses.end()
            ? fmt::format(", first at step {}", trainer.step() -
                                                    static_cast<int64_t>(losses.size()) +
                                                    (first_nonfinite - losses.begin()))
            : ""));
  }
  if (!std::isfinite(initial_eval.loss) || !std::isfinite(final_eval.loss)) {
    problems.push_back(
        fmt::format("non-finite val loss ({:.4f} -> {:.4f}); check the data and optim.lr",
                    initial_eval.loss, final_eval.loss));
  }
  if (!(loss_end <= loss_start * (1.0 - min_drop))) {
    problems.push_back(
        fmt::format("the loss did not fall by {:.0f}% ({:.4f} -> {:.4f}); check optim.lr "
                    "and the data, or lower baseline.min_loss_drop",
                    100 * min_drop, loss_start, loss_end));
  }
  if (!(final_eval.loss < initial_eval.loss)) {
    problems.push_back(fmt::format("val loss did not beat its initial value ({:.4f} -> {:.4f})",
                                   initial_eval.loss, final_eval.loss));
  }
  out.status.passed = problems.empty();
  out.status.verdict =
      out.status.passed
          ? fmt::format("correct eager baseline: loss {:.4f} -> {:.4f}, val {:.4f} -> {:.4f}",
                        loss_start, loss_end, initial_eval.loss, final_eval.loss)
          : problems.front();
  return finish_baseline(session, out);
}

}  // namespace kiln
