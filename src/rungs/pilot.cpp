// The pilot: pins, one full cycle at the production shape (train, evaluate, save, restore in a
// fresh process and compare), the measured peak memory of a full optimizer step beside the
// analytic estimate (docs/plan.md).
#include "kiln/pilot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>

#include "core/clock.h"
#include "core/files.h"
#include "core/pins.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/compile.h"
#include "kiln/data.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/memory.h"
#include "kiln/models.h"
#include "kiln/plan.h"
#include "kiln/results.h"
#include "kiln/rungs.h"
#include "plan/options.h"
#include "rungs/options.h"
#include "rungs/pilot_memory.h"

namespace kiln {
namespace {

using nlohmann::json;
using Clock = SteadyClock;

// Names of the tensors that differ between two checkpoints' lists: bitwise, or within a relative
// `tolerance` for floating-point tensors when it is > 0.
std::vector<std::string> differing(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                                   const std::vector<std::pair<std::string, torch::Tensor>>& b,
                                   double tolerance) {
  std::vector<std::string> out;
  std::map<std::string, torch::Tensor> by_name(b.begin(), b.end());
  for (const auto& [name, x] : a) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      out.push_back(name + " (missing after restore)");
      continue;
    }
    const auto& y = it->second;
    const bool same_layout = x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes();
    const bool equal =
        same_layout && (tolerance > 0 && x.is_floating_point()
                            ? torch::allclose(x, y, tolerance, tolerance * 1e-3)
                            : std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0);
    if (!equal) {
      out.push_back(name);
    }
  }
  return out;
}

// The device's dense peak for the job's precision: baseline.peak_flops_per_second when set,
// else the catalog row of the device, else 0 (unknown).
double device_peak_flops(const Config& config, const std::string& device_name,
                         const JobShape& job) {
  const double configured = PilotRungOptions::from_config(config).peak_flops_per_second;
  if (configured > 0) return configured;
  return catalog_peak_flops(config, device_name, job.precision);
}

// Fences on an async save's staging copy before the optimizer step, as kiln train's
// CheckpointHook does (kiln/checkpoint.h), and adds up how long that blocked: armed while
// `checkpointer` is set.
class PilotStagingFence final : public TrainerHook {
 public:
  void on_gradients_ready(Trainer&) override {
    if (checkpointer != nullptr && checkpointer->in_flight())
      waited_seconds += checkpointer->wait_for_staging();
  }
  Checkpointer* checkpointer = nullptr;
  double waited_seconds = 0;
};

// The median of `seconds` (the mean of the middle two for an even count); 0 when empty.
double pilot_median_seconds(std::vector<double> seconds) {
  if (seconds.empty()) return 0;
  std::sort(seconds.begin(), seconds.end());
  const size_t middle = seconds.size() / 2;
  return seconds.size() % 2 ? seconds[middle] : (seconds[middle - 1] + seconds[middle]) / 2;
}

std::string join_names(const std::vector<std::string>& names, size_t most) {
  std::string out;
  for (size_t k = 0; k < names.size() && k < most; ++k) out += (k ? ", " : "") + names[k];
  if (names.size() > most) out += fmt::format(" and {} more", names.size() - most);
  return out;
}

}  // namespace

std::vector<std::string> check_pins(const Config& config, const std::filesystem::path& manifest) {
  json pinned;
  try {
    pinned = json::parse(read_file(manifest));
  } catch (const json::exception& e) {
    throw UserError(fmt::format("{}: not JSON ({})", manifest.string(), e.what()));
  }
  if (!pinned.is_object() || !pinned.contains("manifest_version")) {
    throw UserError(fmt::format("{} is not a kiln manifest.json", manifest.string()));
  }
  apply_runtime_settings(config);  // the thread counts the manifest records
  const Datasets data = make_datasets(config);
  const auto model = make_model(config);
  // As the run recorded it: with run.name resolved (the hash of the config a run saves).
  json current =
      make_manifest(with_resolved_run_name(config), "", "", data.identity, model_identity(*model));
  if (pinned.contains("pins")) current["pins"] = environment_pins();
  return manifest_differences(pinned, current);
}

