// FullyShardedDataParallel's state, shared by fsdp.cpp (the hooks, the gathers and reduce-
// scatters, the accessors) and fsdp_attach.cpp (grouping the parameters into flat shards). Not
// public: kiln/dist.h has the contract.
//
// Fully sharded data parallelism: parameters, gradients and optimizer state sharded on dim 0
// over the ranks, gathered per unit around its forward and backward (kiln/dist.h has the
// contract; docs/scale.md the knobs).
//
// Freeing: a gathered parameter's storage (its StorageImpl, which the module's tensor and every
// autograd SavedVariable of it share) is given a fresh allocation before the all-gather's data is
// copied in, and set to a null 0-byte allocation when freed, as FSDP1's _free_storage /
// _alloc_storage resize the storage to 0 and back. The copy goes through variable_data() (a
// tensor sharing the storage but not the version counter), so autograd does not see the regather
// as an in-place modification of a saved tensor.
//
// Mixed precision (FsdpOptions::param_dtype, FSDP2's MixedPrecisionPolicy(param_dtype,
// reduce_dtype = the shards' dtype)): the module's parameters are set (set_data) to param_dtype
// tensors at attach, so they are gathered, computed with and differentiated in that dtype; the
// all-gather sends a param_dtype copy of the shard (half the bytes for bf16), and the full
// gradients are copied into the shards' dtype for the reduce-scatter.
#pragma once

#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>

#include "dist/replicas.h"
#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"

namespace kiln {

namespace fsdp_storage {

inline void free_storage(const torch::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, tensor.device()));
  storage->set_nbytes(0);
}

inline void allocate_storage(const torch::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  at::Allocator* allocator = storage->allocator();
  if (allocator == nullptr) allocator = c10::GetAllocator(tensor.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(bytes));
  storage->set_nbytes(bytes);
}

}  // namespace fsdp_storage

struct FullyShardedDataParallel::State {
  struct Param {
    ShardLayout layout;
    torch::Tensor param;       // the module's parameter; storage released while not gathered
    torch::Tensor shard;       // this rank's rows: a view of the group's flat shard
    torch::Tensor grad_shard;  // its gradient: a view of the group's flat gradient
    // Mixed precision, unsharded accumulation: the full gradient of the micro-steps so far, in
    // the shards' dtype (as FSDP2 upcasts to reduce_dtype), the low-precision .grad cleared.
    torch::Tensor accumulated;
    int64_t offset = 0;  // elements into the group's flat shard
    size_t group = 0;
    bool ready = false;  // gradient accumulated in this micro-step
  };
  struct Group {
    std::string name;
    std::vector<size_t> params;
    torch::Tensor flat_shard, flat_grad;  // [S]
    int64_t full_bytes = 0;
    bool gathered = false;
    torch::Tensor gather_input;   // [S] the shard cast to the gather dtype, while in flight
    torch::Tensor gather_buffer;  // [W * S] while its all-gather is in flight
    std::unique_ptr<PendingCollective> gather;
    size_t ready = 0;       // parameters whose gradient accumulated this micro-step
    bool launched = false;  // this micro-step's reduce-scatter started
    torch::Tensor reduce_input, reduce_output;
    std::unique_ptr<PendingCollective> reduce;
    std::unique_ptr<PendingCollective> replica_reduce;  // HSDP: reduce_output over the replicas
    bool has_gradient = false;                          // flat_grad holds this step's gradient
  };

  std::shared_ptr<Communicator> comm;       // the shard group (every rank without replicas)
  std::shared_ptr<Communicator> replicate;  // HSDP: the ranks holding the same shards; or null
  int replicas = 1;
  int64_t replica_all_reduces = 0;
  Model* model = nullptr;
  FsdpOptions options;
  int rank = 0, world = 1;
  torch::ScalarType gather_dtype = torch::kFloat;  // of the all-gather and the full parameters
  std::vector<Param> params;                       // trainable parameters, registration order
  std::vector<Group> groups;         // the units in forward order, then the root (when not empty)
  int units = 0;                     // groups [0, units) are Model::units()
  int root = -1;                     // index of the root group, -1 when empty
  std::vector<size_t> reduce_order;  // units last to first, then the root
  size_t next_launch = 0;
  bool communicating = false;  // this micro-step reduce-scatters
  bool in_eval = false;
  int64_t all_gathers = 0, reduce_scatters = 0;
  int64_t gathered_bytes = 0, gathered_peak = 0;
  std::string weights_hash;

