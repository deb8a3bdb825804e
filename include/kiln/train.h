// The training core: the Trainer's step loop (the optimizer and schedule: kiln/optim.h).
//
// One optimizer step = grad_accum_steps micro-batches of (data -> forward -> backward), then
// gradient clipping on the global norm, the non-finite guard, and the optimizer update, all on
// the device; the host reads the results back every train.metrics_every steps. The Trainer owns
// the whole training state (TrainState) and the one step loop every rung uses; rungs and
// components plug in through TrainerHook (profiler scopes, gradient all-reduce, checkpoints,
// metrics) and do not reach into its parts. The Trainer does not know which command drives it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kiln/data.h"
#include "kiln/models.h"
#include "kiln/optim.h"

namespace kiln {

class Communicator;
class Config;
class MixedPrecision;
class Run;

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// ---- options: the [train] section, parsed once --------------------------------------------------

/// The [train] section and the [run] keys the step loop needs, parsed once.
struct TrainOptions {
  enum class NonFinite { kAbort, kSkip };
  enum class Progress { kAuto, kBar, kLog, kOff };
  int64_t steps = 1000;
  int64_t stop_after_step = 0;  // this process ends after this step (0: train.steps)
  int64_t batch_size = 32;
  int grad_accum_steps = 1;
  double clip_grad_norm = 1.0;  // 0: no clipping
  int64_t eval_every = 100;     // 0: only at the end of fit()
  int64_t eval_batches = 8;
  NonFinite nonfinite = NonFinite::kAbort;
  int64_t max_skipped_steps = 10;
  int64_t metrics_every = 1;  // steps between device read-backs (see Trainer::train_step)
  int64_t log_every = 10;     // run.log_every
  Progress progress = Progress::kAuto;
  /// train.precision. Mixed: fp32 parameters, gradients and optimizer state; forward and loss
  /// under autocast (CPU and CUDA) to bf16 or fp16, the ops PyTorch's autocast lists keep in
  /// fp32 (cross-entropy, softmax, norms on CUDA) in fp32. fp16 adds a dynamic loss scaler.
  enum class Precision { kFp32, kBf16Mixed, kFp16Mixed };
  Precision precision = Precision::kFp32;
  /// train.activation_checkpointing: kBlock recomputes each model unit's activations (gpt: each
  /// transformer block) in backward instead of keeping them from forward.
  enum class ActivationCheckpointing { kNone, kBlock };
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kNone;
  static TrainOptions from_config(const Config& config);
};

/// What a Trainer is built from: the [train] and [optim] sections and the loader's [data]
/// settings, each parsed once (from_config, src/train/options.cpp, is the only reader of those
/// keys). The Trainer fills `loader`'s batch size, rank, world size and device itself.
struct TrainerSetup {
  TrainOptions train;
  OptimOptions optim;
  LoaderOptions loader;  // num_workers, prefetch, shuffle, seed (data.seed, else run.seed)
  static TrainerSetup from_config(const Config& config);
};

/// The [run] keys a process applies before it trains: threads, determinism, seed, device.
struct RuntimeOptions {
  int64_t threads = 0;  // 0: LibTorch's default
  bool deterministic = true;
  // Under `deterministic`: PyTorch's fill of each new tensor's memory (off: a fill_ per
  // allocation, a seventh of a gpt2-124m CPU step, that bitwise-equal runs do not need).
  bool fill_uninitialized_memory = false;
  // glibc's malloc keeps freed memory for reuse (no mmap'd chunks, no trim; run.keep_freed_memory).
  bool keep_freed_memory = true;
  uint64_t seed = 0;
  std::string device = "cpu";  // run.device: "auto", "cpu" or "cuda"
  static RuntimeOptions from_config(const Config& config);
};

/// The order in which the pieces of a step are installed on a Trainer, and the reason for it.
/// Unit wrappers compose outermost first (Model::add_unit_wrapper), so activation checkpointing
/// goes on first (its recomputation in backward then runs the wrappers inside it again: FSDP's
/// gather, the compiled unit), then the parallel layout (DDP's gradient hooks, or FSDP's gather
/// and free around each unit and its sharded layout, which the optimizer is rebuilt over), then
/// compilation (the compiled step's executor, or per-unit packages innermost, next to the unit's
/// own forward, binding the parameters the layout left in place), then capture (a CUDA graph of
/// the whole step as composed so far). Tensor parallelism comes between checkpointing and the
/// data-parallel layout: it slices the model's parameters, which DDP or FSDP then replicate or
/// shard over the data-parallel ranks (and a checkpointed unit's recomputation runs its
/// collectives again). kiln/job.h's compose_training installs them in this order; each piece's
/// own attach function records its stage here and refuses to go on out of order.
enum class CompositionStage {
  kActivationCheckpointing = 1,
  kTensorParallel = 2,
  kParallelLayout = 3,
  kCompilation = 4,
  kCapture = 5
};
/// "activation checkpointing", "tensor parallelism", "parallel layout", "compilation",
/// "capture".
const char* composition_stage_name(CompositionStage stage);

/// "fp32", "bf16-mixed", "fp16-mixed".
const char* precision_name(TrainOptions::Precision precision);
/// The dtype the forward computes in under `precision` (kFloat for fp32).
torch::ScalarType compute_dtype(TrainOptions::Precision precision);

// ---- phases and hooks --------------------------------------------------------------------------

enum class Phase { kDataWait, kForward, kBackward, kComm, kOptimizer, kCheckpoint, kEval };
/// "data_wait", "forward", "backward", "comm", "optimizer", "checkpoint", "eval".
const char* phase_name(Phase phase);

/// One optimizer step as the host sees it. The loss, grad norm and non-finite flag stay on the
/// device and are read back only on steps that sync (`synced`): every train.metrics_every steps,
/// the last step of fit(), and before a checkpoint captures the state.
struct StepStats {
  int64_t step = 0;              // 1-based number of the optimizer step just completed
  double lr = 0;                 // learning rate used
  double step_seconds = 0;       // wall time of the whole step (host; the device may lag)
  double data_wait_seconds = 0;  // time blocked waiting for batches
  int64_t samples = 0;           // samples in the step, all processes
  int64_t tokens = 0;            // tokens in the step, all processes (0 for classification)
  bool synced = false;           // the fields below were read back from the device
  double loss = std::numeric_limits<double>::quiet_NaN();       // mean loss over the micro-batches
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // global norm before clipping
  bool skipped = false;  // a non-finite step skipped under train.nonfinite = "skip"
};

struct EvalStats {
  double loss = 0;
  double accuracy = -1;  // classification only; -1 otherwise
  int64_t samples = 0;
};

class Trainer;

/// A rung's or component's plug into the step loop. Every method runs on the training thread;
/// the defaults do nothing; hooks run in the order they were added. The order within fit():
///
///   on_train_begin
///   per step:  on_step_begin
///              per micro-step: on_micro_step_begin, [data_wait] [forward] [backward]
///              on_gradients_ready            (before clipping: e.g. DDP waits for all-reduce)
///              [comm] (loss mean over ranks) [optimizer]
///              on_step_end                   (StepStats; loss etc. only when synced)
///              -- or, when the step throws: on_step_failed, then the exception propagates
///   on_eval    after each evaluation (every train.eval_every steps and at the end of fit)
///   on_train_end                             (not called when a step threw)
///
/// [phase] is a pair on_phase_begin / on_phase_end. Phases nest and are always closed: when a
/// step throws inside a phase, its on_phase_end runs before on_step_failed (a hook that throws
/// from on_phase_end while another exception unwinds is ignored).
class TrainerHook {
 public:
  virtual ~TrainerHook() = default;
  virtual void on_train_begin(Trainer&) {}
  virtual void on_step_begin(Trainer&, int64_t /*step: completed steps so far*/) {}
  virtual void on_micro_step_begin(Trainer&, int /*micro_step*/, bool /*last*/) {}
  virtual void on_phase_begin(Trainer&, Phase) {}
  virtual void on_phase_end(Trainer&, Phase) {}
  virtual void on_gradients_ready(Trainer&) {}
  virtual void on_step_end(Trainer&, const StepStats&) {}
  virtual void on_step_failed(Trainer&, int64_t /*step: 1-based number of the failed step*/) {}
  virtual void on_eval(Trainer&, const EvalStats&) {}
  virtual void on_train_end(Trainer&) {}
};

/// Marks a phase for every hook for the lifetime of the scope (RAII: closed on exceptions too).
/// Closing the phase may throw (FSDP's on_phase_end frees a group and can raise a
/// CommunicationError): outside unwinding that exception leaves the destructor, hence
/// noexcept(false); while unwinding it is swallowed, the first exception wins.
class PhaseScope {
 public:
  /// `trainer` must outlive the scope (a scope lives inside one of the trainer's calls).
  PhaseScope(Trainer& trainer, Phase phase);
  ~PhaseScope() noexcept(false);
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Trainer& trainer_;
  Phase phase_;
  int uncaught_;
};

// ---- the training state ------------------------------------------------------------------------

/// Where a tensor that is one rank's piece of a larger one sits (TrainState::pieces).
struct TensorPiece {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;  // index of the piece's first element in the whole tensor
  /// Whether this rank writes the piece: false for a copy another rank holds too (hybrid
  /// sharding's replicas beyond the first), which a checkpoint keeps once; it is loaded all the
  /// same.
  bool saved = true;
  /// A piece that is several boxes of the whole tensor (a fused tensor-parallel weight's slice,
  /// TensorParallelPlacement::chunks: one box per fused block): rows [row, row + rows) of the
  /// local tensor on dim 0 sit at `offsets` of the whole one. Empty: the local tensor is one box,
  /// at the piece's `offsets`.
  struct Box {
    int64_t row = 0, rows = 0;
    std::vector<int64_t> offsets;
  };
  std::vector<Box> boxes;
};

/// Everything a run needs to continue bitwise where it stopped, as one value (torchtitan's
/// Stateful, in one place). Tensors alias the live state: capturing copies nothing (an async
/// checkpointer stages them before the next optimizer step), and Trainer::load_state copies into
/// the live tensors only where the given ones are other tensors.
struct TrainState {
  int64_t step = 0;               // completed optimizer steps
  int64_t skipped_steps = 0;      // steps skipped by the non-finite guard
  int64_t optimizer_steps = 0;    // Optimizer::steps_taken()
  LoaderPosition loader;          // this rank's next batch
  int64_t batch_size = 0;         // what `loader` counts in: samples per batch per rank,
  int world_size = 1;             //   ranks,
  int64_t batches_per_epoch = 0;  //  and global batches per epoch
  NamedTensors model;             // parameters and buffers (named_parameters/named_buffers)
  NamedTensors optimizer;         // Optimizer::state() then Optimizer::step_counts()
  NamedTensors rng;               // generator states of this process: "cpu", "cuda-<d>"
  nlohmann::json lr_schedule;     // the schedule's settings and next_lr (data only)
  /// train.precision = "fp16-mixed": the loss scaler's state (torch.amp.GradScaler's
  /// state_dict fields: scale, growth_factor, backoff_factor, growth_interval, growth_tracker,
  /// plus overflow_steps: the steps it skipped so far). null under fp32 and bf16-mixed.
  nlohmann::json grad_scaler;
  /// Tensors of `model` and `optimizer` that are this rank's piece of a larger tensor (sharded
  /// data parallelism), by their name in those lists: the whole tensor's shape and where the
  /// piece starts in it. Every other tensor is whole (and, with DDP, the same on every rank).
  std::map<std::string, TensorPiece> pieces;
};

// ---- the trainer -------------------------------------------------------------------------------

/// The step executor: how one micro-batch becomes gradients (forward, loss, backward) and how a
/// validation batch becomes a loss. The Trainer owns one: eager (autograd under train.precision's
/// autocast, src/train/executors.cpp) until set_step_executor installs another (kiln/compile.h's
/// CompiledStep). Every method runs on the training thread; an executor marks its own phases
/// (PhaseScope on the trainer it is given: eager marks forward, then backward; a compiled
/// forward+backward is one forward phase). Errors: what the model, a compiled package or a hook
/// throws.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  /// Forward and backward of one micro-batch (already on the trainer's device): adds scale x each
  /// parameter's gradient to its .grad (sets it when undefined) and returns scale x the loss, a
  /// 0-dim tensor on the device. `loss_scale`: under fp16-mixed the loss scaler's scale (float32
  /// [1] on the device), and the gradients added are those of loss x loss_scale (the returned
  /// loss is not multiplied by it; the Trainer unscales the gradients); undefined otherwise.
  /// An undefined result declines the batch (a compiled step over its recompile limit): the
  /// Trainer runs that batch through its eager executor instead. A compiled micro-step fires no
  /// autograd gradient hooks (DDP then reduces every bucket in on_gradients_ready, without
  /// overlap).
  virtual torch::Tensor forward_backward(Trainer& trainer, const Batch& batch, double scale,
                                         const torch::Tensor& loss_scale) = 0;
  /// Evaluate's forward of one validation batch (already on the device): `loss` the batch's mean
  /// loss (0-dim), `correct` for a classifier (Model::classifier()) the number of samples whose
  /// argmax is the target (0-dim int64; undefined otherwise). Undefined `loss` (the default), or
  /// a classifier's undefined `correct`, declines the batch: the eager executor runs it. Called
  /// inside Phase::kEval, under NoGradGuard, with the model in eval mode.
  struct EvalOutputs {
    torch::Tensor loss, correct;
  };
  virtual EvalOutputs evaluate(const Batch& /*batch*/) { return {}; }
};