RungResult run_pilot(const Config& config, const SessionOptions& options) {
  const auto begin = Clock::now();
  RungResult result;
  result.rung = "pilot";
  const PilotRungOptions rung = PilotRungOptions::from_config(config);
  const int64_t steps = rung.steps;
  // The restore resumes the job's own schedule and trains to step pilot.steps + 1: within it.
  if (const int64_t train_steps = TrainOptions::from_config(config).steps;
      steps + 1 > train_steps) {
    throw UserError(fmt::format(
        "{}: pilot.steps = {} needs train.steps >= {} (the restore trains the job's schedule to "
        "step pilot.steps + 1), but train.steps = {}; raise train.steps or lower pilot.steps",
        config.source_name(), steps, steps + 1, train_steps));
  }
  const ModelShape shape = model_shape(config);
  JobShape job = job_shape(config);
  // The step it runs (plan.activation_checkpointing is the plan's what-if, not this job's).
  job.activation_checkpointing = TrainOptions::from_config(config).activation_checkpointing ==
                                 TrainOptions::ActivationCheckpointing::kBlock;

  check_compile_start(config);  // compile.backend: Python, torch, cache, before anything is written
  // The job's own step: with compile.backend set, the compiled step as `kiln train` runs it (and
  // as the restore child runs it), so the cycle proves the step production will run.
  SessionOptions composed = options;
  composed.compile = true;
  // dist.strategy = "auto": the layout of the production world (plan.gpus), scaled down to
  // this one's (the same tp and dp_shard, fewer replicas), so the memory measured is a production
  // rank's (docs/plan.md, "Pilot").
  composed.production_world_size =
      static_cast<int>(std::clamp<int64_t>(PlanInputs::from_config(config).plan_gpus, 0, 1 << 20));
  auto session = open_session(config, composed);
  Trainer& trainer = *session->trainer;
  const std::shared_ptr<CompiledStep> compiled = session->compiled;
  const int world = session->comm->world_size();
  job.world_size = world;
  const bool writer = session->comm->rank() == 0;
  const std::filesystem::path run_dir = session->run->dir();
  const std::filesystem::path pilot_dir = std::filesystem::absolute(run_dir / "pilot");

  // 1. Pins: the environment joins the manifest.
  json manifest = json::parse(read_file(run_dir / session->run->manifest_file()));
  manifest["pins"] = environment_pins();
  session->run->write_json(session->run->manifest_file(), manifest);

  // 2. Train at the production shape, every step synchronised (its time is the device's): the
  // first step is cold (it allocates the optimizer state; kernels, caches and the loader's queue
  // warm up), the second is the memory-measured one (its allocation meter slows it), the rest
  // are timed: their median is the step the plan forecasts from (docs/plan.md).
  log::info(fmt::format("pilot: {} steps at micro-batch {} x seq {} x accum {} on {} process(es)",
                        steps, job.micro_batch, job.seq_len, job.grad_accum_steps, world));
  // Every step and the evaluation go to the run's metrics file, the measured step marked.
  bool measuring = false;
  trainer.add_hook(std::make_shared<MetricsHook>(
      *session->run, [&](json& record) { record["measured"] = measuring; }, /*record_evals=*/true));
  const auto fence = std::make_shared<PilotStagingFence>();
  trainer.add_hook(fence);
  PilotStepTiming timing;
  timing.first_step_seconds = trainer.train_step(/*sync=*/true).step_seconds;
  job.strategy = std::string(to_string(session->strategy));
  job.tp = session->mesh.tp;  // the mesh it runs: the estimate is per rank of it
  job.dp_replicate = session->mesh.dp_replicate;
  double held_gradients = 0;
  if (session->fsdp) {
    held_gradients = static_cast<double>(session->fsdp->memory().gradient_shards);
  } else if (session->strategy ==
             Parallelism::kDdp) {  // the buckets: every trainable parameter's bytes
    for (const auto& p : trainer.model().parameters())
      if (p.requires_grad()) held_gradients += static_cast<double>(p.nbytes());
  }
  measuring = true;
  const StepMemory step_memory = measure_step_memory(trainer, session->device, held_gradients);
  measuring = false;
  timing.memory_step_seconds = step_memory.stats.step_seconds;
  for (int64_t k = 3; k <= steps; ++k) {
    const StepStats timed = trainer.train_step(/*sync=*/true);
    timing.steps.push_back(timed.step);
    timing.step_seconds.push_back(timed.step_seconds);
  }
  // The step's time: the timed steps' median; with pilot.steps = 2 there are none, and the
  // memory-measured step stands for it.
  StepStats measured = step_memory.stats;
  if (!timing.step_seconds.empty())
    measured.step_seconds = pilot_median_seconds(timing.step_seconds);
  timing.method =
      timing.step_seconds.empty()
          ? "the memory-measured step 2 alone (pilot.steps = 2: no step left to time; raise it)"
          : fmt::format(
                "the median of steps 3-{} ({} timed steps, synchronised); step 1 (cold) "
                "and step 2 (memory-measured) left out",
                steps, timing.step_seconds.size());
  const MemoryEstimate estimate = estimate_memory(shape, job);
  const MemoryComparison memory = compare_memory(step_memory, estimate, job);
  const double measured_peak = step_memory.peak_bytes();
  const double estimated_peak = estimate.step_peak();
  const double ratio = memory.ratio;
  const double activation_ratio = memory.working_ratio;

  const std::string device_name = manifest_device_name(
      manifest, session->device.is_cuda() ? static_cast<int>(session->device.index()) : -1);
  const double peak_flops = device_peak_flops(config, device_name, job);
  // The step's tokens: each data-parallel rank's batch (a tensor-parallel group shares one).
  const double flops_per_step =
      train_flops_per_token(shape, job.seq_len) *
      static_cast<double>(job.micro_batch * job.seq_len * job.grad_accum_steps * world /
                          std::max(1, session->mesh.tp));
  const double mfu = peak_flops > 0 ? flops_per_step / measured.step_seconds /
                                          (static_cast<double>(world) * peak_flops)
                                    : 0;
  // The device's achievable matmul at the job's shape and precision, timed (kiln/plan.h): the
  // plan's peak for this device, and an MFU that means something where no catalog row does.
  const MatmulPeak matmul =
      measure_matmul_peak(job_matmul_shape(shape, job), job.precision, session->device.str());
  const double mfu_of_matmul = matmul.flops_per_second > 0
                                   ? flops_per_step / measured.step_seconds /
                                         (static_cast<double>(world) * matmul.flops_per_second)
                                   : 0;

  // 3. Save synchronously (the time is the whole save: the write speed), then one more step here,
  // saved asynchronously as kiln train's CheckpointHook saves with checkpoint.async: training
  // blocks for the capture and the save call, then, in the next step, for what is left of the
  // staging copy to host memory when its optimizer step comes (the fence; the copy runs beside
  // that step's forward and backward); the write runs beside training. One more step here is
  // that next step (its state is not compared: the restore compares the saved step).
  // 4. Evaluate once (timed), then wait for the async save to finish (timed): a run's last save
  // is finished so, after its final evaluation, and the wait (what of the write and commit the
  // evaluation did not cover, and the save's bookkeeping) is part of what a save costs.
  if (writer) std::filesystem::remove_all(pilot_dir);
  CheckpointOptions ckpt = session->job.checkpoint.store;
  const CheckpointRecord& record = session->job.checkpoint.record;
  ckpt.dir = pilot_dir / "checkpoints";
  ckpt.async = false;
  ckpt.background_staging = false;
  ckpt.keep_last_k = 3;
  double save_seconds = 0, checkpoint_bytes = 0, save_blocking_seconds = 0;
  double save_end_wait_seconds = 0, eval_seconds = 0;
  EvalStats eval;
  double reference_loss = 0;
  {
    Checkpointer checkpointer(ckpt, *session->comm);
    auto save_begin = Clock::now();
    auto handle = checkpointer.save(capture_training_state(trainer, *session->comm, record));
    checkpointer.wait();
    handle->rethrow_if_failed();
    save_seconds = seconds_since(save_begin);
    checkpoint_bytes = static_cast<double>(handle->stats().total_bytes);
  }
  reference_loss = trainer.train_step(/*sync=*/true).loss;
  {
    CheckpointOptions async_ckpt = ckpt;
    async_ckpt.async = true;
    async_ckpt.background_staging = true;
    Checkpointer checkpointer(async_ckpt, *session->comm);
    auto blocking_begin = Clock::now();
    auto after = checkpointer.save(capture_training_state(trainer, *session->comm, record));
    save_blocking_seconds = seconds_since(blocking_begin);
    fence->checkpointer = &checkpointer;
    trainer.train_step(/*sync=*/true);
    fence->checkpointer = nullptr;
    save_blocking_seconds += fence->waited_seconds;
    const auto eval_begin = Clock::now();
    eval = trainer.evaluate();
    eval_seconds = seconds_since(eval_begin);
    const auto wait_begin = Clock::now();
    checkpointer.wait();
    save_end_wait_seconds = seconds_since(wait_begin);
    after->rethrow_if_failed();
  }
  const int64_t saved_step = steps, final_step = steps + 1;
  // The restore child starts after this process has freed its model and optimizer state.
  session->trainer.reset();

  // 5. Restore in a fresh process, one more step there, compare. Under torchrun every rank starts
  // its own child and the children meet in a fresh world (a new port, their own store), so the
  // restore runs at the production world size as well.
  PilotRestore restore;
  restore.step = saved_step;
  restore.world_size = world;
  std::vector<std::string> problems;
  if (writer) write_file_atomic(pilot_dir / "config.toml", config.to_toml(/*with_docs=*/false));
  std::vector<std::pair<std::string, std::string>> child_env;
  if (world > 1) {
    // Also the barrier after which rank 0's config.toml exists for every rank.
    const std::string port = session->comm->all_gather_bytes(
        writer ? std::to_string(free_tcp_port()) : std::string())[0];
    child_env = {{"MASTER_PORT", port}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}};
  }
  const std::filesystem::path restore_log =
      pilot_dir / (session->comm->rank() == 0
                       ? std::string("restore.log")
                       : fmt::format("restore-rank{}.log", session->comm->rank()));
  std::vector<std::string> args = {
      kiln_executable().string(),
      "train",
      (pilot_dir / "config.toml").string(),
      "--set",
      "run.dir=" + pilot_dir.string(),
      "--set",
      "run.name=restore",
      "--set",
      "run.progress=log",
      "--set",
      "train.stop_after_step=" + std::to_string(final_step),  // the job's schedule, cut short
      "--set",
      "train.eval_every=0",
      "--set",
      "checkpoint.dir=" + (pilot_dir / "restore" / "checkpoints").string(),
      "--set",
      "checkpoint.every_steps=" + std::to_string(final_step),
      "--resume",
      checkpoint_step_dir(ckpt.dir, saved_step).string()};
  // The restore runs the mesh this process ran (auto's choice for plan.gpus included: the
  // child is no pilot and would choose for its own world).
  if (world > 1) {
    const bool fsdp = session->strategy == Parallelism::kFsdp;
    args.insert(args.end(), {"--set", fmt::format("dist.strategy={}", fsdp ? "fsdp" : "ddp"),
                             "--set", fmt::format("dist.tp={}", session->mesh.tp)});
    if (fsdp) {
      args.insert(args.end(),
                  {"--set", fmt::format("dist.dp_replicate={}", session->mesh.dp_replicate)});
    }
  }
  auto restore_begin = Clock::now();
  int code = wait_process(spawn_process(args, restore_log, child_env));
  restore.seconds = seconds_since(restore_begin);
  if (world > 1) {  // every rank's exit status, in rank order
    const auto codes = session->comm->all_gather_bytes(std::to_string(code));
    restore.exit_status_by_rank.emplace();
    for (size_t r = 0; r < codes.size(); ++r) {
      const int rank_code = std::stoi(codes[r]);
      restore.exit_status_by_rank->push_back(rank_code);
      if (rank_code != 0 && code == 0) code = rank_code;
      if (rank_code != 0) {
        problems.push_back(fmt::format("rank {}'s restore process exited with {} (see {})", r,
                                       rank_code,
                                       (pilot_dir / (r == 0 ? std::string("restore.log")
                                                            : fmt::format("restore-rank{}.log", r)))
                                           .string()));
      }
    }
  } else if (code != 0) {
    problems.push_back(
        fmt::format("the restore process exited with {} (see {})", code, restore_log.string()));
  }
  restore.exit_status = code;
  // CPU kernels are deterministic: bitwise. CUDA's atomics (e.g. the embedding's backward) are
  // not: there the continued step agrees within a relative tolerance, stated in pilot.json.
  const double tolerance = session->device.is_cuda() ? 1e-4 : 0.0;
  restore.tolerance = tolerance;
  if (code == 0 && writer) {
    const auto losses = read_step_losses(pilot_dir / "restore" / "metrics.jsonl");
    auto it = losses.find(final_step);
    const bool loss_equal =
        it != losses.end() && std::abs(it->second - reference_loss) <=
                                  tolerance * std::max(std::abs(reference_loss), 1e-12);
    restore.loss_here = reference_loss;
    if (it != losses.end()) restore.loss_restored = it->second;
    restore.loss_equal = loss_equal;
    restore.loss_bitwise_equal = it != losses.end() && it->second == reference_loss;
    const auto here = checkpoint_step_dir(ckpt.dir, final_step);
    const auto there = checkpoint_step_dir(pilot_dir / "restore" / "checkpoints", final_step);
    std::vector<std::string> names;
    for (const char* prefix : {"model/", "optim/"}) {
      for (auto& n : differing(read_checkpoint_tensors(here, prefix, true),
                               read_checkpoint_tensors(there, prefix, true), tolerance)) {
        names.push_back(std::move(n));  // the checkpoint's own name: "model/...", "optim/..."
      }
    }
    restore.differing_tensors = names;
    if (!loss_equal) {
      problems.push_back(fmt::format(
          "the restored step {} loss differs ({} here, {} restored)", final_step, reference_loss,
          restore.loss_restored ? fmt::format("{}", *restore.loss_restored) : "none"));
    }
    if (!names.empty()) {
      problems.push_back(fmt::format("restore check failed: {} tensor(s) differ after step {}: {}",
                                     names.size(), final_step, join_names(names, 8)));
    }
  }
  if (world > 1) {  // rank 0 compared; every rank reports its finding
    // (a transport between the ranks, not a file: the restore's typed JSON and the problems)
    const json shared = json::parse(session->comm->all_gather_bytes(
        writer ? json::array({json(restore), problems}).dump() : std::string())[0]);
    restore = shared.at(0).get<PilotRestore>();
    problems = shared.at(1).get<std::vector<std::string>>();
  }
  restore.passed = problems.empty();
  // A restart as the user pays it: the child's process start, restore and first step. Its end
  // (which `kiln train` adds) is taken out at this process's measured times: with
  // checkpoint.async the save at its step blocks, the final evaluation runs while it is written
  // and the save is waited for after it (as measured above); else the whole save, then the
  // evaluation.
  const bool async_save = session->job.checkpoint.store.async;
  const double child_end = async_save ? save_blocking_seconds + eval_seconds + save_end_wait_seconds
                                      : save_seconds + eval_seconds;
  restore.recovery_seconds = std::max(0.0, restore.seconds - child_end);

  const double max_error = rung.max_estimate_error;
  const bool estimate_ok = std::abs(ratio - 1.0) <= max_error;
  if (!estimate_ok) {
    problems.push_back(fmt::format(
        "the memory estimate is off: {} measured vs {} estimated (ratio {:.2f}, outside 1 +- "
        "{:.2f}, pilot.max_estimate_error); the part that differs most: {}",
        format_bytes(measured_peak), format_bytes(estimated_peak), ratio, max_error, memory.worst));
  }
  // pilot.json, written once through its typed result.
  PilotResult out;
  out.job_hash = job_hash(config);
  out.config_hash = config.hash();
  out.device = session->device.str();
  out.device_name = device_name;
  out.world_size = world;
  out.micro_batch = job.micro_batch;
  out.seq_len = job.seq_len;
  out.grad_accum_steps = job.grad_accum_steps;
  out.precision = job.precision;
  out.steps = steps;
  out.compile_backend = backend_name(session->job.compile.backend);
  out.step_seconds = measured.step_seconds;
  out.loss = measured.loss;
  out.flops_per_step = flops_per_step;
  if (peak_flops > 0) out.peak_flops_per_second = peak_flops;
  if (mfu > 0) out.mfu = mfu;
  out.matmul_peak = {matmul.flops_per_second, matmul.shape.m, matmul.shape.n,
                     matmul.shape.k,          matmul.dtype,   matmul.median_seconds,
                     matmul.repeats};
  out.mfu_of_matmul_peak = mfu_of_matmul;
  out.eval_seconds = eval_seconds;
  out.val_loss = eval.loss;
  out.checkpoint_bytes = checkpoint_bytes;
  out.save_seconds = save_seconds;
  out.write_bytes_per_second = save_seconds > 0 ? checkpoint_bytes / save_seconds : 0.0;
  out.checkpoint_async = async_save;
  out.save_blocking_seconds = save_blocking_seconds;
  out.save_end_wait_seconds = save_end_wait_seconds;
  out.step_timing = timing;
  out.memory_method = session->device.is_cuda()
                          ? "CUDA max_memory_allocated over the measured step"
                          : "peak of live tensor bytes over the measured step (kiln::MemoryMeter) "
                            "plus the parameters and optimizer state held across steps";
  out.measured = {step_memory.parameters_bytes, step_memory.gradients_after_step_bytes,
                  step_memory.optimizer_bytes, step_memory.step_peak_bytes, measured_peak};
  out.measured_held_gradient_bytes = step_memory.held_gradient_bytes;
  out.measured_step_peak_above_state_bytes = step_memory.step_peak_bytes;
  if (step_memory.process_peak_rss_bytes >= 0)
    out.measured_process_peak_rss_bytes = step_memory.process_peak_rss_bytes;
  if (step_memory.reserved_bytes >= 0) out.measured_reserved_bytes = step_memory.reserved_bytes;
  out.memory_parts = memory.parts;
  out.memory_differs_most = memory.worst;
  out.estimated = {estimate.parameters, estimate.gradients, estimate.optimizer,
                   estimate.activations + estimate.logits, estimated_peak};
  out.estimated_activations_bytes = estimate.activations;
  out.estimated_logits_bytes = estimate.logits;
  // The estimate's other keys, as src/plan lays them out (the typed keys above are written from
  // the typed fields).
  out.estimate_more = to_json(estimate);
  out.estimated.step_peak = estimated_peak;
  out.measured_over_estimate = ratio;
  out.activation_ratio = activation_ratio;
  out.within_allowed_error = estimate_ok;
  out.restore = restore;
  out.wall_seconds = seconds_since(begin);
  result.passed = problems.empty();
  result.verdict =
      result.passed ? fmt::format(
                          "full cycle at the production shape: {} steps, eval, save, restore in a "
                          "fresh process{}; peak {} measured vs {} estimated ({:.2f}x)",
                          steps,
                          world == 1 ? (tolerance > 0 ? " equal" : " bitwise equal")
                                     : fmt::format(" at world {}{}", world,
                                                   tolerance > 0 ? ", equal" : ", bitwise equal"),
                          format_bytes(measured_peak), format_bytes(estimated_peak), ratio)
                    : problems.front();
  out.status = {kResultSchemaVersion, result.passed, result.verdict, /*measured=*/true};
  result.numbers = out;
  auto& t = result.table;
  t.emplace_back("shape", fmt::format("micro-batch {} x seq {} x accum {} x {} process(es), {}",
                                      job.micro_batch, job.seq_len, job.grad_accum_steps, world,
                                      job.precision));
  t.emplace_back(
      "step",
      fmt::format("{}{}{}{}", format_duration(measured.step_seconds),
                  timing.step_seconds.empty()
                      ? std::string(" (the memory-measured step)")
                      : fmt::format(" (median of {} steps)", timing.step_seconds.size()),
                  fmt::format("{}, {:.1f}% of the measured matmul ({:.3g} FLOP/s)",
                              mfu > 0 ? fmt::format(", MFU {:.1f}%", 100 * mfu) : "",
                              100 * mfu_of_matmul, matmul.flops_per_second),
                  session->job.compile.backend != CompileOptions::Backend::kEager
                      ? fmt::format(", compiled ({})", backend_name(session->job.compile.backend))
                      : ""));
  t.emplace_back("peak memory",
                 fmt::format("{} measured, {} estimated, ratio {:.2f}", format_bytes(measured_peak),
                             format_bytes(estimated_peak), ratio));
  t.emplace_back("memory parts", memory.table_text);
  if (step_memory.process_peak_rss_bytes >= 0) {
    t.emplace_back("process peak RSS", format_bytes(step_memory.process_peak_rss_bytes) +
                                           " (mostly LibTorch itself at small sizes)");
  }
  t.emplace_back("eval", format_duration(eval_seconds));
  t.emplace_back(
      "save",
      fmt::format(
          "{} in {} ({}/s); an async save blocks training {}, then {} waiting for it to finish "
          "after an evaluation{}",
          format_bytes(checkpoint_bytes), format_duration(save_seconds),
          format_bytes(save_seconds > 0 ? checkpoint_bytes / save_seconds : 0),
          format_duration(save_blocking_seconds), format_duration(save_end_wait_seconds),
          async_save ? " (checkpoint.async: the plan's stall)" : ""));
  t.emplace_back("restore",
                 restore.passed
                     ? fmt::format("step {} restored in {} fresh process{}: loss and tensors {}",
                                   final_step, world, world == 1 ? "" : "es",
                                   tolerance > 0 ? fmt::format("within {:g} relative", tolerance)
                                                 : "bitwise equal")
                     : problems.front());
  session->run->write_json("pilot.json", json(out));
  return result;
}

}  // namespace kiln
