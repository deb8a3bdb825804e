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

#include "core/clock.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/memory.h"
#include "kiln/run.h"
#include "kiln/rungs.h"
#include "kiln/session.h"

namespace kiln {
namespace {

using nlohmann::json;
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

struct Baseline {
  bool measured = false;
  int64_t steps = 0;
  double samples_per_second = 0;
  double median_step_seconds = 0;
  std::string note;
};

// One process alone: a fresh copy of the job with no communicator. `budget_seconds` counts from
// the call (building the copy, warm-up and measured steps): warm-up stops early once it is spent
// (after one step), the measured steps too (after two).
Baseline measure_single_process(const Config& config, const torch::Device& device, int64_t warmup,
                                int64_t max_steps, double budget_seconds) {
  const auto begin = Clock::now();
  Trainer single(config, make_model(config), make_datasets(config),
                 TrainerOptions{device, 0, 1, nullptr});
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

json stats_delta(const CommunicationStats& before, const CommunicationStats& after) {
  return {{"collectives", after.collectives - before.collectives},
          {"bytes", after.bytes - before.bytes},
          {"busy_seconds", after.busy_seconds - before.busy_seconds},
          {"blocked_seconds", after.blocked_seconds - before.blocked_seconds}};
}

RungResult result_from_json(const json& numbers) {
  RungResult result;
  result.rung = "scale";
  auto passed = numbers.find("passed");
  result.passed = passed != numbers.end() && passed->is_boolean() && passed->get<bool>();
  auto verdict = numbers.find("verdict");
  result.verdict = verdict != numbers.end() && verdict->is_string()
                       ? verdict->get<std::string>()
                       : std::string("scale.json has no verdict");
  result.numbers = numbers;
  auto table = numbers.find("table");
  if (table != numbers.end() && table->is_array()) {
    for (const auto& row : *table) {
      if (row.is_array() && row.size() == 2 && row[0].is_string() && row[1].is_string())
        result.table.emplace_back(row[0].get<std::string>(), row[1].get<std::string>());
    }
  }
  return result;
}

// ---- measurement ---------------------------------------------------------------------------

// Step 1: rank 0 measures one process alone while the others wait; every rank gets its numbers.
Baseline measure_baseline(Session& session, int64_t warmup, int64_t baseline_steps) {
  Baseline baseline;
  if (baseline_steps <= 0) return baseline;
  const Config& config = session.config;
  Communicator& comm = *session.comm;
  log::info(
      fmt::format("scale: single-process baseline on rank 0 ({} + up to {} steps); the other "
                  "ranks wait",
                  warmup, baseline_steps));
  if (comm.rank() == 0) {
    baseline = measure_single_process(config, session.device, warmup, baseline_steps,
                                      0.5 * config.get_float("dist.timeout_seconds"));
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

// What this rank's data-parallel steps measured.
struct StepMeasurement {
  std::vector<double> losses;        // warm-up and measured steps
  std::vector<double> step_seconds;  // measured steps
  int64_t samples = 0;               // this rank's samples in the measured steps
  std::string failure;               // the TrainingError that ended the steps early, if any
  double cpu_seconds = 0;            // process CPU time over the measured steps
  CommunicationStats before, after;  // the process group's counters around the measured steps
  std::map<Phase, double> phase_seconds;
  json memory;  // this rank's memory parts (memory_parts)

  double phase(Phase p) const {
    auto it = phase_seconds.find(p);
    return it == phase_seconds.end() ? 0.0 : it->second;
  }
};

int64_t bytes_of(const NamedTensors& tensors) {
  int64_t total = 0;
  for (const auto& [name, t] : tensors) total += static_cast<int64_t>(t.nbytes());
  return total;
}

// Per-rank model-state bytes of both strategies for this model and world (parameters, gradients
// and optimizer state; FSDP's shards padded as kiln pads them): the side-by-side figures.
json model_state_both(Trainer& trainer, int world) {
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
  return {{"ddp", state(full)}, {"fsdp", state(sharded)}};
}

// This rank's memory parts for the strategy it ran (docs/scale.md, "Memory").
json memory_parts(Session& session, const MemoryProbe& probe) {
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
  const json both = model_state_both(trainer, world);
  return {
      {"strategy", session.strategy},
      {"parameters", parameters},
      {"gradients", gradients},
      {"optimizer_state", optimizer_bytes},
      {"model_state", parameters + gradients + optimizer_bytes},
      {"gathered_parameters_peak", gathered_peak},
      {"largest_gathered_unit", largest_unit},
      {"activations",
       probe.measured ? json(probe.forward_live - probe.gathered_at_forward_end) : json(nullptr)},
      {"step_peak_above_start", probe.measured ? json(probe.step_peak) : json(nullptr)},
      {"peak", probe.measured ? json(parameters + gradients + optimizer_bytes + probe.step_peak)
                              : json(nullptr)},
      {"model_state_by_strategy", both},
      {"method",
       "parameters, gradients and optimizer state: the bytes this rank holds between steps (FSDP: "
       "its shards, padding included); activations: live tensor bytes at the end of forward "
       "(MemoryMeter) less the gathered parameters then alive; step_peak_above_start: MemoryMeter "
       "over one step (gathered parameters, full gradients, activations, temporaries); peak = "
       "model state + that"},
  };
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

// ---- the report ------------------------------------------------------------------------------

// This rank's numbers (scale.json's per_rank entry).
json rank_numbers(const Communicator& comm, const StepMeasurement& m, int64_t seq_len) {
  const double seconds = std::accumulate(m.step_seconds.begin(), m.step_seconds.end(), 0.0);
  const double compute =
      m.phase(Phase::kForward) + m.phase(Phase::kBackward) + m.phase(Phase::kOptimizer);
  const json comm_delta = stats_delta(m.before, m.after);
  const double busy = comm_delta["busy_seconds"].get<double>();
  json mine = {
      {"rank", comm.rank()},
      {"local_rank", comm.local_rank()},
      {"samples", m.samples},
      {"seconds", seconds},
      {"cpu_seconds", m.cpu_seconds},
      {"samples_per_second", seconds > 0 ? static_cast<double>(m.samples) / seconds : 0.0},
      {"step_seconds",
       {{"median", percentile(m.step_seconds, 0.5)},
        {"p10", percentile(m.step_seconds, 0.1)},
        {"p90", percentile(m.step_seconds, 0.9)}}},
      {"phase_seconds",
       {{"data_wait", m.phase(Phase::kDataWait)},
        {"forward", m.phase(Phase::kForward)},
        {"backward", m.phase(Phase::kBackward)},
        {"comm_exposed", m.phase(Phase::kComm)},
        {"optimizer", m.phase(Phase::kOptimizer)}}},
      {"compute_seconds", compute},
      {"comm", comm_delta},
      {"comm_overlapped_share",
       busy > 0 ? std::clamp(1.0 - m.phase(Phase::kComm) / busy, 0.0, 1.0) : 0.0},
      {"memory", m.memory},
  };
  if (seq_len > 0)
    mine["tokens_per_second"] =
        mine["samples_per_second"].get<double>() * static_cast<double>(seq_len);
  return mine;
}

// scale.json's "global": the job's throughput (total samples over the slowest rank's time) and
// the per-step compute and communication, averaged over ranks.
json global_numbers(const json& per_rank, int world, int64_t measured, int64_t seq_len,
                    double median_step) {
  int64_t total_samples = 0;
  double slowest = 0, compute_sum = 0, busy_sum = 0, exposed_sum = 0, seconds_sum = 0;
  for (const auto& r : per_rank) {
    total_samples += r["samples"].get<int64_t>();
    slowest = std::max(slowest, r["seconds"].get<double>());
    compute_sum += r["compute_seconds"].get<double>();
    busy_sum += r["comm"]["busy_seconds"].get<double>();
    exposed_sum += r["phase_seconds"]["comm_exposed"].get<double>();
    seconds_sum += r["seconds"].get<double>();
  }
  const double global_sps = slowest > 0 ? static_cast<double>(total_samples) / slowest : 0;
  const double rank_steps = static_cast<double>(world * std::max<int64_t>(1, measured));
  return {{"samples_per_second", global_sps},
          {"tokens_per_second",
           seq_len > 0 ? json(global_sps * static_cast<double>(seq_len)) : json(nullptr)},
          {"median_step_seconds", median_step},
          {"compute_seconds_per_step", compute_sum / rank_steps},
          {"comm_busy_seconds_per_step", busy_sum / rank_steps},
          {"comm_exposed_seconds_per_step", exposed_sum / rank_steps},
          {"comm_exposed_share_of_step", seconds_sum > 0 ? exposed_sum / seconds_sum : 0.0}};
}

json baseline_numbers(const Baseline& baseline) {
  return {{"method",
           "rank 0 alone, a fresh copy of the job with the same per-process batch, threads and "
           "device, no communication; the other ranks idle in a barrier"},
          {"samples_per_second", baseline.samples_per_second},
          {"median_step_seconds", baseline.median_step_seconds},
          {"steps", baseline.steps},
          {"note", baseline.note}};
}

// Everything the report is made of, gathered from every rank.
struct ScaleOutcome {
  int world = 1;
  int64_t warmup = 0, measured = 0, seq_len = 0;
  Baseline baseline;
  StepMeasurement steps;
  json per_rank;
  std::vector<std::string> hashes;  // every rank's weights hash

  bool in_sync() const {
    return std::all_of(hashes.begin(), hashes.end(), [&](const auto& h) { return h == hashes[0]; });
  }
  bool have_baseline() const { return baseline.measured && baseline.samples_per_second > 0; }
};

// scale.json without passed, verdict and table (see docs/scale.md).
json scale_numbers(const Session& session, const ScaleOutcome& o) {
  const Config& config = session.config;
  const json global = global_numbers(o.per_rank, o.world, o.measured, o.seq_len,
                                     percentile(o.steps.step_seconds, 0.5));
  const double global_sps = global["samples_per_second"].get<double>();
  const bool have_baseline = o.have_baseline();
  const double efficiency =
      have_baseline ? global_sps / (o.world * o.baseline.samples_per_second) : 0;
  const DataParallelOptions buckets = data_parallel_options(config);
  return {
      {"world_size", o.world},
      {"strategy", session.strategy},
      {"strategy_reason", session.strategy_reason},
      {"strategy_decision", session.strategy_decision},
      {"backend", session.comm->backend_name()},
      {"device", session.device.str()},
      {"threads_per_process", at::get_num_threads()},
      {"batch_size_per_process", config.get_int("train.batch_size")},
      {"grad_accum_steps", config.get_int("train.grad_accum_steps")},
      {"global_batch_samples",
       config.get_int("train.batch_size") * config.get_int("train.grad_accum_steps") * o.world},
      {"seq_len", o.seq_len},
      {"warmup_steps", o.warmup},
      {"measured_steps", o.measured},
      {"bucket_cap_bytes",
       {{"first", buckets.first_bucket_bytes}, {"other", buckets.bucket_bytes}}},
      {"global", global},
      {"baseline", have_baseline ? baseline_numbers(o.baseline) : json(nullptr)},
      {"scaling_efficiency", have_baseline ? json(efficiency) : json(nullptr)},
      {"speedup", have_baseline ? json(global_sps / o.baseline.samples_per_second) : json(nullptr)},
      {"replicas_in_sync", o.in_sync()},
      {"weights_hash", o.hashes[0]},
      {"losses", o.steps.losses},
      {"per_rank", o.per_rank},
  };
}

// The gate: the first problem, or an empty list when it passed.
std::vector<std::string> gate_problems(const Config& config, const ScaleOutcome& o,
                                       const json& numbers) {
  const StepMeasurement& m = o.steps;
  const bool finite = m.failure.empty() && std::all_of(m.losses.begin(), m.losses.end(),
                                                       [](double l) { return std::isfinite(l); });
  const double min_efficiency = config.get_float("dist.min_scaling_efficiency");
  std::vector<std::string> problems;
  if (!finite) problems.push_back(m.failure.empty() ? "non-finite loss" : m.failure);
  if (!o.in_sync())
    problems.push_back(
        "the replicas' weights differ after training (gradients were not averaged identically)");
  if (o.have_baseline()) {
    const double efficiency = numbers["scaling_efficiency"].get<double>();
    if (efficiency < min_efficiency) {
      problems.push_back(
          fmt::format("scaling efficiency {:.1f}% is below dist.min_scaling_efficiency {:.1f}%",
                      100 * efficiency, 100 * min_efficiency));
    }
  }
  return problems;
}

// Throughput in tokens/s for token models (seq_len > 0), else samples/s.
struct ThroughputUnit {
  std::string name;
  double per_sample;
  explicit ThroughputUnit(int64_t seq_len)
      : name(seq_len > 0 ? "tokens/s" : "samples/s"),
        per_sample(seq_len > 0 ? static_cast<double>(seq_len) : 1.0) {}
};

std::string scale_verdict(const ScaleOutcome& o, const json& numbers,
                          const std::vector<std::string>& problems) {
  if (!problems.empty()) return problems.front();
  const ThroughputUnit unit(o.seq_len);
  const double global_sps = numbers["global"]["samples_per_second"].get<double>();
  return fmt::format(
      "{} ranks in sync, {:.0f} {}{}", o.world, global_sps * unit.per_sample, unit.name,
      o.have_baseline() ? fmt::format(", {:.0f}% scaling efficiency",
                                      100 * numbers["scaling_efficiency"].get<double>())
                        : "");
}

std::vector<std::pair<std::string, std::string>> scale_table(const Session& session,
                                                             const ScaleOutcome& o,
                                                             const json& numbers) {
  const ThroughputUnit unit(o.seq_len);
  const json& global = numbers["global"];
  const double global_sps = global["samples_per_second"].get<double>();
  std::vector<std::pair<std::string, std::string>> t;
  t.emplace_back("processes",
                 fmt::format("{} x {} ({}, {} thread(s) each)", o.world, session.device.str(),
                             session.comm->backend_name(), at::get_num_threads()));
  t.emplace_back("global throughput",
                 fmt::format("{:.0f} {}", global_sps * unit.per_sample, unit.name));
  std::string per_rank_line;
  for (const auto& r : o.per_rank) {
    per_rank_line += fmt::format("{}{:.0f}", per_rank_line.empty() ? "" : ", ",
                                 r["samples_per_second"].get<double>() * unit.per_sample);
  }
  t.emplace_back("per-rank throughput", per_rank_line + " " + unit.name);
  t.emplace_back("single process",
                 o.have_baseline()
                     ? fmt::format("{:.0f} {} (rank 0 alone)",
                                   o.baseline.samples_per_second * unit.per_sample, unit.name)
                     : std::string("not measured"));
  t.emplace_back("scaling efficiency",
                 o.have_baseline() ? fmt::format("{:.1f}% (speedup {:.2f}x on {} processes)",
                                                 100 * numbers["scaling_efficiency"].get<double>(),
                                                 numbers["speedup"].get<double>(), o.world)
                                   : std::string("n/a"));
  t.emplace_back("step time", fmt::format("median {:.2f} ms",
                                          1e3 * global["median_step_seconds"].get<double>()));
  t.emplace_back("compute vs comm",
                 fmt::format("compute {:.2f} ms/step, all-reduce in flight {:.2f} ms/step, exposed "
                             "{:.2f} ms/step ({:.1f}% of step)",
                             1e3 * global["compute_seconds_per_step"].get<double>(),
                             1e3 * global["comm_busy_seconds_per_step"].get<double>(),
                             1e3 * global["comm_exposed_seconds_per_step"].get<double>(),
                             100 * global["comm_exposed_share_of_step"].get<double>()));
  // Under FSDP nothing is replicated: each rank holds its own shard, and the hashes compared
  // are of the weights every rank all-gathered from the same shards, equal by construction. So
  // the line claims no check there.
  t.emplace_back("replicas", session.fsdp
                                 ? "n/a (sharded: each rank holds its own shard; consolidated "
                                   "weights " +
                                       o.hashes[0] + ")"
                             : o.in_sync() ? "in sync (weights " + o.hashes[0] + ")"
                                           : std::string("DIFFER"));
  t.emplace_back("strategy", session.strategy + " (" + session.strategy_reason + ")");
  constexpr double kMiB = 1024.0 * 1024.0;
  if (!o.per_rank.empty() && o.per_rank[0].contains("memory")) {
    const json& mem = o.per_rank[0]["memory"];
    auto mib = [&](const char* key) {
      return mem[key].is_number() ? fmt::format("{:.2f}", mem[key].get<double>() / kMiB)
                                  : std::string("n/a");
    };
    t.emplace_back(
        "memory per rank (rank 0)",
        fmt::format("peak {} MiB: parameters {} + gradients {} + optimizer {} MiB; gathered "
                    "parameters {} MiB at most; activations {} MiB",
                    mib("peak"), mib("parameters"), mib("gradients"), mib("optimizer_state"),
                    mib("gathered_parameters_peak"), mib("activations")));
    const json& both = mem["model_state_by_strategy"];
    t.emplace_back("model state per rank",
                   fmt::format("ddp {:.2f} MiB, fsdp {:.2f} MiB (+ the largest unit gathered, "
                               "{:.2f} MiB)",
                               both["ddp"].get<double>() / kMiB, both["fsdp"].get<double>() / kMiB,
                               mem["largest_gathered_unit"].get<double>() / kMiB));
  }
  return t;
}

RungResult scale_result(const Session& session, const ScaleOutcome& o) {
  json numbers = scale_numbers(session, o);
  const std::vector<std::string> problems = gate_problems(session.config, o, numbers);
  RungResult result;
  result.rung = "scale";
  result.passed = problems.empty();
  result.verdict = scale_verdict(o, numbers, problems);
  result.table = scale_table(session, o, numbers);
  numbers["passed"] = result.passed;
  numbers["verdict"] = result.verdict;
  json table = json::array();
  for (const auto& [k, v] : result.table) table.push_back({k, v});
  numbers["table"] = table;
  result.numbers = numbers;
  return result;
}

// ---- launching the ranks from a single process (the ladder) -------------------------------------

// The ranks' scale.json, or a UserError naming the file and the fix.
json read_scale_json(const std::filesystem::path& path) {
  const json numbers = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  if (numbers.is_discarded() || !numbers.is_object()) {
    throw UserError(fmt::format(
        "{}: not a JSON object (a partial or foreign file); delete it and rerun the scale rung",
        path.string()));
  }
  return numbers;
}

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
  if (std::filesystem::exists(ranks_json, ec)) {
    json numbers = read_scale_json(ranks_json);
    numbers["ranks_run_dir"] = launched.run_dir.string();
    RungResult result = result_from_json(numbers);
    if (status != 0 && status != kExitGateFailed) {
      result.passed = false;
      result.verdict = fmt::format("torchrun exited with status {}: {}", status, result.verdict);
      numbers["passed"] = false;
      numbers["verdict"] = result.verdict;
      result.numbers = numbers;
    }
    write_file_atomic(scale_json, numbers.dump(2) + "\n");
    return result;
  }
  RungResult result;
  result.rung = "scale";
  result.verdict = fmt::format(
      "torchrun exited with status {} and wrote no scale.json; see the ranks' "
      "errors above and {}",
      status, (launched.run_dir / "train.log").string());
  result.numbers = {{"passed", false},
                    {"verdict", result.verdict},
                    {"torchrun_status", status},
                    {"ranks_run_dir", launched.run_dir.string()}};
  write_file_atomic(scale_json, result.numbers.dump(2) + "\n");
  return result;
}

}  // namespace

RungResult run_scale(Session& session) {
  const Config& config = session.config;
  Communicator& comm = *session.comm;
  ScaleOutcome o;
  o.world = comm.world_size();
  o.warmup = config.get_int("dist.scale_warmup_steps");
  o.measured = config.get_int("dist.scale_steps");
  o.seq_len = session.trainer->data().train->tokens_per_sample();
  const int64_t baseline_steps = o.world > 1 ? config.get_int("dist.scale_baseline_steps") : 0;

  // 1. The single-process baseline: rank 0 alone, the others waiting in a barrier.
  o.baseline = measure_baseline(session, o.warmup, baseline_steps);

  // 2. Data-parallel steps.
  log::info(fmt::format(
      "scale: {} ranks ({}), {} warm-up + {} measured steps, {} samples per rank per "
      "micro-batch",
      o.world, comm.backend_name(), o.warmup, o.measured, config.get_int("train.batch_size")));
  o.steps = run_measured_steps(session, o.warmup, o.measured);

  // 3. The replicas must still agree bit for bit; every rank gathers every rank's numbers (each
  // needs the same verdict).
  o.hashes = comm.all_gather_bytes(session.fsdp ? session.fsdp->full_weights_hash()
                                                : weights_hash(session.trainer->model()));
  o.per_rank = json::array();
  for (const auto& text : comm.all_gather_bytes(rank_numbers(comm, o.steps, o.seq_len).dump()))
    o.per_rank.push_back(json::parse(text));

  RungResult result = scale_result(session, o);
  session.run->write_json("scale.json", result.numbers);
  return result;
}

RungResult run_scale_rung(const Config& config, const SessionOptions& options) {
  auto comm = options.comm ? options.comm : process_communicator(config);
  const int processes = static_cast<int>(config.get_int("dist.scale_processes"));
  if (comm->world_size() == 1 && processes > 1) {
    // The ranks write in <run dir>/scale/ under this process's lock.
    const auto lock = lock_run_directories(config, *comm, options.argv);
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
