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
#include <string>
#include <vector>

#include "kiln/comm.h"
#include "kiln/error.h"
#include "kiln/train.h"

namespace kiln {

class Config;

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
};

/// Looks up an environment variable; nullptr when unset. Tests pass a map instead of ::getenv.
using EnvLookup = std::function<const char*(const char*)>;

/// Reads the launcher's variables. torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE. Slurm:
/// SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, with the master address from
/// MASTER_ADDR or dist.master_addr and the port from MASTER_PORT or dist.master_port. dist.launcher
/// picks one ("auto": torchrun when WORLD_SIZE is set, else Slurm inside an srun step with more
/// than one task, else one process). Pure apart from `env`. Throws UserError naming the variable
/// or key and the fix: WORLD_SIZE without a master address, a rank outside [0, WORLD_SIZE), ...
DistEnvironment read_dist_environment(const Config& config, const EnvLookup& env);

/// Under a launcher that sets LOCAL_RANK (torchrun), asks the kernel to SIGKILL this process when
/// its parent (the launcher's agent) dies (prctl PR_SET_PDEATHSIG), and exits at once (status
/// 137, like that SIGKILL) when the parent is already gone. torchrun starts its workers in
/// sessions of their own, so without this a worker whose agent was killed trains on as an
/// orphan. The kill abandons an in-flight async save; its .tmp directory is removed by the next
/// run. Call first thing in main(). Does nothing without LOCAL_RANK or off Linux.
void die_with_launcher();

/// This process's communicator. The first call reads the environment (read_dist_environment with
/// ::getenv); for a world larger than one it joins the rendezvous (c10d TCPStore at
/// MASTER_ADDR:MASTER_PORT, as a client when torchrun's agent hosts it, else hosted by rank 0),
/// creates the process group (dist.backend: Gloo on CPU, NCCL on CUDA), sets the log prefix to
/// "rank R/W", and all-gathers every rank's Config::hash(): ranks started with different configs
/// all throw UserError naming the differing hashes. Later calls return the same communicator (a
/// process has one process group; it lives until the process exits). Without a launcher it is
/// single_process_communicator(). Call from the main thread. Throws UserError (bad environment,
/// config mismatch) or CommunicationError (the other ranks did not arrive within
/// dist.timeout_seconds).
std::shared_ptr<Communicator> process_communicator(const Config& config);

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
  /// the gradient hooks and adds itself to `trainer`. With a world of one it only returns a hook
  /// that does nothing. Throws UserError for a model with no trainable parameters.
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
std::filesystem::path find_torchrun(const Config& config);

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
