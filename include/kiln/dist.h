// Distributed training: the process group a kiln process belongs to, and data parallelism.
//
// The Communicator interface is in kiln/comm.h.
//
// A distributed process is started by a launcher, one process per device: torchrun
// (`torchrun --no-python --nproc-per-node=N kiln train cfg.toml`) or Slurm (`srun kiln train`).
// process_communicator() reads the launcher's environment, meets the other ranks through c10d's
// TCPStore and builds a c10d process group: Gloo on CPU, NCCL on CUDA (device = LOCAL_RANK). See
// docs/scale.md for launch lines, the [dist] keys and the fault behaviour.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/comm.h"
#include "kiln/error.h"
#include "kiln/train.h"

namespace kiln {

class Config;

/// The data parallelism a job runs with: alone (one process, or a world of one without a
/// process group), DDP (whole replicas) or FSDP (sharded).
enum class Parallelism { kNone, kDdp, kFsdp };
/// "none", "ddp", "fsdp": the names dist.strategy, scale.json and plan.json use.
std::string_view to_string(Parallelism parallelism);

// ---- the launcher's environment ----------------------------------------------------------------

/// Where this process sits in a distributed job, as its launcher described it.
struct DistEnvironment {
  std::string launcher = "none";  // "torchrun" (WORLD_SIZE set), "slurm" (srun), or "none"
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // host of the rendezvous store
  int master_port = 0;
  int restart_count = 0;     // TORCHELASTIC_RESTART_COUNT (torchrun --max-restarts)
  bool agent_store = false;  // torchrun's agent already hosts the store: every rank is a client
  /// A real process group is created: always for a world larger than one; for a world of one
  /// under torchrun when dist.backend names a backend ("gloo" or "nccl", not "auto"), so that
  /// DDP/FSDP and their collectives really run on one device (scripts/gpu-check proves NCCL so).
  bool process_group = false;
};

/// The [dist] keys that say how a process joins its group (dist/options.cpp reads them).
struct ProcessGroupOptions {
  enum class Launcher { kAuto, kTorchrun, kSlurm, kNone };
  enum class Backend { kAuto, kGloo, kNccl };  // kAuto: NCCL on CUDA, else Gloo
  enum class Strategy { kAuto, kDdp, kFsdp };  // kAuto: by the model's memory (resolve_strategy)
  Launcher launcher = Launcher::kAuto;         // dist.launcher: "auto", "torchrun", "slurm", "none"
  Backend backend = Backend::kAuto;            // dist.backend: "auto", "gloo", "nccl"
  std::string master_addr;                     // dist.master_addr (MASTER_ADDR wins)
  int master_port = 29500;                     // dist.master_port (MASTER_PORT wins)
  double timeout_seconds = 300;                // dist.timeout_seconds
  std::string torchrun;                        // dist.torchrun ("": found, see find_torchrun)
  std::string device = "cpu";                  // run.device (the backend "auto" resolves by it)
  std::string config_hash;                     // Config::hash(): every rank must train the same job
  Strategy strategy = Strategy::kAuto;         // dist.strategy: "auto", "ddp", "fsdp"
  int64_t dp_replicate = 0;        // dist.dp_replicate: FSDP's replicas (0: auto, fsdp_mesh_shape)
  int64_t tp = 1;                  // dist.tp: tensor-parallel ranks (DeviceMesh)
  bool tp_across_nodes = false;    // dist.tp_across_nodes
  double device_memory_bytes = 0;  // dist.device_memory_bytes (0: the device's own)
  double memory_headroom = 0.1;    // dist.memory_headroom
  static ProcessGroupOptions from_config(const Config& config);
};

/// dist.backend's name: "auto", "gloo", "nccl".
std::string_view to_string(ProcessGroupOptions::Backend backend);
/// dist.strategy's name: "auto", "ddp", "fsdp".
std::string_view to_string(ProcessGroupOptions::Strategy strategy);

/// Looks up an environment variable; nullptr when unset. Tests pass a map instead of ::getenv.
using EnvLookup = std::function<const char*(const char*)>;

/// Reads the launcher's variables. torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE. Slurm:
/// SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, with the master address from
/// MASTER_ADDR or dist.master_addr and the port from MASTER_PORT or dist.master_port. dist.launcher
/// picks one ("auto": torchrun when WORLD_SIZE is set, else Slurm inside an srun step with more
/// than one task, else one process). Sets process_group (see there). Pure apart from `env`. Throws
/// UserError naming the variable or key and the fix: WORLD_SIZE without a master address, a rank
/// outside [0, WORLD_SIZE), ...
DistEnvironment read_dist_environment(const ProcessGroupOptions& options, const EnvLookup& env);

/// Under a launcher that sets LOCAL_RANK (torchrun), asks the kernel to SIGKILL this process when
/// its parent (the launcher's agent) dies (prctl PR_SET_PDEATHSIG), and exits at once (status
/// 137, like that SIGKILL) when the parent is already gone. torchrun starts its workers in
/// sessions of their own, so without this a worker whose agent was killed trains on as an
/// orphan. The kill abandons an in-flight async save; its .tmp directory is removed by the next
/// run. Call first thing in main(). Does nothing without LOCAL_RANK or off Linux.
void die_with_launcher();

/// This process's communicator. The first call reads the environment (read_dist_environment with
/// ::getenv); when DistEnvironment::process_group it joins the rendezvous (c10d TCPStore at
/// MASTER_ADDR:MASTER_PORT, as a client when torchrun's agent hosts it, else hosted by rank 0),
/// creates the process group (dist.backend: Gloo on CPU, NCCL on CUDA), sets the log prefix to
/// "rank R/W", and all-gathers every rank's Config::hash(): ranks started with different configs
/// all throw UserError naming the differing hashes. Later calls return the same communicator (a
/// process has one process group; it lives until the process exits). Without a launcher, or for
/// a world of one unless DistEnvironment::process_group says otherwise, it is
/// single_process_communicator(). Call from the main thread. Throws UserError (bad environment,
/// config mismatch) or CommunicationError (the other ranks did not arrive within
/// dist.timeout_seconds).
std::shared_ptr<Communicator> process_communicator(const Config& config);

// ---- the device mesh ---------------------------------------------------------------------------

/// The dimensions of a job's ranks: dp_replicate x dp_shard x tp (the world). Tensor parallelism
/// splits each layer over tp ranks; data parallelism runs over the dp_replicate x dp_shard ranks
/// holding the same tensor-parallel slice. FSDP shards the training state over dp_shard of them
/// and replicates it dp_replicate times (hybrid sharding, HSDP: reduce-scatter inside a shard
/// group, all-reduce of the shards across the replicas); dp_replicate = 1 is FSDP over every
/// data-parallel rank; DDP is dp_replicate = the data-parallel ranks, dp_shard = 1.
struct MeshShape {
  int dp_replicate = 1;
  int dp_shard = 1;
  int tp = 1;
  int dp_size() const { return dp_replicate * dp_shard; }
  int size() const { return dp_replicate * dp_shard * tp; }
  /// "2 x 4 (dp_replicate x dp_shard)", "2 x 1 x 2 (dp_replicate x dp_shard x tp)" when tp > 1.
  std::string text() const;
};

/// One rank's place in a mesh and a communicator per dimension. Ranks are laid out with tp
/// innermost, then dp_shard: rank = (replica * dp_shard + shard_index) * tp + tp_index, so a
/// tensor-parallel group is consecutive ranks, and so is a shard group when tp = 1 (one node's
/// when it divides LOCAL_WORLD_SIZE, torchrun's local ranks being consecutive).
struct DeviceMesh {
  MeshShape shape;
  std::shared_ptr<Communicator> world;      // every rank
  std::shared_ptr<Communicator> dp;         // the data-parallel ranks of this tp slice
  std::shared_ptr<Communicator> shard;      // the dp_shard ranks of this replica and slice
  std::shared_ptr<Communicator> replicate;  // the dp_replicate ranks holding this shard; null at 1
  std::shared_ptr<Communicator> tp;         // the tp ranks of this data-parallel rank; null at 1
  int replica = 0;                          // this rank's index along dp_replicate
  int shard_index = 0;                      // this rank's index along dp_shard (shard->rank())
  int tp_index = 0;                         // this rank's index along tp
  int dp_index() const { return replica * shape.dp_shard + shard_index; }  // dp->rank()
};

/// The mesh of `shape` over `world` (a collective: every rank calls it, creating its groups in
/// one order, tp, dp, dp_shard, dp_replicate, through Communicator::subgroup; a dimension
/// spanning the whole world reuses `world`). Throws UserError naming dist.dp_replicate and
/// dist.tp when the shape's size is not the world size.
DeviceMesh build_device_mesh(std::shared_ptr<Communicator> world, const MeshShape& shape);

/// The mesh dist.dp_replicate and dist.tp ask of a job of `world_size` ranks under FSDP: tp
/// must divide the world; then dp_replicate 0 ("auto") is `auto_replicas` (the plan's choice, 1
/// when it has none) and n must divide the data-parallel ranks (UserError naming the key, the
/// sizes and the divisors otherwise). Pure.
MeshShape fsdp_mesh_shape(int64_t dp_replicate, int world_size, int auto_replicas = 1,
                          int64_t tp = 1);
/// DDP's mesh (also a job without data parallelism) with tensor parallelism over `tp`:
/// dp_replicate = world_size / tp, dp_shard = 1. Throws UserError naming dist.tp when tp does
/// not divide the world.
MeshShape ddp_mesh_shape(int world_size, int64_t tp = 1);

// ---- data parallelism
// ----------------------------------------------------------------------------

struct DataParallelOptions {
  int64_t bucket_bytes = 25 << 20;       // dist.bucket_mb: gradient bytes per all-reduce
  int64_t first_bucket_bytes = 1 << 20;  // dist.first_bucket_mb: the first (last-layer) bucket
};

/// The options the config gives (dist.bucket_mb, dist.first_bucket_mb).
DataParallelOptions data_parallel_options(const Config& config);

/// Partitions parameters into all-reduce buckets. `bytes` lists each parameter's gradient bytes in
/// the order gradients become ready (reverse registration order); the result lists, per bucket,
/// indices into `bytes`, consecutive. A bucket closes once it holds at least its cap (the first
/// bucket's cap is first_bucket_bytes, the others' bucket_bytes); a parameter larger than the cap
/// gets a bucket of its own. Pure.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<int64_t>& bytes,
                                                const DataParallelOptions& options);

