// The scale rung: data-parallel throughput against a single-process baseline, and where the time
// goes (compute against communication). See scale.h for the procedure, docs/scale.md for
// scale.json.
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <numeric>

#include "core/clock.h"
#include "core/files.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/rungs.h"

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

// ---- launching torchrun from a single process (the ladder)
// ----------------------------------------

bool is_executable(const std::filesystem::path& path) {
  std::error_code ec;
  return !path.empty() && ::access(path.c_str(), X_OK) == 0 &&
         std::filesystem::is_regular_file(path, ec);
}

std::filesystem::path find_torchrun(const Config& config) {
  const std::string& configured = config.get_string("dist.torchrun");
  if (!configured.empty()) {
    if (!is_executable(configured)) {
      throw UserError("dist.torchrun = \"" + configured +
                      "\" is not an executable file; point it at "
                      "torchrun (it comes with the torch package: <venv>/bin/torchrun)");
    }
    return configured;
  }
  if (const char* path = std::getenv("PATH")) {
    std::string_view rest(path);
    while (!rest.empty()) {
      const size_t colon = rest.find(':');
      const std::filesystem::path candidate =
          std::filesystem::path(rest.substr(0, colon)) / "torchrun";
      if (is_executable(candidate)) return candidate;
      rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    }
  }
  const auto exe_dir = kiln_executable().parent_path();
  for (const auto& candidate :
       {exe_dir.parent_path() / ".venv/bin/torchrun", exe_dir / ".venv/bin/torchrun"}) {
    if (is_executable(candidate)) return candidate;
  }
  throw UserError(
      "the scale rung needs torchrun (it comes with the torch package) and found none "
      "on PATH or in .venv/bin next to the build; set dist.torchrun = \"/path/to/torchrun\"");
}

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

// Runs the rung under `torchrun --standalone` and reads back what rank 0 wrote. The ranks are
// their own run (manifest, config.toml, metrics.jsonl, train.log) in <run dir>/scale/, so the
// caller's run directory (the ladder's) keeps its files; <run dir>/scale.json is a copy of theirs.
RungResult launch_with_torchrun(const Config& config, int processes) {
  const std::filesystem::path run_dir = run_directory(config);
  const std::filesystem::path ranks_dir = run_dir / "scale";
  std::error_code ec;
  std::filesystem::create_directories(ranks_dir, ec);
  if (ec) {
    throw UserError(fmt::format("cannot create {} for the scale rung's ranks: {}; check run.dir",
                                ranks_dir.string(), ec.message()));
  }
  // The children load the resolved config, told to write into <run dir>/scale/.
  Config child = config;
  child.set("run.dir", run_dir.string());
  child.set("run.name", std::string("scale"));
  const auto launch_config = ranks_dir / "scale-launch.toml";
  write_file_atomic(launch_config, child.to_toml(false));
  const auto ranks_json = ranks_dir / "scale.json";
  const auto scale_json = run_dir / "scale.json";
  for (const auto& stale : {ranks_json, scale_json}) {
    std::filesystem::remove(stale, ec);
    if (ec) {
      throw UserError(fmt::format("cannot remove the previous {}: {}; delete it and rerun",
                                  stale.string(), ec.message()));
    }
  }

  const std::vector<std::string> argv = {find_torchrun(config).string(),
                                         "--standalone",
                                         fmt::format("--nproc-per-node={}", processes),
                                         "--no-python",
                                         kiln_executable().string(),
                                         "scale",
                                         launch_config.string(),
                                         "--quiet"};
  std::string line;
  for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
  log::info("scale: launching " + line);
  const int status = wait_process(spawn_process(argv));
  const bool wrote = std::filesystem::exists(ranks_json, ec);
  if (wrote) {
    json numbers = read_scale_json(ranks_json);
    numbers["ranks_run_dir"] = ranks_dir.string();
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
      status, (ranks_dir / "train.log").string());
  result.numbers = {{"passed", false},
                    {"verdict", result.verdict},
                    {"torchrun_status", status},
                    {"ranks_run_dir", ranks_dir.string()}};
  write_file_atomic(scale_json, result.numbers.dump(2) + "\n");
  return result;
}

}  // namespace

