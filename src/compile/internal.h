// The compiler's internals (not public API): the shape tracker, the package cache and the
// compiler's Python, the host-sync probe and the graph recorders. kiln/compile.h holds the
// contract (options, the report, the steps); tests reach these through src/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kiln/compile.h"
#include "kiln/train.h"

namespace kiln {

/// The dimensions that may become dynamic for a model, with their ranges: batch (dim 0 of both)
/// in [2, 65536]; for token inputs ([B, T]) also seq (dim 1 of both) in [2, max_seq_len].
std::vector<DynamicDim> dynamic_candidates(const InputShapes& shapes, int64_t max_seq_len);

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

/// CUDA graphs on `device` (one shared memory pool for every recorder the factory makes). Throws
/// UserError when kiln was built without CUDA or `device` is not a CUDA device.
GraphRecorderFactory cuda_graph_recorders(torch::Device device);
/// For tests on the CPU: warm-up and capture run the work; a replay runs it again into the same
/// output tensor.
GraphRecorderFactory rerun_recorders();

}  // namespace kiln
