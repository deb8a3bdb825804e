// The hooks kiln provides: progress display, metrics records, step log.
#include "train/hooks.h"

#include <fmt/format.h>

#include "core/clock.h"
#include "core/strings.h"
#include "kiln/log.h"
#include "kiln/run.h"

namespace kiln {
namespace {

// Progress as a hook: a bar with rate and ETA on a terminal, a log line every run.log_every
// steps otherwise (synced steps only: the loss is known there).
class ProgressHook final : public TrainerHook {
 public:
  ProgressHook(const TrainOptions& options, int64_t total, int rank, int64_t first_step)
      : total_(total), every_(options.log_every), first_step_(first_step) {
    using P = TrainOptions::Progress;
    bar_ = rank == 0 && (options.progress == P::kBar ||
                         (options.progress == P::kAuto && log::stderr_is_terminal()));
    off_ = options.progress == P::kOff;
  }
  void on_step_end(Trainer&, const StepStats& s) override {
    if (off_ || !s.synced) return;
    const double elapsed = seconds_since(begin_);
    const double rate = elapsed > 0 ? static_cast<double>(s.step - first_step_) / elapsed : 0;
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
  void on_eval(Trainer& trainer, const EvalStats& eval) override {
    finish();
    std::string line = fmt::format("eval at step {}: val_loss {:.4f}", trainer.step(), eval.loss);
    if (eval.accuracy >= 0) line += fmt::format(" val_accuracy {:.2f}%", 100 * eval.accuracy);
    log::info(line);
  }
  void on_step_failed(Trainer&, int64_t) override { finish(); }
  void on_train_end(Trainer&) override { finish(); }

 private:
  void finish() {
    if (bar_) log::finish_status();
  }
  int64_t total_, every_, first_step_;
  bool bar_ = false, off_ = false;
  SteadyClock::time_point begin_ = SteadyClock::now();
};

}  // namespace

std::shared_ptr<TrainerHook> make_progress_hook(const TrainOptions& options, int64_t total_steps,
                                                int rank, int64_t first_step) {
  return std::make_shared<ProgressHook>(options, total_steps, rank, first_step);
}

// ---- hooks kiln provides -----------------------------------------------------------------------

nlohmann::json step_record(const StepStats& s) {
  nlohmann::json record = {{"step", s.step},
                           {"loss", s.loss},
                           {"lr", s.lr},
                           {"grad_norm", s.grad_norm},
                           {"step_seconds", s.step_seconds},
                           {"data_wait_seconds", s.data_wait_seconds},
                           {"samples_per_second", static_cast<double>(s.samples) / s.step_seconds}};
  if (s.tokens > 0) record["tokens_per_second"] = static_cast<double>(s.tokens) / s.step_seconds;
  if (s.skipped) record["skipped"] = true;
  return record;
}

MetricsHook::MetricsHook(Run& run, std::function<void(nlohmann::json&)> annotate, bool record_evals)
    : run_(run), annotate_(std::move(annotate)), record_evals_(record_evals) {}

void MetricsHook::on_step_end(Trainer&, const StepStats& stats) {
  if (!stats.synced) return;
  nlohmann::json record = step_record(stats);
  if (annotate_) annotate_(record);
  run_.append_metrics(record);
}

void MetricsHook::on_eval(Trainer& trainer, const EvalStats& eval) {
  if (!record_evals_) return;
  nlohmann::json record = {{"step", trainer.step()}, {"val_loss", eval.loss}};
  if (eval.accuracy >= 0) record["val_accuracy"] = eval.accuracy;
  run_.append_metrics(record);
}

}  // namespace kiln