  int64_t shard_numel(const Group& g) const { return g.flat_shard.numel(); }

  void account_gathered(int64_t delta) {
    gathered_bytes += delta;
    gathered_peak = std::max(gathered_peak, gathered_bytes);
  }

  void start_gather(size_t index) {
    Group& g = groups[index];
    if (g.gathered || g.gather) return;
    const int64_t S = shard_numel(g);
    if (S == 0) return;
    if (g.flat_shard.scalar_type() != gather_dtype) {
      torch::NoGradGuard no_grad;
      g.gather_input = g.flat_shard.to(gather_dtype);
      account_gathered(static_cast<int64_t>(g.gather_input.nbytes()));
    }
    g.gather_buffer = torch::empty({world * S}, g.flat_shard.options().dtype(gather_dtype));
    account_gathered(static_cast<int64_t>(g.gather_buffer.nbytes()));
    g.gather = comm->all_gather_async(g.gather_input.defined() ? g.gather_input : g.flat_shard,
                                      g.gather_buffer);
    ++all_gathers;
  }

  // Drops the all-gather's buffers (after its data was copied out, or for a prefetch unused).
  void release_gather_buffers(Group& g) {
    for (torch::Tensor* t : {&g.gather_input, &g.gather_buffer}) {
      if (!t->defined()) continue;
      account_gathered(-static_cast<int64_t>(t->nbytes()));
      *t = torch::Tensor();
    }
  }

  // Parameter p's rows out of a group's all-gathered [W * S] buffer into `full` (flat, numel of
  // the full parameter), padding dropped.
  void copy_rows(const Param& p, int64_t S, const torch::Tensor& gathered,
                 torch::Tensor full) const {
    const ShardLayout& l = p.layout;
    for (int r = 0; r < world; ++r) {
      const int64_t n = l.valid_rows(r) * l.row_numel;
      if (n == 0) continue;
      full.narrow(0, r * l.rows_per_rank * l.row_numel, n)
          .copy_(gathered.narrow(0, r * S + p.offset, n));
    }
  }

  void ensure_gathered(size_t index) {
    Group& g = groups[index];
    if (g.gathered) return;
    start_gather(index);
    if (g.gather) {
      g.gather->wait();
      g.gather.reset();
    }
    torch::NoGradGuard no_grad;
    const int64_t S = shard_numel(g);
    for (size_t k : g.params) {
      Param& p = params[k];
      fsdp_storage::allocate_storage(p.param);
      copy_rows(p, S, g.gather_buffer, torch::Tensor(p.param.variable_data()).view(-1));
    }
    release_gather_buffers(g);
    g.gathered = true;
    account_gathered(g.full_bytes);
  }

  void free_group(size_t index) {
    Group& g = groups[index];
    if (g.gather) {  // a prefetch nobody used: finish it, so no collective is left behind
      g.gather->wait();
      g.gather.reset();
      release_gather_buffers(g);
    }
    if (!g.gathered) return;
    for (size_t k : g.params) fsdp_storage::free_storage(params[k].param);
    g.gathered = false;
    account_gathered(-g.full_bytes);
  }

  // The group's full gradients (zeros where undefined) into its reduce-scatter input, in the
  // shards' dtype (a mixed-precision gradient is cast here), this rank's chunk after a sum over
  // ranks; frees the full gradients and parameters.
  void launch_reduce(size_t index) {
    Group& g = groups[index];
    g.launched = true;
    const int64_t S = shard_numel(g);
    if (S == 0) return;
    torch::NoGradGuard no_grad;
    g.reduce_input = torch::zeros({world * S}, g.flat_shard.options());
    for (size_t k : g.params) {
      Param& p = params[k];
      torch::Tensor grad = p.param.grad();
      if (p.accumulated.defined()) {
        if (grad.defined()) p.accumulated.add_(grad);
        grad = p.accumulated;
        p.accumulated = torch::Tensor();
      }
      if (!grad.defined()) continue;
      const torch::Tensor flat = grad.reshape(-1);
      const ShardLayout& l = p.layout;
      for (int r = 0; r < world; ++r) {
        const int64_t n = l.valid_rows(r) * l.row_numel;
        if (n == 0) continue;
        g.reduce_input.narrow(0, r * S + p.offset, n)
            .copy_(flat.narrow(0, r * l.rows_per_rank * l.row_numel, n));
      }
      p.param.mutable_grad() = torch::Tensor();
    }
    g.reduce_output = torch::empty({S}, g.flat_shard.options());
    g.reduce = comm->reduce_scatter_sum_async(g.reduce_input, g.reduce_output);
    ++reduce_scatters;
    free_group(index);
  }

