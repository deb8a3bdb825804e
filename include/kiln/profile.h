// The profile rung: Kineto capture from C++ on a torch.profiler-style schedule, trace files that
// TensorBoard's profiler plugin and Perfetto open, an analysis of those traces (top operators,
// step phases, peak memory by phase, the GPU temporal breakdown of Holistic Trace Analysis) and
// a bottleneck verdict with concrete actions.
//
// Capture: a Profiler is a TrainerHook. Each step it asks its ProfileSchedule what to do
// (nothing, warm up, record, record and save), annotates recorded steps `ProfilerStep#N` and the
// Trainer's phases as user scopes (`data_wait`, `forward`, `backward`, `optimizer`, `comm`,
// `checkpoint`, `eval`), and at the end of each active window writes
// <dir>/<worker>.<ns>.pt.trace.json[.gz]. Operators run by the loader's worker threads are
// recorded too: the loader's workers are restarted around each window so they inherit the
// profiler's thread-local state (Loader::pause_workers / resume_workers).
//
// Analysis works on the trace files alone, so it also reads traces written by Python's
// torch.profiler. docs/profile.md documents every number and the verdict thresholds.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/train.h"

namespace kiln {

class Config;

// ---- schedule -----------------------------------------------------------------------------------

/// What the profiler does during one step (torch.profiler.ProfilerAction).
enum class ProfilerAction { kNone, kWarmup, kRecord, kRecordAndSave };
/// "none", "warmup", "record", "record_and_save".
const char* profiler_action_name(ProfilerAction action);

/// torch.profiler.schedule semantics: the first `skip_first` steps do nothing; then cycles of
/// `wait` steps off, `warmup` steps prepared but not recorded, `active` steps recorded, the last
/// of which saves the window; `repeat` cycles (0 = cycles until profiling stops).
struct ProfileSchedule {
  int64_t skip_first = 0;
  int64_t wait = 0;
  int64_t warmup = 0;
  int64_t active = 1;  // >= 1
  int64_t repeat = 0;  // 0 = unbounded
  /// The action for profiler step `step` (0-based, counted from when profiling started). Pure.
  /// Throws std::invalid_argument for a negative step or active < 1.
  ProfilerAction action(int64_t step) const;
  /// Steps after which the last window has been saved; -1 when repeat = 0.
  int64_t total_steps() const;
};

// ---- capture ------------------------------------------------------------------------------------

struct ProfilerOptions {
  std::filesystem::path dir;  // trace directory (created if missing)
  ProfileSchedule schedule;
  bool record_shapes = true;
  bool profile_memory = true;
  bool with_stack = false;
  bool with_flops = true;
  bool gzip = true;   // .pt.trace.json.gz instead of .pt.trace.json
  bool cuda = false;  // also capture CUDA kernels, copies and runtime calls
  int rank = 0;       // written as distributedInfo when world_size > 1
  int world_size = 1;
  std::string backend;      // distributedInfo.backend ("gloo", "nccl"); may be empty
  std::string worker_name;  // file name prefix; empty = "<hostname>_<pid>" (TensorBoard's)
  int top_operators = 15;   // profile.top_operators: the operators profile.json and the table list
};

/// The options the [profile] section describes for a trainer on `device` at rank/world_size:
/// profile.dir, or <run_dir>/traces when it is empty; CUDA capture when `device` is CUDA.
ProfilerOptions profiler_options(const Config& config, const std::filesystem::path& run_dir,
                                 const torch::Device& device, int rank, int world_size);

/// Creates `dir` if needed and proves a file can be created and removed in it. Throws UserError
/// naming profile.dir, the directory, the reason and the fix. Call it before training starts.
void check_trace_directory(const std::filesystem::path& dir);

/// Runs Kineto on the schedule while the Trainer steps. Add it with Trainer::add_hook; every
/// method runs on the training thread. The first step the hook sees is profiler step 0.
/// Profiling does not change results: it only observes operators (tested: equal losses).
/// Only one Profiler may record at a time in a process (a Kineto limit); a second one
/// recording throws TrainingError. Errors while writing a trace throw UserError naming the file.
class Profiler : public TrainerHook {
 public:
  /// Checks the trace directory (check_trace_directory). Throws UserError.
  explicit Profiler(ProfilerOptions options);
  /// Drops an open window without writing it. Call finish() (or let fit() call on_train_end)
  /// while the Trainer is alive: only then are its loader workers paused around the stop.
  ~Profiler() override;
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void on_step_begin(Trainer& trainer, int64_t step) override;
  void on_phase_begin(Trainer& trainer, Phase phase) override;
  void on_phase_end(Trainer& trainer, Phase phase) override;
  void on_step_end(Trainer& trainer, const StepStats& stats) override;
  void on_train_end(Trainer& trainer) override;