/// The step runner: how a step's device work (every micro-step's forward and backward through
/// the step executor, the gradient hooks, clipping, the optimizer) is run. The Trainer owns one:
/// directly (the default: each micro-batch is fetched when its micro-step begins) until
/// set_step_runner installs another (a CapturedStep). Training thread only.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  /// Micro-batch `micro` of the step, on the device (the Trainer times the wait and counts it).
  using Fetch = std::function<Batch(int micro)>;
  /// The Trainer's device work, reading micro-batch k through the Fetch it is given. Returns
  /// [loss, grad_norm, nonfinite] on the device.
  using DeviceWork = std::function<torch::Tensor(const Fetch& fetch)>;
  /// Runs one step of `micro_steps` micro-batches at learning rate `lr` and returns what `work`
  /// returns (or, for a replayed capture, the captured output overwritten by the replay).
  virtual torch::Tensor run(int micro_steps, const Fetch& fetch, double lr,
                            const DeviceWork& work) = 0;
};

/// A captured step (CUDA graphs, kiln/compile.h builds one) that runs the Trainer's whole device
/// work for a step's micro-batches: it fetches them all first (a replay runs the device work at
/// once), then run_captured. Phases and hooks inside the work run only when it runs eagerly or is
/// being captured, not on a replay.
class CapturedStep : public StepRunner {
 public:
  torch::Tensor run(int micro_steps, const Fetch& fetch, double lr, const DeviceWork& work) final;
  /// The Trainer's device work for `batches`, as a function of the tensors it reads the batches
  /// from (the implementation may pass static buffers it copies `batches` into).
  using BatchWork = std::function<torch::Tensor(const std::vector<Batch>& batches)>;
  /// Runs the step: eagerly through `work` (warm-up, fallback), by capturing `work` and replaying
  /// the capture, or by replaying an earlier capture of the same shapes. `lr` is the step's
  /// learning rate (a capture reads it from the optimizer's lr tensor).
  virtual torch::Tensor run_captured(const std::vector<Batch>& batches, double lr,
                                     const BatchWork& work) = 0;
};