/// DDP as a TrainerHook. Gradients are averaged across ranks with bucketed sum all-reduces that
/// start from autograd hooks (post-accumulate-grad) as soon as every gradient of a bucket is ready,
/// in bucket order, so communication overlaps the rest of backward. Only the last micro-step of a
/// step communicates (no_sync semantics for gradient accumulation); on_gradients_ready waits for
/// the buckets (marked Phase::kComm) and writes the averages back as the parameters' gradients, so
/// clipping sees the global gradient. A parameter whose gradient came only from earlier micro-steps
/// contributes that gradient; one without a gradient on a rank contributes zeros. Not thread-safe:
/// it runs inside the Trainer, on the training thread, except the gradient hooks, which run on the
/// thread executing backward (autograd's device thread on CUDA) while the training thread waits.
class DataParallel : public TrainerHook {
 public:
  ~DataParallel() override;
  /// Broadcasts rank 0's parameters and buffers to every rank, confirms with an all-gathered
  /// weights_hash (throws CommunicationError naming the ranks whose weights differ), registers
  /// the gradient hooks and adds itself to `trainer`. With single_process_communicator() it only
  /// returns a hook that does nothing; a process group of one (DistEnvironment::process_group)
  /// runs every all-reduce. Throws UserError for a model with no trainable parameters.
  static std::shared_ptr<DataParallel> attach(Trainer& trainer, std::shared_ptr<Communicator> comm,
                                              const DataParallelOptions& options);
  /// Bytes of each bucket, in launch order.
  std::vector<int64_t> bucket_bytes() const;
  /// Bucket all-reduces started since attach (no_sync steps start none).
  int64_t bucket_all_reduces() const;