  /// Ends profiling now, like torch.profiler's stop(): a window that is recording is saved,
  /// one that is warming up is dropped. Idempotent.
  void finish(Trainer& trainer);

  /// Trace files written so far, in order.
  const std::vector<std::filesystem::path>& traces() const { return traces_; }
  /// The action of the step in progress (or of the last step when between steps).
  ProfilerAction current_action() const { return action_; }
  const ProfilerOptions& options() const { return options_; }

 private:
  struct Capture;
  void start_recording(Trainer& trainer);
  void stop_recording(Trainer& trainer, bool save);
  void open_scope(const std::string& name);
  void close_scopes();

  ProfilerOptions options_;
  std::unique_ptr<Capture> capture_;
  std::vector<std::filesystem::path> traces_;
  int64_t profiler_step_ = 0;
  ProfilerAction action_ = ProfilerAction::kNone;
  bool recording_ = false;
  bool prepared_ = false;
  bool finished_ = false;
};

/// Reads a trace file (.json, or gzip-compressed .json.gz). Throws UserError naming the file.
nlohmann::json read_trace(const std::filesystem::path& path);

// ---- analysis -----------------------------------------------------------------------------------

/// One operator name, summed over every call in the analysed windows (all threads).
struct OperatorStats {
  std::string name;
  int64_t calls = 0;
  double self_cpu_us = 0;     // time in the operator itself, children excluded
  double total_cpu_us = 0;    // including children (nested calls counted once)
  double self_device_us = 0;  // GPU kernels it launched directly (CUDA traces only)
  double flops = 0;           // when recorded (with_flops)
  /// The input shapes it was called with, most time first: ("[[8, 64], [64, 64]]", calls).
  std::vector<std::pair<std::string, int64_t>> input_shapes;
};

/// Share of the step spent in one phase (its user scope on the training thread).
struct PhaseStats {
  std::string phase;   // data_wait, forward, backward, comm, optimizer, checkpoint, other
  double seconds = 0;  // summed over the analysed steps
  double share = 0;    // of the summed step time
};

/// Peak allocated memory observed inside one phase, per device.
struct PhaseMemory {
  std::string phase;
  std::string device;               // "cpu", "cuda:0"
  double peak_allocated_bytes = 0;  // the allocator's total allocated, highest in the phase
  double growth_bytes = 0;          // peak minus the allocated total when the phase began
};

/// Holistic Trace Analysis temporal breakdown of the GPU over the recorded steps:
/// kernel time = last kernel end - first kernel start; idle = no kernel running; compute =
/// kernels that are neither communication (name contains "nccl") nor memory (Memcpy/Memset);
/// non-compute = the rest of the busy time. Idle gaps between consecutive kernels of a stream
/// are host wait when the later kernel's launch started after the earlier one ended, kernel
/// wait when shorter than 30 ns (back-to-back launch delay), other otherwise.
struct GpuBreakdown {
  double kernel_us = 0, compute_us = 0, non_compute_us = 0, idle_us = 0;
  double communication_us = 0, memory_us = 0;  // busy time by kernel type (merged)
  double host_wait_us = 0, kernel_wait_us = 0, other_wait_us = 0;  // idle gaps, per stream
  double comm_overlap_share = -1;  // communication time overlapped by compute / comm time
  int64_t kernels = 0;
};

struct TraceAnalysis {
  int64_t windows = 0;                   // trace files analysed
  int64_t steps = 0;                     // ProfilerStep#N annotations found
  double step_seconds = 0;               // summed
  std::vector<OperatorStats> operators;  // every operator, most self time first
  bool device_sorted = false;            // operators sorted by self device time (CUDA traces)
  std::vector<PhaseStats> phases;        // in phase order, then "other"
  std::vector<PhaseMemory> memory;       // empty unless memory was recorded
  bool has_gpu = false;
  GpuBreakdown gpu;
  // The training thread (the one holding the step annotations), inside steps:
  int64_t step_ops = 0;             // operator calls (nested ones included)
  double step_op_self_us = 0;       // their summed self time: time inside operators
  double mean_op_us = 0;            // median over steps of the step's mean self time per call
  double operator_share = 0;        // step_op_self_us / step time
  double device_memory_bytes = -1;  // from the trace's deviceProperties when present
};

/// Analyses Kineto Chrome traces (one per window): kiln's own, or torch.profiler's
/// export_chrome_trace / tensorboard_trace_handler output. Throws UserError when a trace is not
/// a Chrome trace (no traceEvents array) or holds no ProfilerStep#N annotation.
TraceAnalysis analyze_traces(const std::vector<nlohmann::json>& traces);

// ---- verdict ------------------------------------------------------------------------------------

struct VerdictThresholds {
  double data_bound_share = 0.15;
  double comm_bound_share = 0.20;
  double memory_bound_fraction = 0.90;
  double host_bound_op_us = 20.0;
  double gpu_idle_share = 0.30;
  /// The [profile] section's thresholds.
  static VerdictThresholds from_config(const Config& config);
};

/// What the verdict's actions refer to: the job's current settings, -1 when unknown (traces
/// analysed without their config); the actions then leave out "(now N)".
struct VerdictContext {
  int num_workers = -1;
  int prefetch = -1;
  int64_t batch_size = -1;
  int64_t grad_accum_steps = -1;
  int world_size = -1;
  bool cuda = false;
  double device_memory_bytes = -1;  // capacity; -1 unknown (the trace's value wins when present)
  double peak_memory_bytes = -1;    // measured outside the trace (e.g. CUDA max allocated); -1 none
};

struct TrainOptions;
struct LoaderOptions;
/// The job's settings a verdict names (workers, prefetch, batch, accumulation); the rest of the
/// context (world size, device, memory) is the caller's.
VerdictContext verdict_context(const TrainOptions& train, const LoaderOptions& loader);

struct Verdict {
  std::string
      bottleneck;      // data-bound, host-bound, compute-bound, communication-bound, memory-bound
  std::string reason;  // one line with the numbers that decided it
  std::vector<std::string> actions;
  nlohmann::json numbers;  // every input to the decision and its threshold
};

/// Classifies the step. Checked in order, the first that holds wins: data-bound (data_wait share
/// >= data_bound_share), communication-bound (exposed comm share >= comm_bound_share),
/// memory-bound (peak / capacity >= memory_bound_fraction, or on CUDA memcpy/memset busy time >=
/// comm_bound_share of kernel time), host/launch-bound (CPU: mean operator time <
/// host_bound_op_us; CUDA: GPU idle >= gpu_idle_share of kernel time and mostly host wait),
/// else compute-bound. Pure.
Verdict decide_bottleneck(const TraceAnalysis& analysis, const VerdictThresholds& thresholds,
                          const VerdictContext& context);

/// The analysis as profile.json holds it (top `top_operators` operators).
nlohmann::json analysis_to_json(const TraceAnalysis& analysis, int top_operators);
/// The printed tables: top operators, step phases, memory by phase, GPU breakdown, verdict.
std::string format_profile_tables(const TraceAnalysis& analysis, const Verdict& verdict,
                                  int top_operators);

}  // namespace kiln
