// Process-group abstraction shared by the rungs that talk across processes (scale, checkpoint).
// A Communicator is one process's handle on a group of world_size() processes. Every collective
// must be called by every rank, in the same order; calls come from the training thread only.
// A world of one (single_process_communicator) makes every collective the identity, so code
// written against this interface runs unchanged in one process.
#pragma once

#include <memory>
#include <string>
#include <torch/types.h>
#include <vector>

namespace kiln {

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
};

/// The world of one process: rank 0 of 1; collectives return their input.
std::shared_ptr<Communicator> single_process_communicator();

}  // namespace kiln