/// How the trained tensors lie over the ranks, and what follows from it for the Trainer: which
/// tensors the optimizer steps, how the global gradient norm is formed, and which tensors (and
/// pieces of tensors) the training state holds. The default (replicated_layout()) keeps every
/// tensor whole on every rank: one process, or DDP, whose hook has averaged the gradients before
/// the norm. Sharded data parallelism (kiln/dist.h, FSDP) installs its own with
/// Trainer::set_parallel_layout. The Trainer owns the layout; it calls it on the training thread
/// only. Errors: CommunicationError from a collective (the norm), nothing else.
class ParallelLayout {
 public:
  virtual ~ParallelLayout() = default;
  /// The tensors the optimizer steps, named like the model's parameters they stand for.
  virtual NamedTensors optimizer_parameters(Model& model) = 0;
  /// The global L2 norm of the gradients `grads` (this rank's, of optimizer_parameters()), the
  /// same value on every rank. `overflow`: under fp16-mixed this rank's loss-scaler overflow flag
  /// (0-dim, on the device), to be made global too (every rank's scaler backs off together);
  /// undefined otherwise.
  virtual torch::Tensor global_gradient_norm(const std::vector<torch::Tensor>& grads,
                                             torch::Tensor& overflow) = 0;
  /// Fills `state.model` (parameters, then buffers), `state.optimizer` (from the optimizer's
  /// Optimizer::state(), step counts excluded) and `state.pieces` for the tensors that are this
  /// rank's piece of a larger one.
  virtual void add_state(Model& model, const NamedTensors& optimizer_state, TrainState& state) = 0;
};

