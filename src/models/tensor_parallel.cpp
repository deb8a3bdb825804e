// Tensor parallelism's autograd functions and parameter slicing (models/tensor_parallel.h).
#include "models/tensor_parallel.h"

#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdint>

#include "kiln/error.h"

namespace kiln {

void Model::shard_tensor_parallel(std::shared_ptr<Communicator> /*tp*/) {
  throw UserError(fmt::format(
      "model '{}' declares no tensor-parallel plan; set dist.tp = 1 (a registered model gives "
      "one with ModelSpec::tensor_parallel_problem and Model::shard_tensor_parallel)",
      architecture()));
}

std::vector<TensorParallelPlacement::Run> TensorParallelPlacement::runs(int64_t begin,
                                                                        int64_t count) const {
  const int64_t block = global_shape.at(static_cast<size_t>(dim)) / chunks;
  std::vector<Run> out;
  for (int64_t at = begin, end = begin + count; at < end;) {
    const int64_t c = at / length, within = at % length;
    const int64_t take = std::min(end - at, length - within);
    out.push_back({at, c * block + offset + within, take});
    at += take;
  }
  return out;
}

namespace tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Communicator& communicator_of(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
}

void remember(AutogradContext* ctx, Communicator& comm) {
  ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(&comm));
}

struct CopyToRanks final : public torch::autograd::Function<CopyToRanks> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm) {
    remember(ctx, *comm);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::Tensor grad = grads[0].contiguous().clone();
    communicator_of(ctx).all_reduce_sum(grad);
    return {grad, torch::Tensor()};
  }
};

struct ReduceFromRanks final : public torch::autograd::Function<ReduceFromRanks> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x,
                               Communicator* comm) {
    torch::Tensor sum = x.contiguous().clone();
    comm->all_reduce_sum(sum);
    return sum;
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

}  // namespace

torch::Tensor copy_to_ranks(const torch::Tensor& x, Communicator& comm) {
  return CopyToRanks::apply(x, &comm);
}

torch::Tensor reduce_from_ranks(const torch::Tensor& x, Communicator& comm) {
  return ReduceFromRanks::apply(x, &comm);
}

TensorParallelPlacement shard(torch::Tensor& param, int dim, const Communicator& comm,
                              int64_t chunks) {
  const int64_t whole = param.size(dim), ranks = comm.world_size();
  // A fused slice's checkpoint boxes are cut on dim 0 (whole_piece in dist/sharded_layout.cpp,
  // where FSDP's rows lie too): a fused row-parallel parameter would need boxes on dim 1.
  if (chunks > 1 && dim != 0)
    throw std::logic_error("tensor parallelism: a fused (chunks > 1) slice must split dim 0");
  if (chunks < 1 || whole % (chunks * ranks) != 0) {
    throw std::invalid_argument(fmt::format(
        "tensor parallelism: dimension {} of size {} does not split into {} blocks over {} ranks",
        dim, whole, chunks, ranks));
  }
  const int64_t block = whole / chunks, part = block / ranks;
  TensorParallelPlacement placement;
  placement.dim = dim;
  placement.global_shape = param.sizes().vec();
  placement.offset = part * comm.rank();
  placement.length = part;
  placement.chunks = chunks;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> slices;
  for (int64_t c = 0; c < chunks; ++c)
    slices.push_back(param.narrow(dim, c * block + placement.offset, part));
  param.set_data(at::cat(slices, dim).contiguous().clone());
  return placement;
}

}  // namespace tensor_parallel
}  // namespace kiln
