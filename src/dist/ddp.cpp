// Data parallelism: bucketed gradient all-reduce started from autograd hooks during backward.
//
// Parameters are taken in reverse registration order (roughly the order backward produces their
// gradients) and packed into buckets of dist.bucket_mb (the first, dist.first_bucket_mb). When
// backward has accumulated a parameter's gradient, a post-accumulate-grad hook copies it into its
// bucket's flat buffer; when a bucket is complete, and every bucket before it has started, its
// sum all-reduce starts (asynchronously, on the backend's threads) while backward continues.
// on_gradients_ready waits for the buckets, divides by the world size and makes the parameters'
// gradients views of the averaged buffers.
#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>

#include "dist/replicas.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"

namespace kiln {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<int64_t>& bytes,
                                                const DataParallelOptions& options) {
  std::vector<std::vector<size_t>> buckets;
  int64_t filled = 0;
  for (size_t k = 0; k < bytes.size(); ++k) {
    if (buckets.empty()) buckets.emplace_back();
    buckets.back().push_back(k);
    filled += bytes[k];
    const int64_t cap = buckets.size() == 1 ? options.first_bucket_bytes : options.bucket_bytes;
    if (filled >= cap && k + 1 < bytes.size()) {
      buckets.emplace_back();
      filled = 0;
    }
  }
  return buckets;
}

struct DataParallel::State {
  struct Slot {
    size_t bucket = 0;
    int64_t offset = 0;  // elements into the bucket's buffer
    int64_t numel = 0;
  };
  struct Bucket {
    torch::Tensor buffer;  // flat, contiguous, the gradients' dtype and device
    size_t members = 0;
    size_t ready = 0;
    std::unique_ptr<PendingCollective> pending;
  };

  std::shared_ptr<Communicator> comm;
  int world_size = 1;
  std::vector<torch::Tensor> parameters;  // in bucket order (reverse registration order)
  std::vector<Slot> slots;                // per parameter
  std::vector<Bucket> buckets;
  std::vector<char> gradient_ready;  // per parameter, this step
  size_t next_launch = 0;
  bool synchronizing = false;  // the current micro-step is the step's last
  int64_t all_reduces = 0;
  std::string weights_hash;

  void reset_step() {
    std::fill(gradient_ready.begin(), gradient_ready.end(), 0);
    for (auto& bucket : buckets) {
      bucket.ready = 0;
      bucket.pending.reset();
    }
    next_launch = 0;
  }

  // Starts every complete bucket whose predecessors have all started: the same order on every
  // rank, whatever order the hooks fired in.
  void launch_ready_buckets() {
    while (next_launch < buckets.size() &&
           buckets[next_launch].ready == buckets[next_launch].members) {
      Bucket& bucket = buckets[next_launch++];
      bucket.pending = comm->all_reduce_sum_async(bucket.buffer);
      ++all_reduces;
    }
  }

  void gradient_accumulated(size_t index, const torch::Tensor& parameter) {
    if (!synchronizing || gradient_ready[index]) return;
    const torch::Tensor& grad = parameter.grad();
    if (!grad.defined()) return;
    const Slot& slot = slots[index];
    Bucket& bucket = buckets[slot.bucket];
    bucket.buffer.narrow(0, slot.offset, slot.numel).view(grad.sizes()).copy_(grad);
    gradient_ready[index] = 1;
    if (++bucket.ready == bucket.members) launch_ready_buckets();
  }
};

namespace {

class GradientReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradientReadyHook(DataParallel::State* state, size_t index) : state_(state), index_(index) {}
  void operator()(const torch::autograd::Variable& parameter) override {
    state_->gradient_accumulated(index_, parameter);
  }

 private:
  DataParallel::State* state_;
  size_t index_;
};

}  // namespace

DataParallel::DataParallel(std::unique_ptr<State> state) : state_(std::move(state)) {}

