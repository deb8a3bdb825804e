// The compiled step: the model's forward+backward compiled ahead of time by PyTorch's own
// compiler (torch.export -> joint forward+backward graph -> AOTInductor package), loaded from C++
// and run in the Trainer's step loop in place of eager autograd. Python runs only to build a
// package (python/kiln_py/compile.py, a child process), never in the step loop.
//
// What is compiled, and what is not: the "train" package computes the loss and every parameter's
// gradient from (inputs, targets); evaluation runs through an "eval" package of its own (forward
// and loss only; for a classifier also the count of correct predictions); clipping, the
// optimizer, DDP's all-reduce and everything else stay kiln's eager code. CUDA graphs capture
// the whole step on top (CapturedGraphStep): see docs/compile.md.
//
// Packages are shared libraries: the one thing kiln loads from disk that executes code. kiln
// loads only packages it built itself into compile.cache_dir, each checked against the xxh3 hash
// recorded when it was built; anything else is rebuilt, never loaded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kiln/train.h"

namespace kiln {

class Config;
class Model;
class UnitWrapper;

struct CompileOptions {
  enum class Backend { kEager, kInductor, kCudaGraphs, kInductorCudaGraphs };
  /// PyTorch's dynamic=None | True | False: auto specialises first and turns the dimension that
  /// changed dynamic at the first recompile; dynamic exports symbolic batch and sequence
  /// dimensions from the start; static specialises every shape.
  enum class Dynamic { kAuto, kDynamic, kStatic };
  /// What one AOTInductor graph covers: the whole step (forward+backward of the model and loss),
  /// or each Model::units() entry on its own (a forward and a backward package per unit shape,
  /// run inside the unit wrappers, so FSDP and activation checkpointing wrap compiled units).
  enum class Granularity { kStep, kUnit };
  Backend backend = Backend::kEager;
  Dynamic dynamic = Dynamic::kAuto;
  Granularity granularity = Granularity::kStep;  // resolved: see compiles_per_unit()
  bool fullgraph = true;
  bool root = true;  // compile.root: per unit, the root's pieces (embeddings, head, loss) too
  int recompile_limit = 8;
  std::vector<int64_t> probe_seq_lens;  // the rung's shape probe (resolved; may be empty)
  double tolerance = 1e-4;  // resolved: compile.tolerance, else default_compile_tolerance()
  bool tolerance_configured = false;  // compile.tolerance set (> 0), not the precision's default
  double min_speedup = 1.05;
  int64_t warmup_steps = 3;
  int64_t steps = 10;
  std::filesystem::path cache_dir;  // resolved: compile.cache_dir, else the user's cache dir
  std::string python;               // resolved: compile.python, $KILN_PYTHON, the build's python

