// The communicator: one process's handle on a group of processes, and the collectives kiln uses.
//
// A Communicator is one process's handle on a group of world_size() processes. Every collective
// must be called by every rank, in the same order. Calls into one communicator are never
// concurrent, but not all come from the training thread: DataParallel starts its bucket
// all-reduces (all_reduce_sum_async) from autograd's post-accumulate-grad hook, which runs on the
// thread executing backward: the training thread on CPU, autograd's device thread on CUDA (while
// the training thread is blocked in backward()). Implementations must therefore not depend on the
// calling thread (no thread-local state); everything else (blocking collectives, wait(), the
// constructors) is called from the training thread. A world of one
// (single_process_communicator) makes every collective the identity, so code written against this
// interface runs unchanged in one process.
//
// This header is the interface only; kiln/dist.h builds process groups from a launcher's
// environment (c10d Gloo/NCCL) and holds DDP. The Trainer depends on this header, not on dist.h.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/error.h"

namespace kiln {

/// A collective failed: a peer process died, hung past dist.timeout_seconds, or the network
/// failed. The message is one line naming this rank, the collective and the cause. The CLI exits
/// non-zero (status 3, like every TrainingError).
class CommunicationError : public TrainingError {
 public:
  using TrainingError::TrainingError;
};

/// Traffic and time of the collectives a communicator has run since it was created. Monotonic,
/// so a measurement is the difference of two snapshots.
struct CommunicationStats {
  int64_t collectives = 0;     // collectives started (blocking and asynchronous)
  double bytes = 0;            // payload bytes this rank contributed
  double busy_seconds = 0;     // wall time with at least one collective in flight (union)
  double blocked_seconds = 0;  // time the calling thread spent blocked in collectives
};

/// A collective started by one of the *_async calls, still in flight.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  /// Blocks until the collective finished. Throws CommunicationError if it failed or timed out.
  /// Call at most once, from the training thread.
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Blocks until every rank has called it (or throws on timeout / a lost rank).
  virtual void barrier() = 0;
  /// Sums `tensor` element-wise across ranks, in place.
  virtual void all_reduce_sum(torch::Tensor& tensor) = 0;
  /// Copies rank `root`'s `tensor` into every rank's `tensor` (same shape and dtype everywhere).
  virtual void broadcast(torch::Tensor& tensor, int root) = 0;
  /// Every rank's `mine`, indexed by rank. For small messages (metadata, hashes, errors).
  virtual std::vector<std::string> all_gather_bytes(const std::string& mine) = 0;

  // ---- added for the scale rung; every one has a default, so existing implementations build ----
  /// Starts a sum all-reduce of `tensor` (contiguous, on the process group's device) in place and
  /// returns at once. `tensor` must stay alive and untouched until wait() returns. Collectives
  /// still complete in the order they were started on every rank. May be called from autograd's
  /// backward thread (see the top of this file); wait() is called from the training thread.
  /// Default: runs all_reduce_sum now and returns a finished collective.
  virtual std::unique_ptr<PendingCollective> all_reduce_sum_async(torch::Tensor& tensor);
  /// This process's rank on its node (torchrun LOCAL_RANK, Slurm SLURM_LOCALID); on CUDA, the
  /// index of its device.
  virtual int local_rank() const { return 0; }
  /// Processes on this node (LOCAL_WORLD_SIZE).
  virtual int local_world_size() const { return 1; }
  /// "gloo", "nccl", or "none" for a world of one.
  virtual std::string backend_name() const { return "none"; }
  /// Whether data parallelism (DDP, FSDP) runs over this communicator: more than one rank, or a
  /// real process group of one (torchrun with an explicit dist.backend).
  bool parallel() const { return world_size() > 1 || backend_name() != "none"; }
  /// What the collectives cost so far (zeros for a world of one). Thread-safe.
  virtual CommunicationStats stats() const { return {}; }

  // ---- added for FSDP (kiln/dist.h); every one has a default built on all_reduce_sum ----------
  /// Starts an all-gather: `output` (contiguous, world_size() x mine.numel() elements, mine's
  /// dtype and device) receives every rank's `mine` (contiguous), rank r's at [r * n, (r+1) * n).
  /// Both tensors must stay alive and untouched until wait() returns. Same threading as
  /// all_reduce_sum_async. Default: an all-reduce of a zero-filled `output` holding `mine` at this
  /// rank's offset, finished on return.
  virtual std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& mine,
                                                              torch::Tensor& output);
  /// Starts a sum reduce-scatter: `output` (contiguous, n elements) receives the element-wise sum
  /// over ranks of chunk [rank * n, (rank+1) * n) of each rank's `input` (contiguous, world_size()
  /// x n elements, output's dtype and device). Both must stay alive until wait() returns. Default:
  /// an all-reduce of a copy of `input`, then this rank's slice, finished on return.
  virtual std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& input,
                                                                      torch::Tensor& output);
  /// Blocking forms of the two above.
  void all_gather(const torch::Tensor& mine, torch::Tensor& output) {
    all_gather_async(mine, output)->wait();
  }
  void reduce_scatter_sum(const torch::Tensor& input, torch::Tensor& output) {
    reduce_scatter_sum_async(input, output)->wait();
  }

  // ---- added for the device mesh (kiln/dist.h DeviceMesh) --------------------------------------
  /// A communicator over `ranks`: this rank's group along one mesh dimension, world ranks in
  /// ascending order, rank() among them; its rank() is this rank's index in `ranks`. Every rank of
  /// this communicator calls it at the same point with its own group (the groups partition the
  /// world), so the groups are created together; `tag` names the dimension ("dp_shard", ...) and
  /// keeps the groups of different dimensions apart. The group lives until the process exits.
  /// A group of one is single_process_communicator(). Default: only groups of one (a
  /// communicator without subgroups throws std::logic_error for more).
  virtual std::shared_ptr<Communicator> subgroup(const std::string& tag,
                                                 const std::vector<int>& ranks);
};

/// The world of one process: rank 0 of 1; collectives return their input.
std::shared_ptr<Communicator> single_process_communicator();

}  // namespace kiln
