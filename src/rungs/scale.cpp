// The scale rung: data-parallel throughput against a single-process baseline, and where the time
// goes (compute against communication). See kiln/rungs.h for the procedure, docs/scale.md for
// scale.json.
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <numeric>
#include <tuple>

#include "core/clock.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/memory.h"
#include "kiln/results.h"
#include "kiln/run.h"
#include "kiln/rungs.h"
#include "kiln/session.h"
#include "rungs/options.h"
#include "rungs/scale_parts.h"

namespace kiln {
namespace scale_rung {

using Clock = SteadyClock;

// CPU time of the whole process (every thread: training, loader, the backend's), in seconds.
double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Wall time per phase while `measuring`, from the Trainer's phase markers.
class PhaseTimer final : public TrainerHook {
 public:
  bool measuring = false;
  std::map<Phase, double> seconds;

  void on_phase_begin(Trainer&, Phase phase) override { begun_[phase] = Clock::now(); }
  void on_phase_end(Trainer&, Phase phase) override {
    if (measuring) seconds[phase] += seconds_since(begun_[phase]);
  }

 private:
  std::map<Phase, Clock::time_point> begun_;
};

// Memory of one step on this rank (kiln::MemoryMeter, on the training thread and the threads
// inheriting its state): the peak of live tensor bytes above the step's start, and the bytes
// still live at the end of each forward (the saved activations, plus gathered parameters that
// FSDP keeps: subtracted by the caller).
class MemoryProbe final : public TrainerHook {
 public:
  explicit MemoryProbe(std::shared_ptr<FullyShardedDataParallel> fsdp) : fsdp_(std::move(fsdp)) {}
  bool armed = false;  // measure the next step
  bool measured = false;
  int64_t step_peak = 0, forward_live = 0, gathered_at_forward_end = 0;

  void on_step_begin(Trainer&, int64_t) override {
    if (!armed) return;
    step_ = std::make_unique<MemoryMeter>();
  }
  void on_phase_begin(Trainer&, Phase phase) override {
    if (step_ && phase == Phase::kForward) forward_ = std::make_unique<MemoryMeter>();
  }
  void on_phase_end(Trainer&, Phase phase) override {
    if (!forward_ || phase != Phase::kForward) return;
    forward_->stop();
    const MemoryPeak peak = forward_->peaks().empty() ? MemoryPeak{} : forward_->peaks().back();
    const int64_t gathered = fsdp_ ? fsdp_->memory().gathered_now : 0;
    if (peak.end_bytes - gathered > forward_live - gathered_at_forward_end) {
      forward_live = peak.end_bytes;
      gathered_at_forward_end = gathered;
    }
    forward_.reset();
  }
  void on_step_end(Trainer&, const StepStats&) override {
    if (!step_) return;
    step_->stop();
    for (const auto& peak : step_->peaks()) step_peak = std::max(step_peak, peak.peak_bytes);
    step_.reset();
    armed = false;
    measured = true;
  }
  void on_step_failed(Trainer&, int64_t) override {
    forward_.reset();
    step_.reset();
    armed = false;
  }