  /// Throws UserError for a bad key (e.g. compile.probe_seq_lens not a list of integers).
  static CompileOptions from_config(const Config& config);
  /// The backend builds an AOTInductor step ("inductor", "inductor+cudagraphs").
  bool inductor() const {
    return backend == Backend::kInductor || backend == Backend::kInductorCudaGraphs;
  }
  /// The backend captures the step in CUDA graphs ("cudagraphs", "inductor+cudagraphs").
  bool cuda_graphs() const {
    return backend == Backend::kCudaGraphs || backend == Backend::kInductorCudaGraphs;
  }
};

/// compile.granularity resolved: "unit", or "auto" with compile.backend = "inductor" and
/// train.activation_checkpointing = "block" or dist.strategy = "fsdp" (decided from the config
/// alone, so `kiln config validate` and `kiln train` agree; dist.strategy = "auto" counts as not
/// fsdp). The [compile] rules and CompileOptions::from_config both use it.
bool compiles_per_unit(const Config& config);

/// compile.probe_seq_lens: "" -> nullopt (data.seq_len/2 and /4), "none" -> no probe, else the
/// comma-separated lengths. Throws UserError naming the key.
std::optional<std::vector<int64_t>> parse_probe_seq_lens(const std::string& text);

/// The compile rung's gate when compile.tolerance = 0: the relative difference of compiled and
/// eager losses and parameters that `precision` allows (fp32 1e-4; bf16-mixed and fp16-mixed
/// wider: Inductor fuses ops and rounds to the low precision at other places than eager does,
/// and training amplifies it; the measured noise is in docs/compile.md).
double default_compile_tolerance(TrainOptions::Precision precision);

/// "eager", "inductor", "cudagraphs", "inductor+cudagraphs"; "auto", "dynamic", "static".
const char* backend_name(CompileOptions::Backend backend);
const char* dynamic_name(CompileOptions::Dynamic dynamic);
const char* granularity_name(CompileOptions::Granularity granularity);  // "step", "unit"

// ---- shapes, graphs and recompiles (bookkeeping only; nothing here compiles) -------------------

/// The shapes of one micro-batch.
struct InputShapes {
  std::vector<int64_t> inputs, targets;
  bool operator==(const InputShapes&) const = default;
  /// "inputs [4, 16], targets [4, 16]".
  std::string str() const;
  static InputShapes of(const Batch& batch);
};

/// A symbolic dimension of a dynamic graph: dimension `dim` of "inputs" or "targets", named
/// `name` (dimensions with the same name are the same symbol), in [min, max].
struct DynamicDim {
  std::string tensor;
  int dim = 0;
  std::string name;
  int64_t min = 2, max = 2;
  bool operator==(const DynamicDim&) const = default;
};

/// The shapes one compiled graph accepts: `shapes`, except that each dynamic dimension may take
/// any size in its range.
struct GraphShape {
  InputShapes shapes;
  std::vector<DynamicDim> dynamic;
  bool accepts(const InputShapes& candidate) const;
  /// "inputs [4, s0], targets [4, s0] (s0 = seq in [2, 16])".
  std::string str() const;
  nlohmann::json to_json() const;
};

/// The dimensions that may become dynamic for a model, with their ranges: batch (dim 0 of both)
/// in [2, 65536]; for token inputs ([B, T]) also seq (dim 1 of both) in [2, max_seq_len].
std::vector<DynamicDim> dynamic_candidates(const InputShapes& shapes, int64_t max_seq_len);

/// One recompile: a micro-batch whose shapes no graph accepted.
struct Recompile {
  InputShapes shapes;
  std::string reason;     // "inputs dim 1 changed 16 -> 8 (seq)"
  bool compiled = false;  // false: over compile.recompile_limit, the shape runs eager
};

/// Decides, for each new shape, whether a graph accepts it, a new graph must be compiled, or the
/// shape runs eager (over the recompile limit), as torch.compile's guards and its
/// recompile_limit do. Not thread-safe.
class ShapeTracker {
 public:
  ShapeTracker(CompileOptions::Dynamic dynamic, int recompile_limit, int64_t max_seq_len);

  struct Decision {
    enum class Kind { kReuse, kCompile, kEager } kind = Kind::kReuse;
    size_t graph = 0;    // kReuse: the graph that accepts the shapes
    GraphShape shape;    // kCompile: the graph to build
    std::string reason;  // kCompile after the first graph, kEager: why
  };
  /// What to do for `shapes`. Does not change the tracker.
  Decision decide(const InputShapes& shapes) const;
  /// Records a decision's outcome: a compiled graph (index = graphs().size() - 1) or a shape that
  /// runs eager from now on.
  void record(const InputShapes& shapes, const Decision& decision);

  const std::vector<GraphShape>& graphs() const { return graphs_; }
  const std::vector<Recompile>& recompiles() const { return recompiles_; }
  /// Shapes that run eager because the limit was reached.
  const std::vector<InputShapes>& eager_shapes() const { return eager_; }