DataParallel::~DataParallel() {
  for (auto& p : state_->parameters) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

std::shared_ptr<DataParallel> DataParallel::attach(Trainer& trainer,
                                                   std::shared_ptr<Communicator> comm,
                                                   const DataParallelOptions& options) {
  trainer.enter_composition_stage(CompositionStage::kParallelLayout, "DDP");
  auto state = std::make_unique<State>();
  state->comm = std::move(comm);
  state->world_size = state->comm->world_size();
  Model& model = trainer.model();
  state->weights_hash = dist::replicate_rank0(*state->comm, model);

  // Trainable parameters, last registered first, split into runs of one dtype and device.
  std::vector<torch::Tensor> params;
  for (auto& p : model.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  if (params.empty())
    throw UserError("data parallel training needs trainable parameters; the model has none");
  std::reverse(params.begin(), params.end());
  size_t run_begin = 0;
  while (run_begin < params.size()) {
    size_t run_end = run_begin;
    while (run_end < params.size() &&
           params[run_end].scalar_type() == params[run_begin].scalar_type() &&
           params[run_end].device() == params[run_begin].device()) {
      ++run_end;
    }
    std::vector<int64_t> bytes;
    for (size_t k = run_begin; k < run_end; ++k)
      bytes.push_back(static_cast<int64_t>(params[k].nbytes()));
    DataParallelOptions run_options = options;
    if (!state->buckets.empty()) run_options.first_bucket_bytes = options.bucket_bytes;
    for (const auto& members : assign_buckets(bytes, run_options)) {
      State::Bucket bucket;
      int64_t elements = 0;
      for (size_t m : members) {
        const torch::Tensor& p = params[run_begin + m];
        state->slots.push_back({state->buckets.size(), elements, p.numel()});
        state->parameters.push_back(p);
        elements += p.numel();
      }
      bucket.members = members.size();
      bucket.buffer = torch::zeros({elements}, params[run_begin].options().requires_grad(false));
      state->buckets.push_back(std::move(bucket));
    }
    run_begin = run_end;
  }
  state->gradient_ready.assign(state->parameters.size(), 0);

  State* raw = state.get();
  auto hook = std::shared_ptr<DataParallel>(new DataParallel(std::move(state)));
  if (raw->comm->parallel()) {
    for (size_t k = 0; k < raw->parameters.size(); ++k) {
      torch::autograd::impl::set_post_acc_grad_hooks(raw->parameters[k],
                                                     std::make_unique<GradientReadyHook>(raw, k));
    }
    trainer.add_hook(hook);
    std::string sizes;
    for (int64_t b : hook->bucket_bytes())
      sizes += (sizes.empty() ? "" : ", ") + fmt::format("{:.2f}", b / 1048576.0);
    log::info(
        fmt::format("data parallel over {} ranks ({}): {} parameters in {} buckets of [{}] MiB; "
                    "weights {} on every rank",
                    raw->world_size, raw->comm->backend_name(), raw->parameters.size(),
                    raw->buckets.size(), sizes, raw->weights_hash));
  }
  return hook;
}

std::vector<int64_t> DataParallel::bucket_bytes() const {
  std::vector<int64_t> out;
  for (const auto& b : state_->buckets) out.push_back(static_cast<int64_t>(b.buffer.nbytes()));
  return out;
}

int64_t DataParallel::bucket_all_reduces() const {
  return state_->all_reduces;
}

void DataParallel::on_micro_step_begin(Trainer&, int, bool last) {
  state_->synchronizing = last;
  if (last) state_->reset_step();
}

void DataParallel::on_gradients_ready(Trainer& trainer) {
  State& s = *state_;
  if (!s.synchronizing) return;
  s.synchronizing = false;
  PhaseScope phase(trainer, Phase::kComm);
  // Parameters whose hook did not fire on this micro-step: one that received gradient only on
  // earlier micro-steps (accumulation) contributes that gradient; one with no gradient on this
  // rank at all contributes zeros.
  for (size_t k = 0; k < s.parameters.size(); ++k) {
    if (s.gradient_ready[k]) continue;
    const auto& slot = s.slots[k];
    torch::Tensor part = s.buckets[slot.bucket].buffer.narrow(0, slot.offset, slot.numel);
    const torch::Tensor& grad = s.parameters[k].grad();
    if (grad.defined()) {
      part.view(grad.sizes()).copy_(grad);
    } else {
      part.zero_();
    }
    s.gradient_ready[k] = 1;
    ++s.buckets[slot.bucket].ready;
  }
  s.launch_ready_buckets();
  for (auto& bucket : s.buckets) {
    bucket.pending->wait();
    bucket.pending.reset();
    bucket.buffer.div_(static_cast<double>(s.world_size));
  }
  for (size_t k = 0; k < s.parameters.size(); ++k) {
    const auto& slot = s.slots[k];
    s.parameters[k].mutable_grad() = s.buckets[slot.bucket]
                                         .buffer.narrow(0, slot.offset, slot.numel)
                                         .view(s.parameters[k].sizes());
  }
}

}  // namespace kiln