 private:
  std::shared_ptr<FullyShardedDataParallel> fsdp_;
  std::unique_ptr<MemoryMeter> step_, forward_;
};

// One process alone: a fresh copy of the job with no communicator. `budget_seconds` counts from
// the call (building the copy, warm-up and measured steps): warm-up stops early once it is spent
// (after one step), the measured steps too (after two).
Baseline measure_single_process(const Job& job, const torch::Device& device, int64_t warmup,
                                int64_t max_steps, double budget_seconds) {
  const auto begin = Clock::now();
  ComposedStep composed =
      compose_step(job, make_model(job.config), make_datasets(job.config),
                   TrainerOptions{device, 0, 1, nullptr}, StepComposition{.compile = false});
  Trainer& single = *composed.trainer;
  int64_t warmed = 0;
  for (; warmed < warmup; ++warmed) {
    if (warmed >= 1 && seconds_since(begin) > budget_seconds) break;
    single.train_step();
  }
  std::vector<double> step_seconds;
  int64_t samples = 0;
  for (int64_t k = 0; k < max_steps; ++k) {
    if (k >= 2 && seconds_since(begin) > budget_seconds) break;
    StepStats s = single.train_step();
    step_seconds.push_back(s.step_seconds);
    samples += s.samples;
  }
  Baseline out;
  out.measured = true;
  out.steps = static_cast<int64_t>(step_seconds.size());
  out.samples_per_second =
      static_cast<double>(samples) / std::accumulate(step_seconds.begin(), step_seconds.end(), 0.0);
  out.median_step_seconds = percentile(step_seconds, 0.5);
  if (out.steps < max_steps || warmed < warmup) {
    out.note = fmt::format(
        "stopped after {} warm-up and {} measured steps: half of dist.timeout_seconds spent "
        "(building the copy included)",
        warmed, out.steps);
  }
  return out;
}

// ---- measurement ---------------------------------------------------------------------------

// Step 1: rank 0 measures one process alone while the others wait; every rank gets its numbers.
Baseline measure_baseline(Session& session, int64_t warmup, int64_t baseline_steps) {
  Baseline baseline;
  if (baseline_steps <= 0) return baseline;
  Communicator& comm = *session.comm;
  log::info(
      fmt::format("scale: single-process baseline on rank 0 ({} + up to {} steps); the other "
                  "ranks wait",
                  warmup, baseline_steps));
  if (comm.rank() == 0) {
    baseline = measure_single_process(
        session.job, session.device, warmup, baseline_steps,
        0.5 * ScaleRungOptions::from_config(session.job.config).timeout_seconds);
  }
  comm.barrier();
  const json mine = comm.rank() == 0 ? json{{"sps", baseline.samples_per_second},
                                            {"median", baseline.median_step_seconds},
                                            {"steps", baseline.steps},
                                            {"note", baseline.note}}
                                     : json();
  const json from_rank0 = json::parse(comm.all_gather_bytes(mine.dump())[0]);
  baseline.measured = true;
  baseline.samples_per_second = from_rank0["sps"].get<double>();
  baseline.median_step_seconds = from_rank0["median"].get<double>();
  baseline.steps = from_rank0["steps"].get<int64_t>();
  baseline.note = from_rank0["note"].get<std::string>();
  return baseline;
}

int64_t bytes_of(const NamedTensors& tensors) {
  int64_t total = 0;
  for (const auto& [name, t] : tensors) total += static_cast<int64_t>(t.nbytes());
  return total;
}

// Per-rank model-state bytes of both strategies for this model and world (parameters, gradients
// and optimizer state; FSDP's shards padded as kiln pads them): the side-by-side figures.
std::pair<int64_t, int64_t> model_state_both(Trainer& trainer, int world) {
  int64_t full = 0, sharded = 0;
  for (const auto& item : trainer.model().named_parameters()) {
    if (!item.value().requires_grad()) continue;
    const ShardLayout layout = shard_layout(item.key(), item.value().sizes().vec(), world);
    full += static_cast<int64_t>(item.value().nbytes());
    sharded += layout.rows_per_rank * layout.row_numel * item.value().element_size();
  }
  const OptimOptions& o = trainer.optimizer().options();
  const double optimizer_factor =
      o.kind == OptimOptions::Kind::kAdamW ? 2.0 : (o.momentum > 0 ? 1.0 : 0.0);
  auto state = [&](int64_t params) {
    return static_cast<int64_t>(static_cast<double>(params) * (2.0 + optimizer_factor));
  };
  return {state(full), state(sharded)};  // ddp, fsdp
}

// This rank's memory parts for the strategy it ran (docs/scale.md, "Memory").
ScaleRankMemory memory_parts(Session& session, const MemoryProbe& probe) {
  Trainer& trainer = *session.trainer;
  const int world = session.comm->world_size();
  const int64_t optimizer_bytes = bytes_of(trainer.optimizer().state());
  int64_t parameters = 0, gradients = 0, gathered_peak = 0, largest_unit = 0;
  if (session.fsdp) {
    const FsdpMemory m = session.fsdp->memory();
    parameters = m.parameter_shards;
    gradients = m.gradient_shards;
    gathered_peak = m.gathered_peak;
    largest_unit = m.largest_unit;
  } else {
    for (const auto& p : trainer.model().parameters()) {
      parameters += static_cast<int64_t>(p.nbytes());
      if (p.requires_grad()) gradients += static_cast<int64_t>(p.nbytes());
    }
  }
  ScaleRankMemory out;
  out.strategy = std::string(to_string(session.strategy));
  out.parameters = parameters;
  out.gradients = gradients;
  out.optimizer_state = optimizer_bytes;
  out.model_state = parameters + gradients + optimizer_bytes;
  out.gathered_parameters_peak = gathered_peak;
  out.largest_gathered_unit = largest_unit;
  if (probe.measured) {
    out.activations = probe.forward_live - probe.gathered_at_forward_end;
    out.step_peak_above_start = probe.step_peak;
    out.peak = parameters + gradients + optimizer_bytes + probe.step_peak;
  }
  std::tie(out.model_state_ddp, out.model_state_fsdp) = model_state_both(trainer, world);
  out.method =
      "parameters, gradients and optimizer state: the bytes this rank holds between steps (FSDP: "
      "its shards, padding included); activations: live tensor bytes at the end of forward "
      "(MemoryMeter) less the gathered parameters then alive; step_peak_above_start: MemoryMeter "
      "over one step (gathered parameters, full gradients, activations, temporaries); peak = "
      "model state + that";
  return out;
}

// Step 2, the step loop: `warmup` steps, then `measured` steps timed per phase by a PhaseTimer and
// logged to metrics.jsonl. A TrainingError ends them (StepMeasurement::failure); a
// CommunicationError propagates.
StepMeasurement run_measured_steps(Session& session, int64_t warmup, int64_t measured) {
  Trainer& trainer = *session.trainer;
  Communicator& comm = *session.comm;
  const int world = comm.world_size();
  auto timer = std::make_shared<PhaseTimer>();
  auto log_hook = std::make_shared<StepLog>();
  auto probe = std::make_shared<MemoryProbe>(session.fsdp);
  trainer.add_hook(timer);
  trainer.add_hook(log_hook);
  trainer.add_hook(probe);
  StepMeasurement m;
  try {
    // Memory is measured on the last warm-up step (the first measured one without warm-up).
    if (warmup > 0) trainer.run_steps(warmup - 1);
    probe->armed = true;
    if (warmup > 0) trainer.run_steps(1);
    m.before = comm.stats();
    // Metrics records for the measured steps only.
    trainer.add_hook(std::make_shared<MetricsHook>(
        *session.run, [](json& record) { record["measured"] = true; }, /*record_evals=*/false));
    timer->measuring = true;
    const double cpu_begin = process_cpu_seconds();
    trainer.run_steps(measured);
    timer->measuring = false;
    m.cpu_seconds = process_cpu_seconds() - cpu_begin;
    m.after = comm.stats();
  } catch (const CommunicationError&) {
    throw;
  } catch (const TrainingError& e) {
    m.failure = e.what();
  }
  const auto& steps = log_hook->steps;
  for (size_t k = 0; k < steps.size(); ++k) {
    if (steps[k].synced) m.losses.push_back(steps[k].loss);
    if (k < static_cast<size_t>(warmup)) continue;
    m.step_seconds.push_back(steps[k].step_seconds);
    m.samples += steps[k].samples / world;  // samples counts every rank
  }
  m.phase_seconds = timer->seconds;
  m.memory = memory_parts(session, *probe);
  return m;
}

// ---- launching the ranks from a single process (the ladder) -------------------------------------

// Runs the rung under torchrun (launch_with_torchrun, the ranks' run in <run dir>/scale/) and
// reads back what rank 0 wrote; <run dir>/scale.json is a copy of theirs.
RungResult launch_scale_ranks(const Config& config, int processes) {
  const std::filesystem::path run_dir = run_directory(config);
  const auto ranks_json = run_dir / "scale" / "scale.json";
  const auto scale_json = run_dir / "scale.json";
  const TorchrunOutcome launched = launch_with_torchrun(
      config, TorchrunJob{"scale", processes, "scale", {ranks_json, scale_json}});
  const int status = launched.status;
  std::error_code ec;
  ScaleResult numbers;
  if (std::filesystem::exists(ranks_json, ec)) {
    // The ranks' file through its typed reader (a partial or foreign file is a one-line
    // ResultFormatError naming it and how to regenerate it).
    numbers = read_result<ScaleResult>(ranks_json);
    if (status != 0 && status != kExitGateFailed) {
      numbers.status.passed = false;
      numbers.status.verdict =
          fmt::format("torchrun exited with status {}: {}", status, numbers.status.verdict);
    }
  } else {
    numbers.status = {kResultSchemaVersion, false,
                      fmt::format("torchrun exited with status {} and wrote no scale.json; see "
                                  "the ranks' errors above and {}",
                                  status, (launched.run_dir / "train.log").string()),
                      /*measured=*/false};
    numbers.torchrun_status = status;
  }
  numbers.ranks_run_dir = launched.run_dir.string();
  write_file_atomic(scale_json, json(numbers).dump(2) + "\n");
  return result_from_file(numbers);
}

}  // namespace scale_rung

RungResult run_scale(Session& session) {
  using namespace scale_rung;
  const ScaleRungOptions rung = ScaleRungOptions::from_config(session.job.config);
  Communicator& comm = *session.comm;
  ScaleOutcome o;
  o.world = comm.world_size();
  o.warmup = rung.warmup_steps;
  o.measured = rung.steps;
  o.seq_len = session.trainer->data().train->tokens_per_sample();
  const int64_t baseline_steps = o.world > 1 ? rung.baseline_steps : 0;

  // 1. The single-process baseline: rank 0 alone, the others waiting in a barrier.
  o.baseline = measure_baseline(session, o.warmup, baseline_steps);

  // 2. Data-parallel steps.
  log::info(fmt::format(
      "scale: {} ranks ({}), {} warm-up + {} measured steps, {} samples per rank per "
      "micro-batch",
      o.world, comm.backend_name(), o.warmup, o.measured, session.job.trainer.train.batch_size));
  o.steps = run_measured_steps(session, o.warmup, o.measured);

  // 3. The replicas must still agree bit for bit; every rank gathers every rank's numbers (each
  // needs the same verdict).
  // (Under tensor parallelism, of this rank's slices: the ranks of one slice must agree.)
  o.hashes = comm.all_gather_bytes(session.fsdp ? session.fsdp->full_weights_hash()
                                                : weights_hash(session.trainer->model()));
  o.tp = session.mesh.tp;  // dist.tp, or the degree "auto" chose
  for (const auto& text :
       comm.all_gather_bytes(json(rank_numbers(comm, o.steps, o.seq_len)).dump()))
    o.per_rank.push_back(json::parse(text).get<ScaleRank>());

  RungResult result = scale_result(session, o);
  session.run->write_json("scale.json", json(std::get<ScaleResult>(result.numbers)));
  return result;
}

RungResult run_scale_rung(const Config& config, const SessionOptions& options) {
  using scale_rung::launch_scale_ranks;
  auto comm = options.comm ? options.comm : process_communicator(config);
  const int processes = ScaleRungOptions::from_config(config).processes;
  if (comm->world_size() == 1 && processes > 1) {
    // The ranks write in <run dir>/scale/ under this process's lock.
    const auto lock =
        lock_run_directories(resolve_job(config, JobRequest{.argv = options.argv}), *comm);
    return launch_scale_ranks(config, processes);
  }
  if (comm->world_size() == 1) {
    log::info(
        "scale: a world of one; start under torchrun, or set dist.scale_processes to launch it");
  }
  SessionOptions with_comm = options;
  with_comm.comm = comm;
  auto session = open_session(config, with_comm);
  return run_scale(*session);
}

}  // namespace kiln