 private:
  CompileOptions::Dynamic dynamic_;
  int limit_;
  int64_t max_seq_len_;
  std::vector<GraphShape> graphs_;
  std::vector<Recompile> recompiles_;
  std::vector<InputShapes> eager_;
};

// ---- graph breaks ------------------------------------------------------------------------------

struct GraphBreak {
  std::string reason;
  std::string where;  // "models.py:57 in forward"
};

/// One line per break: "graph break at models.py:57 in forward: <reason>".
std::string describe_breaks(const std::vector<GraphBreak>& breaks);

// ---- the package cache -------------------------------------------------------------------------

/// What a package depends on. Two builds with equal fingerprints are interchangeable.
struct Fingerprint {
  nlohmann::json fields;  // torch version and git hash, device and arch, model, graph kind, shapes,
                          // kiln version, the compile script's hash
  /// xxh3-64 of the canonical JSON, 16 hex digits: the package's file name in the cache.
  std::string key() const;
};

/// A directory of packages kiln built, each with a record <key>.json beside <key>.pt2 holding its
/// fingerprint, its xxh3 hash and the compiler's report. Safe for several processes: a package
/// and its record are published with atomic renames.
class PackageCache {
 public:
  /// Creates the directory. Throws UserError naming compile.cache_dir when it cannot be written.
  explicit PackageCache(std::filesystem::path dir);

  struct Hit {
    std::filesystem::path package;
    nlohmann::json record;
  };
  /// The verified package for `fingerprint`, or nullopt with `why_not` set: "not built yet",
  /// "its record is not JSON", "built for another fingerprint (<field> differs)", "its hash
  /// differs from the one recorded (corrupt or changed)". A rejected entry is never loaded.
  std::optional<Hit> find(const Fingerprint& fingerprint, std::string* why_not) const;
  /// Holds an exclusive advisory lock (flock) on the fingerprint's key until destroyed: concurrent
  /// processes (the ranks of one job, parallel tests) build a package once; the others wait,
  /// then find it. Throws UserError when the lock file cannot be created.
  class BuildLock {
   public:
    BuildLock(const PackageCache& cache, const Fingerprint& fingerprint);
    ~BuildLock();
    BuildLock(const BuildLock&) = delete;
    BuildLock& operator=(const BuildLock&) = delete;

