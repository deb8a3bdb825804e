// The scale rung's report (rungs/scale_parts.h): scale.json from every rank's measurements, the
// gate, the verdict and the table. docs/scale.md describes scale.json.
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
#include "kiln/results.h"
#include "kiln/run.h"
#include "kiln/rungs.h"
#include "kiln/session.h"
#include "rungs/options.h"
#include "rungs/scale_parts.h"

namespace kiln::scale_rung {

RungResult result_from_file(const ScaleResult& numbers) {
  RungResult result;
  result.rung = "scale";
  result.passed = numbers.status.passed;
  result.verdict = numbers.status.verdict;
  result.table = numbers.table;
  result.numbers = numbers;
  return result;
}

// ---- the report ------------------------------------------------------------------------------

// This rank's numbers (scale.json's per_rank entry).
ScaleRank rank_numbers(const Communicator& comm, const StepMeasurement& m, int64_t seq_len) {
  ScaleRank mine;
  const double seconds = std::accumulate(m.step_seconds.begin(), m.step_seconds.end(), 0.0);
  mine.rank = comm.rank();
  mine.local_rank = comm.local_rank();
  mine.samples = m.samples;
  mine.seconds = seconds;
  mine.cpu_seconds = m.cpu_seconds;
  mine.samples_per_second = seconds > 0 ? static_cast<double>(m.samples) / seconds : 0.0;
  if (seq_len > 0) mine.tokens_per_second = mine.samples_per_second * static_cast<double>(seq_len);
  mine.step_median = percentile(m.step_seconds, 0.5);
  mine.step_p10 = percentile(m.step_seconds, 0.1);
  mine.step_p90 = percentile(m.step_seconds, 0.9);
  mine.data_wait_seconds = m.phase(Phase::kDataWait);
  mine.forward_seconds = m.phase(Phase::kForward);
  mine.backward_seconds = m.phase(Phase::kBackward);
  mine.comm_exposed_seconds = m.phase(Phase::kComm);
  mine.optimizer_seconds = m.phase(Phase::kOptimizer);
  mine.compute_seconds = mine.forward_seconds + mine.backward_seconds + mine.optimizer_seconds;
  // The process group's counters between the two readings.
  mine.comm_collectives = m.after.collectives - m.before.collectives;
  mine.comm_bytes = m.after.bytes - m.before.bytes;
  mine.comm_busy_seconds = m.after.busy_seconds - m.before.busy_seconds;
  mine.comm_blocked_seconds = m.after.blocked_seconds - m.before.blocked_seconds;
  const double busy = mine.comm_busy_seconds;
  mine.comm_overlapped_share =
      busy > 0 ? std::clamp(1.0 - mine.comm_exposed_seconds / busy, 0.0, 1.0) : 0.0;
  mine.memory = m.memory;
  return mine;
}

// scale.json's "global": the job's throughput (total samples over the slowest rank's time) and
// the per-step compute and communication, averaged over ranks.
void global_numbers(const ScaleOutcome& o, ScaleResult& out) {
  int64_t total_samples = 0;
  double slowest = 0, compute_sum = 0, busy_sum = 0, exposed_sum = 0, seconds_sum = 0;
  for (const ScaleRank& r : o.per_rank) {
    total_samples += r.samples;
    slowest = std::max(slowest, r.seconds);
    compute_sum += r.compute_seconds;
    busy_sum += r.comm_busy_seconds;
    exposed_sum += r.comm_exposed_seconds;
    seconds_sum += r.seconds;
  }
  const double global_sps = slowest > 0 ? static_cast<double>(total_samples) / slowest : 0;
  const double rank_steps = static_cast<double>(o.world * std::max<int64_t>(1, o.measured));
  out.global_samples_per_second = global_sps;
  if (o.seq_len > 0) out.global_tokens_per_second = global_sps * static_cast<double>(o.seq_len);
  out.median_step_seconds = percentile(o.steps.step_seconds, 0.5);
  out.compute_seconds_per_step = compute_sum / rank_steps;
  out.comm_busy_seconds_per_step = busy_sum / rank_steps;
  out.comm_exposed_seconds_per_step = exposed_sum / rank_steps;
  out.comm_exposed_share_of_step = seconds_sum > 0 ? exposed_sum / seconds_sum : 0.0;
}

// scale.json without passed, verdict and table (see docs/scale.md).
ScaleResult scale_numbers(const Session& session, const ScaleOutcome& o) {
  ScaleResult out;
  out.world_size = o.world;
  out.strategy = std::string(to_string(session.strategy));
  out.strategy_reason = session.strategy_reason;
  out.strategy_decision = session.strategy_decision;
  out.backend = session.comm->backend_name();
  out.device = session.device.str();
  out.threads_per_process = at::get_num_threads();
  out.batch_size_per_process = session.job.trainer.train.batch_size;
  out.grad_accum_steps = session.job.trainer.train.grad_accum_steps;
  out.global_batch_samples = out.batch_size_per_process * out.grad_accum_steps * o.world;
  out.seq_len = o.seq_len;
  out.warmup_steps = o.warmup;
  out.measured_steps = o.measured;
  const DataParallelOptions buckets = session.job.ddp;
  out.first_bucket_cap_bytes = buckets.first_bucket_bytes;
  out.bucket_cap_bytes = buckets.bucket_bytes;
  global_numbers(o, out);
  if (o.have_baseline()) {
    out.baseline = ScaleBaseline{
        "rank 0 alone, a fresh copy of the job with the same per-process batch, threads and "
        "device, no communication; the other ranks idle in a barrier",
        o.baseline.note, o.baseline.samples_per_second, o.baseline.median_step_seconds,
        o.baseline.steps};
    out.scaling_efficiency =
        out.global_samples_per_second / (o.world * o.baseline.samples_per_second);
    out.speedup = out.global_samples_per_second / o.baseline.samples_per_second;
  }
  out.replicas_in_sync = o.in_sync();
  out.weights_hash = o.hashes[0];
  out.losses = o.steps.losses;
  out.per_rank = o.per_rank;
  return out;
}

// The gate: the first problem, or an empty list when it passed.
std::vector<std::string> gate_problems(const Config& config, const ScaleOutcome& o,
                                       const ScaleResult& numbers) {
  const StepMeasurement& m = o.steps;
  const bool finite = m.failure.empty() && std::all_of(m.losses.begin(), m.losses.end(),
                                                       [](double l) { return std::isfinite(l); });
  const double min_efficiency = ScaleRungOptions::from_config(config).min_scaling_efficiency;
  std::vector<std::string> problems;
  if (!finite) problems.push_back(m.failure.empty() ? "non-finite loss" : m.failure);
  if (!o.in_sync())
    problems.push_back(
        "the replicas' weights differ after training (gradients were not averaged identically)");
  if (numbers.scaling_efficiency && *numbers.scaling_efficiency < min_efficiency) {
    problems.push_back(
        fmt::format("scaling efficiency {:.1f}% is below dist.min_scaling_efficiency {:.1f}%",
                    100 * *numbers.scaling_efficiency, 100 * min_efficiency));
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

std::string scale_verdict(const ScaleResult& numbers, const std::vector<std::string>& problems) {
  if (!problems.empty()) return problems.front();
  const ThroughputUnit unit(numbers.seq_len);
  return fmt::format("{} ranks in sync, {:.0f} {}{}", numbers.world_size,
                     numbers.global_samples_per_second * unit.per_sample, unit.name,
                     numbers.scaling_efficiency ? fmt::format(", {:.0f}% scaling efficiency",
                                                              100 * *numbers.scaling_efficiency)
                                                : "");
}

ResultRows scale_table(const Session& session, const ScaleResult& numbers) {
  const ThroughputUnit unit(numbers.seq_len);
  ResultRows t;
  t.emplace_back("processes",
                 fmt::format("{} x {} ({}, {} thread(s) each)", numbers.world_size, numbers.device,
                             numbers.backend, numbers.threads_per_process));
  t.emplace_back(
      "global throughput",
      fmt::format("{:.0f} {}", numbers.global_samples_per_second * unit.per_sample, unit.name));
  std::string per_rank_line;
  for (const ScaleRank& r : numbers.per_rank) {
    per_rank_line += fmt::format("{}{:.0f}", per_rank_line.empty() ? "" : ", ",
                                 r.samples_per_second * unit.per_sample);
  }
  t.emplace_back("per-rank throughput", per_rank_line + " " + unit.name);
  t.emplace_back(
      "single process",
      numbers.baseline
          ? fmt::format("{:.0f} {} (rank 0 alone)",
                        numbers.baseline->samples_per_second * unit.per_sample, unit.name)
          : std::string("not measured"));
  t.emplace_back(
      "scaling efficiency",
      numbers.scaling_efficiency && numbers.speedup
          ? fmt::format("{:.1f}% (speedup {:.2f}x on {} processes)",
                        100 * *numbers.scaling_efficiency, *numbers.speedup, numbers.world_size)
          : std::string("n/a"));
  t.emplace_back("step time", fmt::format("median {:.2f} ms", 1e3 * numbers.median_step_seconds));
  t.emplace_back(
      "compute vs comm",
      fmt::format("compute {:.2f} ms/step, all-reduce in flight {:.2f} ms/step, exposed "
                  "{:.2f} ms/step ({:.1f}% of step)",
                  1e3 * numbers.compute_seconds_per_step, 1e3 * numbers.comm_busy_seconds_per_step,
                  1e3 * numbers.comm_exposed_seconds_per_step,
                  100 * numbers.comm_exposed_share_of_step));
  // Under FSDP nothing is replicated: each rank holds its own shard, and the hashes compared
  // are of the weights every rank all-gathered from the same shards, equal by construction. So
  // the line claims no check there.
  t.emplace_back("replicas",
                 session.fsdp ? "n/a (sharded: each rank holds its own shard; consolidated "
                                "weights " +
                                    numbers.weights_hash + ")"
                 : numbers.replicas_in_sync ? "in sync (weights " + numbers.weights_hash + ")"
                                            : std::string("DIFFER"));
  t.emplace_back("strategy", numbers.strategy + " (" + numbers.strategy_reason + ")");
  constexpr double kMiB = 1024.0 * 1024.0;
  if (!numbers.per_rank.empty() && numbers.per_rank[0].memory) {
    const ScaleRankMemory& mem = *numbers.per_rank[0].memory;
    auto mib = [&](std::optional<int64_t> bytes) {
      return bytes ? fmt::format("{:.2f}", static_cast<double>(*bytes) / kMiB) : std::string("n/a");
    };
    t.emplace_back(
        "memory per rank (rank 0)",
        fmt::format("peak {} MiB: parameters {} + gradients {} + optimizer {} MiB; gathered "
                    "parameters {} MiB at most; activations {} MiB",
                    mib(mem.peak), mib(mem.parameters), mib(mem.gradients),
                    mib(mem.optimizer_state), mib(mem.gathered_parameters_peak),
                    mib(mem.activations)));
    t.emplace_back("model state per rank",
                   fmt::format("ddp {:.2f} MiB, fsdp {:.2f} MiB (+ the largest unit gathered, "
                               "{:.2f} MiB)",
                               static_cast<double>(mem.model_state_ddp) / kMiB,
                               static_cast<double>(mem.model_state_fsdp) / kMiB,
                               static_cast<double>(mem.largest_gathered_unit) / kMiB));
  }
  return t;
}

RungResult scale_result(const Session& session, const ScaleOutcome& o) {
  ScaleResult numbers = scale_numbers(session, o);
  const std::vector<std::string> problems = gate_problems(session.job.config, o, numbers);
  numbers.status.passed = problems.empty();
  numbers.status.verdict = scale_verdict(numbers, problems);
  numbers.table = scale_table(session, numbers);
  return result_from_file(numbers);
}

}  // namespace kiln::scale_rung
