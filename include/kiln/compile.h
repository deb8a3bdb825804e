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
// The compiler's internals the steps below hold (src/compile/internal.h).
class ShapeTracker;
class PackageCache;
class HostSyncProbe;

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
  int jobs = 1;  // resolved: compile.jobs, 0 -> the machine's cores (at least 1)
  /// Per unit with a compiled root, cold: find every piece's signature in one eager forward and
  /// build the missing pairs side by side (jobs >= 2). Not a key: attach_compiled_step turns it
  /// off for a job of several processes (ranks whose caches differ would decide differently,
  /// and FSDP's forward gathers are collectives).
  bool prebuild_pieces = true;
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

/// One recompile: a micro-batch whose shapes no graph accepted.
struct Recompile {
  InputShapes shapes;
  std::string reason;     // "inputs dim 1 changed 16 -> 8 (seq)"
  bool compiled = false;  // false: over compile.recompile_limit, the shape runs eager
};

// ---- graph breaks ------------------------------------------------------------------------------

struct GraphBreak {
  std::string reason;
  std::string where;  // "models.py:57 in forward"
};

/// One line per break: "graph break at models.py:57 in forward: <reason>".
std::string describe_breaks(const std::vector<GraphBreak>& breaks);

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
  /// compile.fullgraph = true, listing every break). `model` must outlive the step (the Trainer
  /// that owns the model holds the step as its executor).
  /// `options` and `precision` come from a validated Config (CompileOptions::from_config,
  /// TrainOptions::from_config): the [compile] rules are the config's, not re-checked here.
  CompiledStep(const CompileOptions& options, TrainOptions::Precision precision, Model& model,
               torch::Device device);
  ~CompiledStep() override;

  /// Throws UserError when `loss_scale` is defined and train.precision is not "fp16-mixed" (or
  /// the reverse): the package was built for the other.
  torch::Tensor forward_backward(Trainer& trainer, const Batch& batch, double scale,
                                 const torch::Tensor& loss_scale) override;
  /// Through the eval package of the batch's shape (built or loaded on first use); undefined
  /// outputs when the batch runs eager (graph breaks with fullgraph = false, over the limit).
  /// Throws as the constructor does, when the eval package is built.
  EvalOutputs evaluate(const Batch& batch) override;
  /// Builds (or finds in the cache) the training graph for `train` and, when given, the eval
  /// graph for `eval` now, as the first step and the first evaluation would. Two packages that
  /// both miss the cache build at once, in two compiler processes (each compiles its graph's
  /// C++ serially), when compile.jobs allows two; they load on this thread, train first,
  /// so the report and the graph-break handling are those of a serial build. Per-unit mode:
  /// nothing (each unit builds or loads its pair on its first call).
  void prepare(const InputShapes& train, const std::optional<InputShapes>& eval = std::nullopt);
  const CompileReport& report() const { return report_; }
  bool per_unit() const { return units_ != nullptr; }

  struct Loaded;  // implementation detail (src/compile/compiled_step.cpp)

 private:
  struct Build;  // a package as building or finding it left it (src/compile/compiled_step.cpp)
  struct Kind {  // one graph kind's shapes and loaded packages
    bool eval = false;
    std::unique_ptr<ShapeTracker> tracker;
    std::vector<std::unique_ptr<Loaded>> loaded;
    std::unique_ptr<Build> built;  // prepare's build, not loaded yet
  };
  /// Builds the package of graph kind `eval` for `shape` unless the cache has it; any thread
  /// (`threads`: the training thread's intra-op thread count, which the compiler runs with).
  Build build_package(bool eval, const GraphShape& shape, int threads) const;
  /// Loads the package of `kind` for `shape` (narrowed to what the package accepts), building it
  /// first unless prepare did; returns its index, or SIZE_MAX when graph breaks made the step
  /// fall back to eager.
  size_t load_graph(Kind& kind, GraphShape& shape);
  size_t resolve(Kind& kind, const InputShapes& shapes);

  CompileOptions options_;
  TrainOptions::Precision precision_;
  Model& model_;
  torch::Device device_;
  nlohmann::json model_json_;
  std::vector<std::pair<std::string, torch::Tensor>> parameters_;
  /// The model's buffers (an exported model's rotary tables): bound as constants, never written.
  std::vector<std::pair<std::string, torch::Tensor>> buffers_;
  std::unique_ptr<PackageCache> cache_;
  Kind train_, eval_;
  CompileReport report_;
  std::shared_ptr<UnitWrapper> units_;  // per-unit mode: the wrapper added to the model
};

/// Attaches the AOTInductor step compile.backend asks for ("inductor", "inductor+cudagraphs") to
/// `trainer` and returns it; null when there is none. The CUDA-graph capture is the next stage,
/// attach_captured_step (compose_training calls both, in that order). Throws what CompiledStep's
/// constructor throws.
std::shared_ptr<CompiledStep> attach_compiled_step(Trainer& trainer, const Config& config);

// ---- CUDA graphs -------------------------------------------------------------------------------

/// One captured graph's mechanics (src/compile/internal.h).
class GraphRecorder;
/// Makes one recorder per captured shape.
using GraphRecorderFactory = std::function<std::unique_ptr<GraphRecorder>()>;

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
  /// probe to `trainer`, which must outlive the step (it holds the step as its runner). Throws
  /// UserError.
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
  std::unique_ptr<ShapeTracker> tracker_;
  std::vector<std::unique_ptr<Graph>> graphs_;
  torch::Tensor lr_;
  CompileReport report_;
  int64_t replays_ = 0, eager_steps_ = 0;
};

/// Attaches the captured step to `trainer` when compile.backend is "cudagraphs" or
/// "inductor+cudagraphs" (null otherwise), on CUDA graphs. Throws UserError.
std::shared_ptr<CapturedGraphStep> attach_captured_step(Trainer& trainer, const Config& config);

}  // namespace kiln