  void launch_ready() {
    while (next_launch < reduce_order.size()) {
      const size_t index = reduce_order[next_launch];
      if (groups[index].ready < groups[index].params.size()) return;
      ++next_launch;
      launch_reduce(index);
    }
  }

  void gradient_accumulated(size_t k) {
    Param& p = params[k];
    if (!communicating && p.param.scalar_type() != p.shard.scalar_type() &&
        p.param.grad().defined()) {  // mixed precision: accumulate in the shards' dtype
      torch::NoGradGuard no_grad;
      if (p.accumulated.defined()) {
        p.accumulated.add_(p.param.grad());
      } else {
        p.accumulated = p.param.grad().to(p.shard.scalar_type());
      }
      p.param.mutable_grad() = torch::Tensor();
    }
    if (p.ready) return;
    p.ready = true;
    Group& g = groups[p.group];
    if (++g.ready < g.params.size()) return;
    if (communicating) {
      launch_ready();
    } else {
      free_group(p.group);  // the full gradients stay, accumulating
    }
  }

  // Starts every reduce-scatter of this micro-step not yet started (in order), waits for all,
  // all-reduces each shard over the replicas (HSDP; each started as its reduce-scatter is
  // waited for, in the same order on every rank) and adds them into the sharded gradients.
  void finish_reduces() {
    while (next_launch < reduce_order.size()) launch_reduce(reduce_order[next_launch++]);
    torch::NoGradGuard no_grad;
    for (size_t index : reduce_order) {
      Group& g = groups[index];
      if (!g.reduce) continue;
      g.reduce->wait();
      g.reduce.reset();
      if (replicate) {
        g.replica_reduce = replicate->all_reduce_sum_async(g.reduce_output);
        ++replica_all_reduces;
      }
    }
    for (size_t index : reduce_order) {
      Group& g = groups[index];
      if (!g.reduce_output.defined()) continue;
      if (g.replica_reduce) {
        g.replica_reduce->wait();
        g.replica_reduce.reset();
      }
      g.reduce_output.div_(static_cast<double>(world) * replicas);
      if (g.has_gradient) {
        g.flat_grad.add_(g.reduce_output);
      } else {
        g.flat_grad.copy_(g.reduce_output);
        g.has_gradient = true;
      }
      g.reduce_input = torch::Tensor();
      g.reduce_output = torch::Tensor();
    }
  }

  void begin_micro_step() {
    for (auto& p : params) p.ready = false;
    for (auto& g : groups) {
      g.ready = 0;
      g.launched = false;
    }
    next_launch = 0;
  }

  void before_unit_backward(int unit) {
    ensure_gathered(static_cast<size_t>(unit));
    if (options.prefetch && options.reshard_after_forward && unit > 0)
      start_gather(static_cast<size_t>(unit - 1));
  }

  // Group `index`'s full parameters in the shards' dtype, from an all-gather of the shards
  // (whatever the gather dtype): copies, the module's parameters untouched.
  std::vector<torch::Tensor> gather_exact(size_t index) {
    Group& g = groups[index];
    std::vector<torch::Tensor> out;
    const int64_t S = shard_numel(g);
    torch::Tensor buffer;
    if (S > 0) {
      buffer = torch::empty({world * S}, g.flat_shard.options());
      comm->all_gather_async(g.flat_shard, buffer)->wait();
      ++all_gathers;
    }
    torch::NoGradGuard no_grad;
    for (size_t k : g.params) {
      const Param& p = params[k];
      torch::Tensor full = torch::empty(p.layout.shape, g.flat_shard.options());
      if (full.numel() > 0) copy_rows(p, S, buffer, full.view(-1));
      out.push_back(full);
    }
    return out;
  }
};

}  // namespace kiln