/// Every tensor whole on every rank (one process, DDP).
std::shared_ptr<ParallelLayout> replicated_layout();

struct TrainerOptions {
  torch::Device device = torch::kCPU;
  int rank = 0;
  int world_size = 1;
  /// The process group when world_size > 1: the logged step loss and evaluate() are averaged
  /// over every rank through it (gradients are averaged by the DataParallel hook, kiln/dist.h).
  /// Null: this process only.
  std::shared_ptr<Communicator> comm = nullptr;
};

struct TrainSummary {
  int64_t steps = 0;
  double first_loss = 0;  // first synced step's loss
  double last_loss = 0;   // last step's loss (the last step always syncs)
  /// The mean of the last synced steps' finite losses, up to kSummaryLossSteps of them (one
  /// step's loss is noisy), and how many it averages.
  static constexpr int64_t kSummaryLossSteps = 10;
  double last_loss_mean = 0;
  int64_t last_loss_mean_steps = 0;
  EvalStats final_eval;
  double seconds = 0;
  double samples_per_second = 0;
  double tokens_per_second = 0;
  int64_t skipped_steps = 0;
};

class Trainer {
 public:
  /// Moves the model to the device and builds the loader and optimizer from `setup`. Installs
  /// nothing around the step: activation checkpointing, a parallel layout, compilation and
  /// capture are added afterwards, in CompositionStage order (kiln/job.h compose_training).
  Trainer(const TrainerSetup& setup, std::shared_ptr<Model> model, Datasets data,
          TrainerOptions options = {});
  ~Trainer();