RungResult run_scale(Session& session) {
  Trainer& trainer = *session.trainer;
  const Config& config = session.config;
  Communicator& comm = *session.comm;
  const int rank = comm.rank(), world = comm.world_size();
  const int64_t warmup = config.get_int("dist.scale_warmup_steps");
  const int64_t measured = config.get_int("dist.scale_steps");
  const int64_t baseline_steps = world > 1 ? config.get_int("dist.scale_baseline_steps") : 0;
  const int64_t seq_len = trainer.data().train->tokens_per_sample();
  RungResult result;
  result.rung = "scale";

  // 1. The single-process baseline: rank 0 alone, the others waiting in a barrier.
  Baseline baseline;
  if (baseline_steps > 0) {
    log::info(
        fmt::format("scale: single-process baseline on rank 0 ({} + up to {} steps); the other "
                    "ranks wait",
                    warmup, baseline_steps));
    if (rank == 0) {
      baseline = measure_single_process(config, session.device, warmup, baseline_steps,
                                        0.5 * config.get_float("dist.timeout_seconds"));
    }
    comm.barrier();
    const json mine = rank == 0 ? json{{"sps", baseline.samples_per_second},
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
  }

  // 2. Data-parallel steps.
  log::info(fmt::format(
      "scale: {} ranks ({}), {} warm-up + {} measured steps, {} samples per rank per "
      "micro-batch",
      world, comm.backend_name(), warmup, measured, config.get_int("train.batch_size")));
  auto timer = std::make_shared<PhaseTimer>();
  trainer.add_hook(timer);
  std::vector<double> losses, step_seconds;
  int64_t samples = 0;
  std::string failure;
  double cpu_begin = 0, cpu_seconds = 0;
  CommunicationStats before, after;
  try {
    for (int64_t k = 0; k < warmup; ++k) losses.push_back(trainer.train_step().loss);
    before = comm.stats();
    timer->measuring = true;
    cpu_begin = process_cpu_seconds();
    for (int64_t k = 0; k < measured; ++k) {
      StepStats s = trainer.train_step();
      losses.push_back(s.loss);
      step_seconds.push_back(s.step_seconds);
      samples += s.samples / world;  // s.samples counts every rank
      session.run->append_metrics({{"step", s.step},
                                   {"loss", s.loss},
                                   {"lr", s.lr},
                                   {"grad_norm", s.grad_norm},
                                   {"step_seconds", s.step_seconds},
                                   {"data_wait_seconds", s.data_wait_seconds},
                                   {"measured", true}});
    }
    timer->measuring = false;
    cpu_seconds = process_cpu_seconds() - cpu_begin;
    after = comm.stats();
  } catch (const CommunicationError&) {
    throw;
  } catch (const TrainingError& e) {
    failure = e.what();
  }

  // 3. The replicas must still agree bit for bit.
  const std::vector<std::string> hashes = comm.all_gather_bytes(weights_hash(trainer.model()));
  const bool in_sync =
      std::all_of(hashes.begin(), hashes.end(), [&](const auto& h) { return h == hashes[0]; });

  // Per-rank numbers, gathered on every rank (each needs the same verdict).
  const double seconds = std::accumulate(step_seconds.begin(), step_seconds.end(), 0.0);
  auto phase = [&](Phase p) { return timer->seconds.count(p) ? timer->seconds[p] : 0.0; };
  const double compute =
      phase(Phase::kForward) + phase(Phase::kBackward) + phase(Phase::kOptimizer);
  const json comm_delta = stats_delta(before, after);
  const double busy = comm_delta["busy_seconds"].get<double>();
  json mine = {
      {"rank", rank},
      {"local_rank", comm.local_rank()},
      {"samples", samples},
      {"seconds", seconds},
      {"cpu_seconds", cpu_seconds},
      {"samples_per_second", seconds > 0 ? static_cast<double>(samples) / seconds : 0.0},
      {"step_seconds",
       {{"median", percentile(step_seconds, 0.5)},
        {"p10", percentile(step_seconds, 0.1)},
        {"p90", percentile(step_seconds, 0.9)}}},
      {"phase_seconds",
       {{"data_wait", phase(Phase::kDataWait)},
        {"forward", phase(Phase::kForward)},
        {"backward", phase(Phase::kBackward)},
        {"comm_exposed", phase(Phase::kComm)},
        {"optimizer", phase(Phase::kOptimizer)}}},
      {"compute_seconds", compute},
      {"comm", comm_delta},
      {"comm_overlapped_share",
       busy > 0 ? std::clamp(1.0 - phase(Phase::kComm) / busy, 0.0, 1.0) : 0.0},
  };
  if (seq_len > 0)
    mine["tokens_per_second"] =
        mine["samples_per_second"].get<double>() * static_cast<double>(seq_len);
  json per_rank = json::array();
  for (const auto& text : comm.all_gather_bytes(mine.dump())) per_rank.push_back(json::parse(text));

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
  const bool have_baseline = baseline.measured && baseline.samples_per_second > 0;
  const double efficiency = have_baseline ? global_sps / (world * baseline.samples_per_second) : 0;
  const double min_efficiency = config.get_float("dist.min_scaling_efficiency");
  const bool finite = failure.empty() && std::all_of(losses.begin(), losses.end(),
                                                     [](double l) { return std::isfinite(l); });
  const double median_step = percentile(step_seconds, 0.5);
  const DataParallelOptions buckets = data_parallel_options(config);

  json numbers = {
      {"world_size", world},
      {"backend", comm.backend_name()},
      {"device", session.device.str()},
      {"threads_per_process", at::get_num_threads()},
      {"batch_size_per_process", config.get_int("train.batch_size")},
      {"grad_accum_steps", config.get_int("train.grad_accum_steps")},
      {"global_batch_samples",
       config.get_int("train.batch_size") * config.get_int("train.grad_accum_steps") * world},
      {"seq_len", seq_len},
      {"warmup_steps", warmup},
      {"measured_steps", measured},
      {"bucket_cap_bytes",
       {{"first", buckets.first_bucket_bytes}, {"other", buckets.bucket_bytes}}},
      {"global",
       {{"samples_per_second", global_sps},
        {"tokens_per_second",
         seq_len > 0 ? json(global_sps * static_cast<double>(seq_len)) : json(nullptr)},
        {"median_step_seconds", median_step},
        {"compute_seconds_per_step",
         compute_sum / static_cast<double>(world * std::max<int64_t>(1, measured))},
        {"comm_busy_seconds_per_step",
         busy_sum / static_cast<double>(world * std::max<int64_t>(1, measured))},
        {"comm_exposed_seconds_per_step",
         exposed_sum / static_cast<double>(world * std::max<int64_t>(1, measured))},
        {"comm_exposed_share_of_step", seconds_sum > 0 ? exposed_sum / seconds_sum : 0.0}}},
      {"baseline", have_baseline ? json{{"method",
                                         "rank 0 alone, a fresh copy of the job with the same "
                                         "per-process batch, threads and device, no "
                                         "communication; the other ranks idle in a barrier"},
                                        {"samples_per_second", baseline.samples_per_second},
                                        {"median_step_seconds", baseline.median_step_seconds},
                                        {"steps", baseline.steps},
                                        {"note", baseline.note}}
                                 : json(nullptr)},
      {"scaling_efficiency", have_baseline ? json(efficiency) : json(nullptr)},
      {"speedup", have_baseline ? json(global_sps / baseline.samples_per_second) : json(nullptr)},
      {"replicas_in_sync", in_sync},
      {"weights_hash", hashes[0]},
      {"losses", losses},
      {"per_rank", per_rank},
  };

  std::vector<std::string> problems;
  if (!finite) problems.push_back(failure.empty() ? "non-finite loss" : failure);
  if (!in_sync)
    problems.push_back(
        "the replicas' weights differ after training (gradients were not averaged identically)");
  if (have_baseline && efficiency < min_efficiency) {
    problems.push_back(
        fmt::format("scaling efficiency {:.1f}% is below dist.min_scaling_efficiency {:.1f}%",
                    100 * efficiency, 100 * min_efficiency));
  }
  const std::string unit = seq_len > 0 ? "tokens/s" : "samples/s";
  const double per_sample = seq_len > 0 ? static_cast<double>(seq_len) : 1.0;
  result.passed = problems.empty();
  result.verdict =
      result.passed
          ? fmt::format(
                "{} ranks in sync, {:.0f} {}{}", world, global_sps * per_sample, unit,
                have_baseline ? fmt::format(", {:.0f}% scaling efficiency", 100 * efficiency) : "")
          : problems.front();

  auto& t = result.table;
  t.emplace_back("processes",
                 fmt::format("{} x {} ({}, {} thread(s) each)", world, session.device.str(),
                             comm.backend_name(), at::get_num_threads()));
  t.emplace_back("global throughput", fmt::format("{:.0f} {}", global_sps * per_sample, unit));
  std::string per_rank_line;
  for (const auto& r : per_rank) {
    per_rank_line += fmt::format("{}{:.0f}", per_rank_line.empty() ? "" : ", ",
                                 r["samples_per_second"].get<double>() * per_sample);
  }
  t.emplace_back("per-rank throughput", per_rank_line + " " + unit);
  t.emplace_back("single process", have_baseline
                                       ? fmt::format("{:.0f} {} (rank 0 alone)",
                                                     baseline.samples_per_second * per_sample, unit)
                                       : std::string("not measured"));
  t.emplace_back("scaling efficiency",
                 have_baseline
                     ? fmt::format("{:.1f}% (speedup {:.2f}x on {} processes)", 100 * efficiency,
                                   global_sps / baseline.samples_per_second, world)
                     : std::string("n/a"));
  t.emplace_back("step time", fmt::format("median {:.2f} ms", 1e3 * median_step));
  t.emplace_back("compute vs comm",
                 fmt::format("compute {:.2f} ms/step, all-reduce in flight {:.2f} ms/step, exposed "
                             "{:.2f} ms/step ({:.1f}% of step)",
                             1e3 * numbers["global"]["compute_seconds_per_step"].get<double>(),
                             1e3 * numbers["global"]["comm_busy_seconds_per_step"].get<double>(),
                             1e3 * numbers["global"]["comm_exposed_seconds_per_step"].get<double>(),
                             100 * numbers["global"]["comm_exposed_share_of_step"].get<double>()));
  t.emplace_back("replicas",
                 in_sync ? "in sync (weights " + hashes[0] + ")" : std::string("DIFFER"));
  numbers["passed"] = result.passed;
  numbers["verdict"] = result.verdict;
  json table = json::array();
  for (const auto& [k, v] : t) table.push_back({k, v});
  numbers["table"] = table;
  result.numbers = numbers;
  session.run->write_json("scale.json", numbers);
  return result;
}

RungResult run_scale_rung(const Config& config, const SessionOptions& options) {
  auto comm = options.comm ? options.comm : process_communicator(config);
  const int processes = static_cast<int>(config.get_int("dist.scale_processes"));
  if (comm->world_size() == 1 && processes > 1) return launch_with_torchrun(config, processes);
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