  void on_micro_step_begin(Trainer& trainer, int micro_step, bool last) override;
  void on_gradients_ready(Trainer& trainer) override;

  struct State;  // implementation detail (src/dist/ddp.cpp)

 private:
  explicit DataParallel(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// ---- fully sharded data parallelism (FSDP) ------------------------------------------------------

/// One rank's shard of a parameter under sharded data parallelism (kiln/dist.h's
/// sharded_layout()).
struct ParameterShard {
  std::string name;     // the parameter's name
  torch::Tensor shard;  // the tensor the optimizer steps: rows [row_offset, row_offset + rows) of
                        // the parameter along dim 0, then padding rows (zeros)
  std::vector<int64_t> global_shape;  // the parameter's shape (its tensor-parallel slice's)
  int64_t row_offset = 0;
  int64_t rows = 0;  // rows that are the parameter's (0: padding only)
  /// Tensor parallelism: the parameter is this rank's slice of a larger one (its placement, see
  /// Model::tensor_parallel()); the checkpoint's piece is placed in the whole parameter.
  std::optional<TensorParallelPlacement> tensor_parallel;
  /// Whether this rank writes the piece (TensorPiece::saved): false for a copy another rank
  /// saves (hybrid sharding's replicas beyond the first; a parameter tensor parallelism keeps
  /// whole, on tp ranks beyond the first).
  bool saved = true;
};

/// The layout of sharded data parallelism over `comm`: the optimizer steps `shards`; the global
/// gradient norm sums the ranks' squared shard norms (and their fp16 overflow flags) over
/// `comm`, and those of tensor-parallel slices over `tp` too (null: no tensor parallelism), so
/// clipping and the non-finite guard agree on every rank; the state lists each shard's own rows
/// (padding dropped; none when it holds padding only) and the same rows of its optimizer state,
/// as pieces of the whole parameters (TrainState::pieces). FullyShardedDataParallel installs it.
std::shared_ptr<ParallelLayout> sharded_layout(std::vector<ParameterShard> shards,
                                               std::shared_ptr<Communicator> comm,
                                               std::shared_ptr<Communicator> tp = nullptr);

// ---- tensor parallelism ------------------------------------------------------------------------

/// Tensor parallelism over mesh.tp, the first piece of the parallel layout
/// (CompositionStage::kTensorParallel): rank 0's weights broadcast over mesh.world (every rank
/// starts from the same whole model), then Model::shard_tensor_parallel(mesh.tp), then a layout
/// whose optimizer steps every parameter (slices and whole ones), whose gradient norm sums the
/// slices' squares over mesh.tp, and whose state lists each slice as a piece of the whole
/// parameter (saved by data-parallel rank 0; DDP's other ranks hold the same slice). DDP
/// (over mesh.dp) or FSDP (FullyShardedDataParallel::attach with the mesh) goes on after it.
/// Throws UserError for a model without a tensor-parallel plan.
void install_tensor_parallel(Trainer& trainer, const DeviceMesh& mesh);

struct FsdpOptions {
  /// dist.reshard_after_forward: free a unit's gathered parameters after its forward and gather
  /// them again for its backward (ZeRO-3); false keeps them from forward until the unit's
  /// backward is done (ZeRO-2).
  bool reshard_after_forward = true;
  /// dist.fsdp_accumulate: with gradient accumulation, "unsharded" keeps full gradients across
  /// micro-steps and communicates on the last one only (like no_sync); "sharded" reduce-scatters
  /// every micro-step into the sharded gradients (less memory, more traffic).
  bool accumulate_sharded = false;
  /// dist.fsdp_prefetch: issue the next unit's all-gather before the current unit computes
  /// (forward and backward), so communication overlaps compute.
  bool prefetch = true;
  /// The dtype parameters are all-gathered and computed in (FSDP2's MixedPrecisionPolicy
  /// param_dtype): fsdp_options() sets train.precision's compute dtype (bf16-mixed: bfloat16,
  /// fp16-mixed: float16); unset: the parameters' own dtype. The shards, the optimizer state and
  /// the gradients' reduce-scatter stay in the shards' dtype (fp32: FSDP2's reduce_dtype).
  std::optional<torch::ScalarType> param_dtype;
};

/// The options the config gives (dist.reshard_after_forward, dist.fsdp_accumulate,
/// dist.fsdp_prefetch).
FsdpOptions fsdp_options(const Config& config);

/// How one parameter is sharded: on dim 0 in chunks of ceil(rows / world) rows (a 0-dim
/// parameter counts as one row); rank r holds rows [r * rows_per_rank, (r + 1) * rows_per_rank)
/// of the full parameter, padded with zero rows past its end (the last ranks may hold only
/// padding).
struct ShardLayout {
  std::string name;            // as named_parameters() spells it
  std::vector<int64_t> shape;  // the full parameter's shape
  int64_t rows = 1;            // full size of dim 0
  int64_t rows_per_rank = 1;   // ceil(rows / world_size)
  int64_t row_numel = 1;       // elements per row
  /// Rows of the full parameter that rank `rank` holds (the rest of its shard is padding).
  int64_t valid_rows(int rank) const;
  /// The shard's shape: the full shape with dim 0 = rows_per_rank.
  std::vector<int64_t> shard_shape() const;
};

/// The layout of a parameter of `shape` over `world_size` ranks. Pure.
ShardLayout shard_layout(const std::string& name, const std::vector<int64_t>& shape,
                         int world_size);

/// Per-rank bytes of the training state under FSDP, as the scale rung reports them.
struct FsdpMemory {
  int64_t parameter_shards = 0;  // this rank's parameter shards (padding included)
  int64_t gradient_shards = 0;   // this rank's sharded gradients
  int64_t gathered_peak = 0;     // most gathered (full) parameter bytes alive at once
  int64_t largest_unit = 0;      // full bytes of the largest group
  int64_t gathered_now = 0;      // gathered (full) parameter bytes alive now
};

/// FSDP as a TrainerHook and a UnitWrapper (kiln/models.h). Sharding groups: each of
/// Model::units() and the root group (every trainable parameter in no unit: gpt's embeddings,
/// final norm and tied head). Each rank keeps its shard of every parameter (ShardLayout); the
/// model's parameters keep their shapes but their storage is released (0 bytes) whenever they are
/// not gathered, and re-allocated in place before the all-gather copies into them, so autograd's
/// saved references to them see the regathered data.
///
///  - forward: a unit is all-gathered (one flat all-gather per unit) before it runs, and freed
///    after (reshard_after_forward) or kept until its backward is done; the root group is
///    gathered at each micro-step's start (and around evaluate()) and kept until its gradients
///    are reduced. With prefetch the next unit's all-gather is in flight while a unit computes.
///  - backward: a hook on the unit's output gathers it again (when freed) before its backward
///    runs and prefetches the previous unit; when every parameter of a group has accumulated its
///    gradient, the group's full gradients are reduce-scattered (sum, then divided by the world
///    size), asynchronously, groups in a fixed order (units last to first, then the root), and
///    its full parameters and gradients are freed.
///  - on_gradients_ready waits for the reduce-scatters and sets each shard's gradient; the
///    Trainer's optimizer holds and steps the shards only (sharded_layout()), and
///    the gradient norm sums squared shard norms over the ranks.
///  - mixed precision (FsdpOptions::param_dtype, e.g. bfloat16): the shards stay in their dtype
///    (fp32); each all-gather sends a cast copy of the shard, so the model's parameters are
///    param_dtype while gathered (compute under the Trainer's autocast) and their gradients too;
///    the gradients are cast to the shards' dtype before the reduce-scatter (reduced in fp32).
///  - activation checkpointing (a unit wrapper added before this one, kiln/models.h): its
///    forward runs without grad, so the unit is freed after it; its recomputation in backward
///    runs this wrapper again, which gathers the unit (when freed), prefetches the previous one
///    and leaves the unit gathered for the backward that follows.
///
/// Every rank must produce gradients for the same parameters in each micro-step (true for kiln's
/// models): a group whose gradients are incomplete is reduced only at the step's end. Not
/// thread-safe: the same threading as DataParallel. The model's parameters are not readable
/// outside forward and backward: use full_parameters().
class FullyShardedDataParallel : public TrainerHook,
                                 public UnitWrapper,
                                 public std::enable_shared_from_this<FullyShardedDataParallel> {
 public:
  ~FullyShardedDataParallel() override;
  /// Broadcasts rank 0's parameters and buffers to every rank (checked with an all-gathered
  /// weights_hash, as DataParallel), keeps this rank's shards, frees the full parameters, gives
  /// the shards to the trainer's optimizer, and adds itself to the trainer and as the model's unit
  /// wrapper. Throws UserError for a model with no trainable parameters; CommunicationError as
  /// DataParallel::attach. A world of one shards nothing but runs the same code.
  static std::shared_ptr<FullyShardedDataParallel> attach(Trainer& trainer,
                                                          std::shared_ptr<Communicator> comm,
                                                          const FsdpOptions& options);
  /// Hybrid sharding (HSDP) over `mesh`: rank 0's weights broadcast over mesh.world; the state
  /// sharded over mesh.shard as above; each reduce-scattered gradient shard then summed over
  /// mesh.replicate (the ranks holding the same shard) and divided by the mesh's size, so every
  /// replica steps the same shard. The gradient norm sums over mesh.shard only (the replicas'
  /// shards are equal); checkpoints hold one copy of each shard (replica 0's; the others load
  /// theirs from it). With sharded accumulation the replicas all-reduce every micro-step. A 1-D
  /// mesh is the overload above.
  static std::shared_ptr<FullyShardedDataParallel> attach(Trainer& trainer, const DeviceMesh& mesh,
                                                          const FsdpOptions& options);
  /// All-reduces over the replicas since attach (0 without replicas).
  int64_t replica_all_reduces() const;

  /// This rank's shard of every trainable parameter, named like the parameter (the tensors the
  /// optimizer steps; padding rows included).
  NamedTensors shards() const;
  /// Every trainable parameter's layout, in registration order.
  std::vector<ShardLayout> layouts() const;
  /// The full parameters (padding dropped) in the shards' dtype (fp32 also under mixed
  /// precision), gathered from every rank: one all-gather per group, a collective, call on every
  /// rank from the training thread outside a step. Copies.
  NamedTensors full_parameters();
  /// weights_hash() of the model with every parameter's full value (full_parameters(), in the
  /// shards' dtype) in place for the call only: what DDP would report for the same weights. A
  /// collective, like full_parameters().
  std::string full_weights_hash();
  /// The sharding groups' names: the units, then "root" (when it has parameters).
  std::vector<std::string> group_names() const;
  /// Collectives started since attach.
  int64_t all_gathers() const;
  int64_t reduce_scatters() const;
  /// Bytes of the state this rank holds, and the gathered-parameter peak since attach.
  FsdpMemory memory() const;

  void on_micro_step_begin(Trainer& trainer, int micro_step, bool last) override;
  void on_gradients_ready(Trainer& trainer) override;
  void on_phase_begin(Trainer& trainer, Phase phase) override;
  void on_phase_end(Trainer& trainer, Phase phase) override;
  torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) override;

  struct State;  // implementation detail (src/dist/fsdp.cpp)

 private:
  explicit FullyShardedDataParallel(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// ---- choosing the strategy
// -----------------------------------------------------------------------

/// dist.strategy resolved for a job, and why.
struct StrategyChoice {
  Parallelism strategy = Parallelism::kNone;  // kDdp or kFsdp (kNone: not resolved)
  /// The whole mesh: dp_replicate x dp_shard x tp over the world (fsdp: dp_replicate = 1 shards
  /// over every data-parallel rank; ddp: dp_shard = 1).
  MeshShape mesh;
  std::string reason;       // one line with the numbers (logged, and in scale.json)
  nlohmann::json decision;  // auto: choose_strategy's decision (kiln/plan.h to_json); else null
};

/// Where a job's ranks sit, for resolve_strategy.
struct StrategyWorld {
  int world_size = 1;
  /// Ranks on one node (LOCAL_WORLD_SIZE): the fast link. 0: every rank on one node.
  int local_world_size = 0;
  /// dist.tp = 0 under "auto" may choose a tensor-parallel degree: false where the rest of the
  /// config refuses dist.tp > 1 (compile.backend other than eager); a model without a
  /// tensor-parallel plan offers no degrees anyway.
  bool tensor_parallel_allowed = false;
  /// The pilot's production world (plan.gpus, more ranks than this world; its node the catalog
  /// row's gpus_per_node, else local_world_size): "auto" chooses the layout at that world and
  /// runs its tp and dp_shard here with fewer replicas, so the pilot measures a production rank's
  /// memory. A layout whose tp x dp_shard does not divide this world is said in the reason, and
  /// auto chooses for this world instead. 0: this world is production.
  int production_world_size = 0;
};

/// "ddp" or "fsdp" when dist.strategy says so, over world / dist.tp data-parallel ranks (dist.tp
/// = 0 means 1; throws UserError naming dist.tp when it does not divide the world).
/// "auto": kiln::choose_strategy (kiln/plan.h, the rule `kiln plan` uses), its input built as
/// the planner builds it (strategy_input: the model's state and largest unit, the activations
/// of one micro-batch, calibrated by the run's pilot.json when one exists for this job, the
/// tensor-parallel degrees the model's plan accepts when dist.tp = 0 and TP is allowed), with
/// this job's world, LOCAL_WORLD_SIZE as the node, the links of the catalog row matching the
/// device's name ("NVIDIA H200 ..."; "cpu" matches no built-in row, but a plan.catalog row may
/// match it; without links FSDP is preferred over TP, the rule's default), against
/// dist.device_memory_bytes (0: the device's total; CPU: the machine's physical memory) with
/// dist.memory_headroom: DDP when it fits, else FSDP inside a node replicated across nodes, else
/// FSDP across nodes or TP inside a node with FSDP over the slices, whichever communicates less;
/// FSDP over all ranks when nothing fits (the reason says so). Memory is the only reason it leaves
/// DDP. Throws UserError (a model shape plan cannot estimate, a malformed plan.catalog).
StrategyChoice resolve_strategy(const Config& config, const Model& model,
                                const torch::Device& device, const StrategyWorld& world);

// ---- launching local ranks under torchrun -------------------------------------------------------

/// A kiln subcommand to run as local ranks under torchrun, as a run of its own.
struct TorchrunJob {
  std::string command;   // the kiln subcommand every rank runs ("scale")
  int processes = 1;     // torchrun --nproc-per-node
  std::string run_name;  // the ranks' run.name: they write into <run dir>/<run_name>/
  // Outputs of an earlier launch, removed once <run dir>/<run_name>/ exists and before torchrun
  // starts, so that they are never read as this launch's.
  std::vector<std::filesystem::path> stale_outputs;
};

/// What a torchrun launch left behind.
struct TorchrunOutcome {
  int status = 0;                 // torchrun's exit status, or 128 + the signal that ended it
  std::filesystem::path run_dir;  // <run dir>/<run_name>/: the ranks' manifest, logs and outputs
};

/// The torchrun executable: dist.torchrun when set; else the first `torchrun` on PATH; else
/// .venv/bin/torchrun one directory above, then next to, the kiln executable. Throws UserError
/// when dist.torchrun is set but is not an executable file, or when none is found (the message
/// names dist.torchrun as the fix).
std::filesystem::path find_torchrun(const ProcessGroupOptions& options);

/// Runs `<torchrun> --standalone --nproc-per-node=<job.processes> --no-python <kiln> <job.command>
/// <launch config> --quiet` from this process (which is not itself a rank) and waits for it; the
/// children inherit stdout and stderr, and the command line is logged. The ranks load `config`,
/// resolved, with run.dir = run_directory(config) and run.name = job.run_name, written to
/// <run dir>/<run_name>/<command>-launch.toml: they are a run of their own and the caller's run
/// directory keeps its files. job.stale_outputs are removed before the launch. Returns torchrun's
/// status whatever it is (a failed rank is not an exception here); reading what the ranks wrote is
/// the caller's job. Throws UserError when <run dir>/<run_name>/ cannot be created (naming
/// run.dir), the launch config cannot be written, a stale output cannot be removed, torchrun is not
/// found (find_torchrun) or the kiln executable cannot be located or started.
TorchrunOutcome launch_with_torchrun(const Config& config, const TorchrunJob& job);

}  // namespace kiln