   private:
    int fd_ = -1;
  };
  /// A fresh directory for a build's scratch files (spec, result, log), inside the cache.
  std::filesystem::path scratch_dir(const Fingerprint& fingerprint) const;
  /// Hashes `built` and publishes it as the fingerprint's package with its record.
  Hit publish(const Fingerprint& fingerprint, const std::filesystem::path& built,
              const nlohmann::json& report) const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

/// The Python that builds packages: its torch, checked against the LibTorch kiln was built with.
struct CompilerPython {
  std::string python;
  std::filesystem::path package_dir;  // the directory holding kiln_py
  std::string torch_version, torch_git, script_hash;
  /// Runs `python` once (cached per process). Throws UserError naming compile.python and the fix
  /// when Python or torch is missing or torch's version differs from LibTorch's.
  static const CompilerPython& probe(const std::string& python);
};

/// The checks `kiln train`/`kiln compile` make before anything is written to the run directory,
/// beyond the [compile] section's rules (which refuse the combinations with train.precision,
/// train.activation_checkpointing, dist.strategy, run.device and optim.fused that kiln does not
/// support): this kiln build has CUDA graphs when asked, Python and torch match, the cache is
/// writable. Throws UserError.
void check_compile_start(const Config& config);

/// Why FSDP and a whole-step compiled or captured step do not compose (one clause): the
/// [compile] rule's line for dist.strategy = "fsdp", and the refusal of dist.strategy = "auto"
/// resolving to fsdp (decided by the model's memory, so not by a rule). Per-unit compilation
/// (compile.granularity = "unit") composes with FSDP.
std::string fsdp_with_compile_problem();

// ---- the compiled step -------------------------------------------------------------------------

/// What compiling did, for reports and compile.json. The training step's graphs and the eval
/// graphs are kept apart: each graph kind has its own packages, shapes, recompiles and
/// compile.recompile_limit (eval is a forward-only graph of its own, not a recompile of the step).
struct CompileReport {
  std::string backend;
  std::string dynamic;
  std::string precision = "fp32";  // train.precision: the autocast policy inside the graphs
  /// Graph breaks with fullgraph = false: every step and every evaluation runs eager.
  bool fallback_to_eager = false;
  std::vector<GraphBreak> breaks;
  struct Graph {
    GraphShape shape;
    bool cache_hit = false;
    std::string cache_note;    // why the cache missed ("not built yet", "hash differs ...")
    double build_seconds = 0;  // 0 on a hit
    double load_seconds = 0;
    std::string package;
  };
  std::vector<Graph> graphs;  // the training step's (forward+backward)
  std::vector<Recompile> recompiles;
  int64_t eager_micro_steps = 0;   // micro-steps that ran eager over the recompile limit
  std::vector<Graph> eval_graphs;  // evaluation's (forward and loss)
  std::string granularity = "step";
  /// Per-unit compilation: one entry per unit and input shape the unit ran with, each naming its
  /// forward and backward packages (units of equal shapes share one pair: `shared`).
  struct UnitGraph {
    std::string unit;          // "transformer.h.0"
    std::string input;         // "float32 [4, 16, 128]"
    bool cache_hit = false;    // the pair was found in compile.cache_dir
    bool shared = false;       // the pair an earlier unit of equal shapes loaded in this run
    std::string cache_note;    // why the cache missed
    double build_seconds = 0;  // 0 on a hit or when shared
    double load_seconds = 0;
    std::string forward_package, backward_package;
    bool eager = false;  // graph breaks with compile.fullgraph = false: this unit runs eager
  };
  std::vector<UnitGraph> unit_graphs;
  int64_t unit_recompiles = 0;   // unit input shapes compiled after each unit's first
  int64_t eager_unit_calls = 0;  // unit calls that ran eager (over compile.recompile_limit)
  /// Unit forwards run through a compiled package (activation checkpointing's recomputation in
  /// backward counts again).
  int64_t compiled_unit_forwards = 0;
  std::vector<Recompile> eval_recompiles;
  int64_t eval_eager_batches = 0;  // eval batches that ran eager over the recompile limit
  /// "graphs", "recompiles", "eager_micro_steps" (the step's), "eval": {"graphs", "recompiles",
  /// "eager_batches"}, "granularity", "units" (per-unit mode: unit_graphs, each with its
  /// "forward" and "backward" package), and the rest; each graph names its kind ("graph":
  /// "train" | "eval").
  nlohmann::json to_json() const;
};

/// The Trainer's compiled forward+backward and eval forward (compile.backend = "inductor").
/// Under train.precision = "bf16-mixed"/"fp16-mixed" the graphs are exported under
/// torch.autocast(device, bf16/fp16), the policy kiln's eager step runs under (ATen's autocast
/// op lists); the parameters stay fp32 (kiln's), and under fp16-mixed the train graph takes the
/// loss scaler's scale as an input and returns the gradients of loss x scale, which the Trainer
/// unscales as in eager. The precision is part of each package's fingerprint.
/// Builds or loads one package per graph kind ("train": loss and gradients; "eval": loss, and
/// correct predictions for a classifier) and shape, on first use of that shape; binds the
/// model's own parameter tensors to the package's constants by name without copying, so the
/// optimizer's in-place updates are what the next step and the next evaluation read. Each kind
/// has its own ShapeTracker (compile.dynamic, compile.recompile_limit). Not thread-safe: the
/// training thread only.
///
/// Per-unit mode (compile.granularity resolving to "unit"): the constructor adds a UnitWrapper to
/// the model, innermost (so construct it after activation checkpointing and FSDP attached their
/// wrappers), that runs each unit through its compiled forward package inside an autograd
/// function whose backward runs the unit's backward package; the root (embeddings, final norm,
/// head, loss) stays eager, and forward_backward/evaluate return undefined tensors so the Trainer
/// runs its eager step around the compiled units. A unit runs eager when the autocast state
/// differs from train.precision's, over compile.recompile_limit, or after graph breaks with
/// compile.fullgraph = false. The model's wrapper refers to this object (its cache and report):
/// keep it alive while the model runs (the Trainer holds it after set_step_executor). See
/// docs/compile.md, "Per-unit compilation".
class CompiledStep : public StepExecutor {
 public:
  /// Throws UserError (bad setup, see check_compile_start), TrainingError (graph breaks with
  /// compile.fullgraph = true, listing every break).
  CompiledStep(const Config& config, Model& model, torch::Device device);
  ~CompiledStep() override;