  void add_hook(std::shared_ptr<TrainerHook> hook);

  /// One optimizer step: grad_accum_steps x (data -> forward -> backward), then clipping and the
  /// optimizer update, all on the device; a non-finite loss or gradient makes the update a no-op
  /// there (no host round trip). Every train.metrics_every steps (and when `sync` is true) the
  /// loss, grad norm and non-finite counters are read back; then a non-finite step throws
  /// TrainingError naming it (train.nonfinite = "abort", or more than train.max_skipped_steps
  /// skipped) or is logged as skipped. Between syncs a step never waits for the device.
  StepStats train_step(bool sync = false);
  /// One optimizer step on the given micro-batches (one per accumulation step, on any device)
  /// instead of the loader's; always syncs. Used to replay exact batches (peer, tests).
  StepStats train_step_on(const std::vector<Batch>& micro_batches);
  /// Takes the next training batch from the loader (as train_step would). For tools that record
  /// the batch stream and replay it with train_step_on (peer export).
  Batch next_batch();
  /// `count` steps through train_step (the last one syncs), each seen by every hook. The one
  /// loop the rungs share; throws what train_step throws.
  void run_steps(int64_t count);
  /// Mean loss (and accuracy) over the first train.eval_batches batches of the validation set.
  /// Calls the hooks' on_eval.
  EvalStats evaluate();
  /// Steps until step() == total_steps; evaluates every train.eval_every steps and at the end.
  /// With a run: metrics records and the progress display (hooks added for the call).
  TrainSummary fit(int64_t total_steps, Run* run);

