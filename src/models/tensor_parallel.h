// Tensor parallelism inside a model (Megatron-LM's f and g): the two autograd functions at a
// tensor-parallel block's edges and the slicing of a parameter. Not public API: models call
// these from Model::shard_tensor_parallel and their forward.
#pragma once

#include <torch/types.h>

#include "kiln/comm.h"
#include "kiln/models.h"

namespace kiln::tensor_parallel {

/// Megatron's f: the identity forward, and the input's gradient summed over `comm` backward
/// (every rank's column-parallel slice contributed a part of it).
torch::Tensor copy_to_ranks(const torch::Tensor& x, Communicator& comm);
/// Megatron's g: `x` (this rank's partial sum of a row-parallel layer) summed over `comm`
/// forward; the identity backward (each rank's part has the whole output's gradient).
torch::Tensor reduce_from_ranks(const torch::Tensor& x, Communicator& comm);

/// Replaces `param`'s data by this rank's slice along `dim` (contiguous, a copy; the size along
/// `dim` must divide by chunks x comm.world_size()) and returns its placement. `chunks` > 1: the
/// parameter is that many fused blocks along `dim` (gpt's c_attn: q, k, v), each split alike and
/// this rank's parts concatenated.
TensorParallelPlacement shard(torch::Tensor& param, int dim, const Communicator& comm,
                              int64_t chunks = 1);

}  // namespace kiln::tensor_parallel