  /// Throws UserError when `loss_scale` is defined and train.precision is not "fp16-mixed" (or
  /// the reverse): the package was built for the other.
  torch::Tensor forward_backward(Trainer& trainer, const Batch& batch, double scale,
                                 const torch::Tensor& loss_scale) override;
  /// Through the eval package of the batch's shape (built or loaded on first use); undefined
  /// outputs when the batch runs eager (graph breaks with fullgraph = false, over the limit).
  /// Throws as the constructor does, when the eval package is built.
  EvalOutputs evaluate(const Batch& batch) override;
  /// Builds (or finds in the cache) the training graph for `shapes` now, as the first step would.
  /// Per-unit mode: nothing (each unit builds or loads its pair on its first call).
  void prepare(const InputShapes& shapes);
  /// The same for the eval graph, as the first evaluation would.
  void prepare_eval(const InputShapes& shapes);
  const CompileReport& report() const { return report_; }
  bool per_unit() const { return units_ != nullptr; }

  struct Loaded;  // implementation detail (src/compile/compiled_step.cpp)

 private:
  struct Kind {  // one graph kind's shapes and loaded packages
    bool eval = false;
    ShapeTracker tracker;
    std::vector<std::unique_ptr<Loaded>> loaded;
  };
  /// Builds or loads the package of `kind` for `shape` (narrowed to what the package accepts);
  /// returns its index, or SIZE_MAX when graph breaks made the step fall back to eager.
  size_t load_graph(Kind& kind, GraphShape& shape);
  size_t resolve(Kind& kind, const InputShapes& shapes);

  CompileOptions options_;
  TrainOptions::Precision precision_;
  Model& model_;
  torch::Device device_;
  nlohmann::json model_json_;
  std::vector<std::pair<std::string, torch::Tensor>> parameters_;
  PackageCache cache_;
  Kind train_, eval_;
  CompileReport report_;
  std::shared_ptr<UnitWrapper> units_;  // per-unit mode: the wrapper added to the model
};

/// Attaches what compile.backend asks for to `trainer`: the AOTInductor step ("inductor",
/// "inductor+cudagraphs"; returned) and the CUDA-graph capture ("cudagraphs",
/// "inductor+cudagraphs"; attach_captured_step). Returns null when there is no AOTInductor step.
/// Throws what CompiledStep's constructor throws.
std::shared_ptr<CompiledStep> attach_compiled_step(Trainer& trainer, const Config& config);

// ---- CUDA graphs -------------------------------------------------------------------------------

/// A host synchronisation inside a step: an operator that makes the host wait for the device
/// (aten::_local_scalar_dense behind .item() and Python's `if tensor:`, aten::nonzero). A CUDA
/// graph cannot capture one: for compile.backend = "cudagraphs" each is a graph break. Calls from
/// inside the fused optimizers are not counted: their CPU kernels read the tensor learning rate
/// with .item(), their CUDA kernels read it on the device.
struct HostSync {
  std::string op;      // "aten::_local_scalar_dense"
  std::string caller;  // the outermost operator it ran inside ("aten::item"); "" at top level
  std::string phase;   // the Trainer phase it ran in ("forward", ...); "" outside phases
  /// "aten::_local_scalar_dense in aten::item (forward)".
  std::string str() const;
};

/// Watches for host synchronisations while active: a RecordFunction callback on the thread that
/// starts it (autograd's threads inherit it), and the Trainer's phases as a TrainerHook (add it to
/// the trainer to get phase names). Training thread only; start/stop must pair. Several probes may
/// be active at once (ranks as threads of one process); each then also sees the synchronisations
/// of the other probed threads.
class HostSyncProbe : public TrainerHook {
 public:
  HostSyncProbe() = default;
  ~HostSyncProbe() override;
  HostSyncProbe(const HostSyncProbe&) = delete;
  HostSyncProbe& operator=(const HostSyncProbe&) = delete;
  void start();
  /// Stops watching; returns the synchronisations seen since start(), in order, each distinct
  /// (op, caller, phase) once.
  std::vector<HostSync> stop();
  void on_phase_begin(Trainer&, Phase phase) override;
  void on_phase_end(Trainer&, Phase phase) override;

