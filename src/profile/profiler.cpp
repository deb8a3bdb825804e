// The Profiler hook: Kineto driven on the schedule, user scopes for steps and phases, one trace
// file per active window.
//
// Kineto's profiler state is thread-local (as with torch.profiler in Python): the training
// thread records, and so does autograd (on CPU it runs backward on the calling thread; on CUDA
// its device threads inherit the state). The loader's worker threads inherit the thread-local
// state of the thread that starts them, so around enabling and disabling the profiler the
// workers are paused (they finish the batch in hand) and resumed: they join every window, and
// no worker operator can be running while Kineto finalizes the window's records.
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <unordered_map>

#include "core/files.h"
#include "core/process.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/profile.h"
#include "profile/trace_io.h"

namespace kiln {
namespace {

namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::string default_worker_name() {
  return fmt::format("{}_{}", hostname(), ::getpid());
}

int64_t unix_time_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

struct Profiler::Capture {
  ProfilerConfig config{ProfilerState::KINETO};
  std::set<ActivityType> activities;
  // Open user scopes on the training thread, outermost (the step) first.
  std::vector<std::unique_ptr<at::RecordFunction>> scopes;
  std::vector<Phase> phases;  // the phases among them, innermost last
};

Profiler::Profiler(ProfilerOptions options) : options_(std::move(options)) {
  if (options_.schedule.active < 1) {
    throw UserError(
        fmt::format("profile.active = {}: a schedule needs at least one active step; set "
                    "profile.active >= 1",
                    options_.schedule.active));
  }
  check_trace_directory(options_.dir);
  if (options_.worker_name.empty()) options_.worker_name = default_worker_name();
  // Kineto prints stage markers ("USDT: profiler_start") on stderr at its default level; keep
  // kiln's stderr to its own lines unless the user asked Kineto for logs.
  ::setenv("KINETO_LOG_LEVEL", "6", /*overwrite=*/0);
  capture_ = std::make_unique<Capture>();
  capture_->config =
      ProfilerConfig(ProfilerState::KINETO, options_.record_shapes, options_.profile_memory,
                     options_.with_stack, options_.with_flops, /*with_modules=*/false);
  capture_->activities.insert(ActivityType::CPU);
  if (options_.cuda) capture_->activities.insert(ActivityType::CUDA);
}

Profiler::~Profiler() {
  // Best effort, without the loader (the Trainer may be gone): drop an open window.
  try {
    close_scopes();
    if (recording_) (void)kineto::disableProfiler();
  } catch (...) {
  }
}

void Profiler::open_scope(const std::string& name) {
  auto scope = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (scope->isActive()) scope->before(name);
  capture_->scopes.push_back(std::move(scope));
}

void Profiler::close_scopes() {
  if (!capture_) return;
  while (!capture_->scopes.empty()) {
    capture_->scopes.back()->end();
    capture_->scopes.pop_back();
  }
  capture_->phases.clear();
}

void Profiler::on_step_begin(Trainer& trainer, int64_t /*step*/) {
  if (finished_) return;
  const ProfilerAction next = options_.schedule.action(profiler_step_);
  action_ = next;
  if (next == ProfilerAction::kNone) {
    if (recording_) stop_recording(trainer, /*save=*/true);
    if (prepared_) stop_recording(trainer, /*save=*/false);  // warm-up without a window
    return;
  }
  if (!prepared_) {
    try {
      kineto::prepareProfiler(capture_->config, capture_->activities);
    } catch (const c10::Error& e) {
      throw TrainingError(fmt::format("profiler: Kineto could not prepare a trace at step {}: {}",
                                      profiler_step_, e.what_without_backtrace()));
    }
    prepared_ = true;
  }
  if (next == ProfilerAction::kWarmup) return;
  if (!recording_) start_recording(trainer);
  open_scope(fmt::format("ProfilerStep#{}", profiler_step_));
}

void Profiler::on_phase_begin(Trainer&, Phase phase) {
  if (!recording_) return;
  open_scope(phase_name(phase));
  capture_->phases.push_back(phase);
}

void Profiler::on_phase_end(Trainer&, Phase phase) {
  if (!recording_ || capture_->phases.empty() || capture_->phases.back() != phase) return;
  capture_->scopes.back()->end();
  capture_->scopes.pop_back();
  capture_->phases.pop_back();
}

void Profiler::on_step_end(Trainer& trainer, const StepStats&) {
  if (finished_) return;
  if (recording_) {
    close_scopes();
    if (action_ == ProfilerAction::kRecordAndSave) stop_recording(trainer, /*save=*/true);
  }
  ++profiler_step_;
}

void Profiler::on_train_end(Trainer& trainer) {
  finish(trainer);
}

void Profiler::finish(Trainer& trainer) {
  if (finished_) return;
  finished_ = true;
  if (recording_) {
    stop_recording(trainer, /*save=*/true);
  } else if (prepared_) {
    stop_recording(trainer, /*save=*/false);
  }
}

void Profiler::start_recording(Trainer& trainer) {
  Trainer::PausedData paused(trainer);
  try {
    kineto::enableProfiler(capture_->config, capture_->activities);
  } catch (const c10::Error& e) {
    prepared_ = false;
    throw TrainingError(
        fmt::format("profiler: Kineto could not start recording at step {} ({}); "
                    "only one profiler may record at a time in a process",
                    profiler_step_, e.what_without_backtrace()));
  }
  recording_ = true;
}

void Profiler::stop_recording(Trainer& trainer, bool save) {
  close_scopes();
  if (!recording_) {
    // Prepared but never started (a warm-up that ends without recording): Kineto has no
    // "unprepare", so start and stop an empty window, as torch.profiler does.
    Trainer::PausedData paused(trainer);
    kineto::enableProfiler(capture_->config, capture_->activities);
    (void)kineto::disableProfiler();
    prepared_ = false;
    return;
  }
  if (options_.cuda) torch::cuda::synchronize();
  std::unique_ptr<kineto::ProfilerResult> result;
  {
    Trainer::PausedData paused(trainer);
    result = kineto::disableProfiler();
  }
  recording_ = false;
  prepared_ = false;
  if (!save || !result) return;

  // Kineto writes the Chrome trace; kiln adds FLOPs and distributedInfo, then compresses.
  const int64_t ns = unix_time_ns();
  const std::string stem = fmt::format("{}.{}.pt.trace.json", options_.worker_name, ns);
  const std::filesystem::path raw = options_.dir / ("." + stem + ".kineto");
  try {
    result->save(raw.string());
  } catch (const c10::Error& e) {
    throw UserError(fmt::format("profile.dir: Kineto could not write {} ({})", raw.string(),
                                e.what_without_backtrace()));
  }
  nlohmann::json trace;
  try {
    trace = read_trace(raw);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(raw, ec);
    throw;
  }
  std::error_code ec;
  std::filesystem::remove(raw, ec);

  if (options_.with_flops && trace.contains("traceEvents")) {
    // Kineto's JSON carries no FLOPs; its events() do. Match operators by correlation id, which
    // the trace records as "External id".
    std::unordered_map<uint64_t, uint64_t> flops_by_id;
    for (const auto& event : result->events()) {
      if (event.flops() > 0) flops_by_id[event.correlationId()] = event.flops();
    }
    if (!flops_by_id.empty()) {
      for (auto& event : trace["traceEvents"]) {
        if (!event.is_object() || event.value("cat", "") != "cpu_op") continue;
        auto args = event.find("args");
        if (args == event.end() || !args->contains("External id")) continue;
        const auto& id = (*args)["External id"];
        if (!id.is_number_integer()) continue;
        auto found = flops_by_id.find(id.get<uint64_t>());
        if (found != flops_by_id.end()) (*args)["flops"] = found->second;
      }
    }
  }
  if (options_.world_size > 1) {
    trace["distributedInfo"] = {{"backend", options_.backend},
                                {"rank", options_.rank},
                                {"world_size", options_.world_size}};
  }
  // Separators with a space, as Kineto writes them: Holistic Trace Analysis finds a trace's rank
  // with the pattern "rank":\s+(\d+) and takes a file without a match for rank 0.
  std::string bytes = trace.dump(0);
  std::filesystem::path path = options_.dir / stem;
  if (options_.gzip) {
    bytes = profile_detail::gzip_compress(bytes);
    path += ".gz";
  }
  write_file_atomic(path, bytes);
  traces_.push_back(path);
  log::info(fmt::format("profiler: window ending at step {} written to {}", profiler_step_,
                        path.string()));
}

}  // namespace kiln