  /// The full training state (syncs the device counters first); tensors alias the live ones.
  TrainState state();
  /// Restores a state from state() of this or an equal Trainer (the same model, optimizer and
  /// world; loader positions at another world size are converted by the caller). Throws
  /// UserError naming the mismatching tensor.
  void load_state(const TrainState& state);

  int64_t step() const { return step_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  const TrainOptions& train_options() const { return train_options_; }
  /// Records that `what`, a piece of `stage`, is installed now. Throws std::logic_error naming
  /// both pieces and the order when a piece of a later stage is already installed, or when
  /// `stage` already has its piece (two parallel layouts, two compiled steps). Every attach
  /// function calls it before it changes the trainer.
  void enter_composition_stage(CompositionStage stage, const std::string& what);
  /// The pieces installed so far, in order ("activation checkpointing (block)", "FSDP", ...).
  const std::vector<std::string>& composition() const { return composition_; }
  Model& model() { return *model_; }
  std::shared_ptr<Model> model_ptr() { return model_; }
  Optimizer& optimizer() { return *optimizer_; }
  /// Global batches per epoch of the training data at this world size.
  int64_t batches_per_epoch() const;
  /// Stops the loader's background workers for the scope (the profiler enables and disables
  /// Kineto with no other thread running ops). Training thread only.
  class PausedData {
   public:
    /// `trainer` (its loader) must outlive the scope.
    explicit PausedData(Trainer& trainer);
    ~PausedData();
    PausedData(const PausedData&) = delete;
    PausedData& operator=(const PausedData&) = delete;

   private:
    Loader& loader_;
  };
  const Datasets& data() const { return data_; }
  const TrainerOptions& options() const { return options_; }
  /// Runs each micro-step's forward+backward and each evaluation batch through `executor` from
  /// the next micro-step on (null: the eager executor again).
  void set_step_executor(std::shared_ptr<StepExecutor> executor);
  /// Runs each step's device work through `runner` from the next step on (a CapturedStep; null:
  /// directly again).
  void set_step_runner(std::shared_ptr<StepRunner> runner);
  /// The eager executor (autograd under train.precision's autocast): what a declined batch runs
  /// through, and what an executor may delegate to.
  StepExecutor& eager_executor() { return *eager_; }
  /// True while neither another executor nor another runner is installed (plain eager steps).
  bool eager_step() const { return executor_ == eager_ && runner_ == direct_; }
  /// Lays the trained tensors out as `layout` says from the next step on (kiln/dist.h's FSDP
  /// installs a sharded one): the optimizer is rebuilt over layout->optimizer_parameters(), the
  /// gradient norm and state() go through the layout. Call before the first step.
  void set_parallel_layout(std::shared_ptr<ParallelLayout> layout);

  /// Marks a phase for every hook (profiler scopes, timers). Prefer PhaseScope. Components call
  /// these around their own work, e.g. a checkpointer around its staging (Phase::kCheckpoint),
  /// DDP around waiting for all-reduce (Phase::kComm). Begin/end pairs must nest.
  void phase_begin(Phase phase);
  void phase_end(Phase phase);

 private:
  /// The device part of a step: micro-batches through the step executor's forward and backward,
  /// the gradient hooks, the loss mean over ranks, clipping, the optimizer. Returns [loss,
  /// grad_norm, nonfinite] on the device. The step runner runs it (directly or captured).
  torch::Tensor device_step(int micro_steps, const StepRunner::Fetch& fetch);
  StepStats run_step(int micro_steps, const std::function<Batch(int)>& next_batch, bool sync);
  /// Adds a micro-batch's samples and tokens (all ranks) to `stats`.
  void count_samples(const Batch& batch, StepStats& stats) const;
  /// Reads the device counters back and applies the non-finite policy to the steps since the
  /// last sync. Throws TrainingError.
  void sync_counters(StepStats* stats, const torch::Tensor& step_values);
  template <class Call>
  void for_each_hook(Call call);

  TrainOptions train_options_;
  std::shared_ptr<Model> model_;
  Datasets data_;
  TrainerOptions options_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Loader> loader_;
  std::unique_ptr<Sampler> val_sampler_;
  std::vector<std::shared_ptr<TrainerHook>> hooks_;
  std::shared_ptr<StepExecutor> eager_;        // the eager executor (src/train/executors.cpp)
  std::shared_ptr<StepExecutor> executor_;     // eager_ unless set_step_executor
  std::shared_ptr<StepRunner> direct_;         // runs the device work as it is
  std::shared_ptr<StepRunner> runner_;         // direct_ unless set_step_runner
  std::shared_ptr<ParallelLayout> layout_;     // replicated_layout() unless set_parallel_layout
  std::unique_ptr<MixedPrecision> precision_;  // train.precision (src/train/precision.h)
  int64_t step_ = 0;
  int64_t skipped_steps_ = 0;  // as of the last sync
  // On the device, since the last sync: non-finite steps, and the first one's number (0: none).
  torch::Tensor nonfinite_since_sync_, first_nonfinite_step_;
  // On the device: the number of the step device_step runs (advanced by device_step itself, so a
  // captured step replays with the right number).
  torch::Tensor device_step_number_;
  CompositionStage last_stage_{0};        // the latest stage installed (0: none)
  std::vector<std::string> composition_;  // what enter_composition_stage recorded
};

/// Installs activation checkpointing (train.activation_checkpointing = "block": each unit's
/// activations recomputed in backward) on `trainer`'s model: the first piece of a composition
/// (CompositionStage::kActivationCheckpointing). A model without units trains unchanged. Throws
/// std::logic_error when installed out of order.
void install_activation_checkpointing(Trainer& trainer);

// ---- hooks kiln provides -----------------------------------------------------------------------

/// Appends one metrics record per synced step (and, with `record_evals`, one per evaluation) to a
/// run's metrics file: step_record()'s fields plus whatever `annotate` adds.
class MetricsHook : public TrainerHook {
 public:
  /// `run` must outlive the hook (the session holds both; the trainer holds the hook).
  explicit MetricsHook(Run& run, std::function<void(nlohmann::json&)> annotate = nullptr,
                       bool record_evals = true);
  void on_step_end(Trainer&, const StepStats& stats) override;
  void on_eval(Trainer& trainer, const EvalStats& eval) override;

 private:
  Run& run_;
  std::function<void(nlohmann::json&)> annotate_;
  bool record_evals_;
};

/// Every step's StepStats, kept in order (also those before a step that threw).
class StepLog : public TrainerHook {
 public:
  void on_step_end(Trainer&, const StepStats& stats) override { steps.push_back(stats); }
  std::vector<StepStats> steps;
};

/// One metrics.jsonl record for a step (docs/training.md lists the fields).
nlohmann::json step_record(const StepStats& stats);

/// Applies run.threads, run.deterministic and the global seed to this process.
void apply_runtime_settings(const RuntimeOptions& options);
/// The same, parsing the config's [run] keys (RuntimeOptions::from_config).
void apply_runtime_settings(const Config& config);
/// The device run.device (`device`: "auto", "cpu", "cuda") resolves to. Throws UserError for
/// "cuda" without a GPU.
torch::Device resolve_device(const std::string& device);
/// The same for the config's run.device.
torch::Device resolve_device(const Config& config);

}  // namespace kiln