  struct State;  // implementation detail (src/compile/host_sync.cpp)

 private:
  std::shared_ptr<State> state_;
  uint64_t handle_ = 0;
  bool active_ = false;
};

/// One captured graph's mechanics. The CUDA implementation (at::cuda::CUDAGraph on a side stream,
/// all graphs sharing one memory pool) is built only against a CUDA LibTorch; tests on the CPU
/// use an implementation that runs the work again on every replay.
class GraphRecorder {
 public:
  virtual ~GraphRecorder() = default;
  /// Runs `work` as a warm-up (CUDA: on the side stream the capture will use).
  virtual torch::Tensor warm_up(const std::function<torch::Tensor()>& work) = 0;
  /// Captures `work` and returns its output tensor, which each replay overwrites. Whether the
  /// capture also executed the work once is executed_on_capture().
  virtual torch::Tensor capture(const std::function<torch::Tensor()>& work) = 0;
  virtual bool executed_on_capture() const = 0;
  /// Replays the capture. `work` is what was captured: implementations that cannot record run it
  /// again (the CUDA recorder ignores it).
  virtual void replay(const std::function<torch::Tensor()>& work) = 0;
};
/// Makes one recorder per captured shape.
using GraphRecorderFactory = std::function<std::unique_ptr<GraphRecorder>()>;
/// CUDA graphs on `device` (one shared memory pool for every recorder the factory makes). Throws
/// UserError when kiln was built without CUDA or `device` is not a CUDA device.
GraphRecorderFactory cuda_graph_recorders(torch::Device device);
/// For tests on the CPU: warm-up and capture run the work; a replay runs it again into the same
/// output tensor.
GraphRecorderFactory rerun_recorders();

/// The Trainer's captured step (compile.backend = "cudagraphs" or "inductor+cudagraphs"). Per
/// micro-batch shape: compile.warmup_steps eager warm-up steps (the first of the run also probes
/// for host synchronisations: each is a graph break; compile.fullgraph = true stops with the
/// list, false runs every step eager and says so), then one capture of the whole step into
/// static input buffers, then replays (the batches are copied into the buffers, the learning rate
/// into the optimizer's lr tensor). A new shape is a recapture, counted as a recompile, up to
/// compile.recompile_limit; later new shapes run eager. Not thread-safe: training thread only.
class CapturedGraphStep : public CapturedStep {
 public:
  /// Switches the optimizer to a device learning rate (needs optim.fused) and adds the host-sync
  /// probe to `trainer`. Throws UserError.
  CapturedGraphStep(const Config& config, Trainer& trainer, GraphRecorderFactory recorders);
  ~CapturedGraphStep() override;
  torch::Tensor run_captured(const std::vector<Batch>& batches, double lr,
                             const BatchWork& work) override;
  const CompileReport& report() const { return report_; }
  /// Steps run by replaying a capture / eagerly (warm-ups, fallback, shapes over the limit).
  int64_t replays() const { return replays_; }
  int64_t eager_steps() const { return eager_steps_; }

  struct Graph;  // implementation detail (src/compile/captured_step.cpp)

 private:
  CompileOptions options_;
  Trainer& trainer_;
  GraphRecorderFactory recorders_;
  std::shared_ptr<HostSyncProbe> probe_;
  bool probed_ = false;
  ShapeTracker tracker_;
  std::vector<std::unique_ptr<Graph>> graphs_;
  torch::Tensor lr_;
  CompileReport report_;
  int64_t replays_ = 0, eager_steps_ = 0;
};

/// Attaches the captured step to `trainer` when compile.backend is "cudagraphs" or
/// "inductor+cudagraphs" (null otherwise), on CUDA graphs. Throws UserError.
std::shared_ptr<CapturedGraphStep> attach_captured_step(Trainer& trainer, const Config& config);

}  // namespace kiln
