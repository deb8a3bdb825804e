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
#include "rungs/scale_parts.h"

namespace kiln::scale_rung {

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
  numbers["schema_version"] = kResultSchemaVersion;
  checked_result<ScaleResult>(numbers);  // the report's reader reads what the rung wrote
  result.numbers = numbers;
  return result;
}

}  // namespace kiln::scale_rung
