// The memory model's walk of one optimizer step (src/plan/memory_model.cpp, docs/plan.md
// "Memory"): live bytes by part with the peak kept, the held state, FSDP's gathers, frees and
// reduce-scatter buffers, DDP's buckets, and each parameter's gradient as autograd accumulates
// it. A model's walk (gpt in memory_model.cpp, llama in memory_llama.cpp) derives from StepWalk
// and walks its own forward, loss and backward through these. Private to src/plan.
//
// Units: b micro-batch, t tokens, h = n_embd, X = b t h elements, e bytes of the compute dtype
// (4 fp32, 2 under bf16/fp16-mixed), r bytes of the residual stream (fp32 under autocast: the
// embeddings and the residual adds stay fp32; bf16 under FSDP mixed precision, whose gathered
// parameters are bf16 themselves).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kiln/plan.h"

namespace kiln::plan_walk {

enum Part {
  kParameters,
  kOptimizer,
  kGradients,
  kActivations,
  kLogits,
  kBackward,
  kCopies,
  kCommunication,
  kParts
};

// Live bytes by part, and the largest sum seen with its parts and moment.
class Walk {
 public:
  void add(Part part, double bytes, const std::string& moment) {
    live_[part] += bytes;
    double sum = 0;
    for (double v : live_) sum += v;
    if (sum > peak_) {
      peak_ = sum;
      at_peak_ = live_;
      peak_at_ = moment;
    }
  }
  void free(Part part, double bytes) { live_[part] -= bytes; }
  double live(Part part) const { return live_[part]; }

  void fill(MemoryEstimate& m) const {
    m.parameters = at_peak_[kParameters];
    m.optimizer = at_peak_[kOptimizer];
    m.gradients = at_peak_[kGradients];
    m.activations = at_peak_[kActivations];
    m.logits = at_peak_[kLogits];
    m.backward_extra = at_peak_[kBackward];
    m.autocast_copies = at_peak_[kCopies];
    m.communication = at_peak_[kCommunication];
    m.peak_bytes = std::max(peak_, 0.0);
    m.peak_at = peak_at_;
  }

 private:
  std::array<double, kParts> live_{}, at_peak_{};
  double peak_ = -1;
  std::string peak_at_;
};

// One parameter: rows (its dim 0) x row_numel elements; linear weights go through autocast.
struct Param {
  double rows = 0, row_numel = 1;
  bool linear_weight = false;  // cast by autocast (a linear's weight or bias)
  double numel() const { return rows * row_numel; }
};

// One step of a model whose parameters come in FSDP groups: the units (Model::units()) in
// forward order, then the root group last.
class StepWalk {
 public:
  StepWalk(const ModelShape& s, const JobShape& job, std::vector<std::vector<Param>> groups)
      : s_(s), job_(job) {
    b_ = static_cast<double>(job.micro_batch);
    t_ = static_cast<double>(job.seq_len);
    h_ = static_cast<double>(s.n_embd);
    heads_ = static_cast<double>(s.n_head);
    v_ = static_cast<double>(s.vocab_size);
    tok_ = b_ * t_;
    x_ = tok_ * h_;
    const std::string compute = compute_precision(job.precision);  // "bf16-mixed" -> "bf16"
    mixed_ = compute == "bf16" || compute == "fp16";
    e_ = mixed_ ? 2.0 : 4.0;
    // The mesh: tensor parallelism over tp_ ranks, data parallelism over the rest, FSDP's
    // shards over the shard group (world / (tp x replicas)).
    tp_ = static_cast<double>(std::max<int64_t>(1, job.tp));
    const int64_t dp = job.world_size / std::max<int64_t>(1, job.tp);
    fsdp_ = job.strategy == "fsdp" && dp > 1;
    ddp_ = job.strategy == "ddp" && dp > 1;
    world_ =
        fsdp_
            ? static_cast<double>(std::max<int64_t>(1, dp / std::max<int64_t>(1, job.dp_replicate)))
            : 1.0;
    r_ = fsdp_ && mixed_ ? 2.0 : 4.0;  // FSDP mixed: bf16 parameters, a bf16 residual stream
    cast_ = mixed_ && !fsdp_;          // autocast copies fp32 weights and activations
    gathered_dtype_ = mixed_ ? 2.0 : 4.0;
    groups_ = std::move(groups);
    const size_t n = groups_.size();
    gathered_.assign(n, false);
    in_flight_.assign(n, false);
    grad_bytes_.assign(n, 0.0);
    has_grad_.assign(n, false);
    reduce_bytes_.assign(n, 0.0);
    for (const auto& g : groups_) {
      double full = 0, shard = 0;
      for (const Param& p : g) {
        full += p.numel();
        shard += std::ceil(p.rows / world_) * p.row_numel;
      }
      full_.push_back(full);
      shard_.push_back(shard);
      parameters_ += full;
      shard_total_ += shard;
    }
    optimizer_per_parameter_ = state_bytes_per_parameter(job) - 8.0;
  }

  virtual ~StepWalk() = default;

  MemoryEstimate run() {
    // Held across steps.
    walk_.add(kParameters, 4.0 * shard_total_, "the held state");
    walk_.add(kOptimizer, optimizer_per_parameter_ * shard_total_, "the held state");
    if (fsdp_) walk_.add(kGradients, 4.0 * shard_total_, "the held state");    // gradient shards
    if (ddp_) walk_.add(kCommunication, 4.0 * parameters_, "the held state");  // buckets
    const int micro_steps = static_cast<int>(std::max<int64_t>(1, job_.grad_accum_steps));
    for (int micro = 0; micro < micro_steps; ++micro) {
      micro_ = micro;
      communicating_ = micro == micro_steps - 1 || job_.fsdp_accumulate_sharded;
      if (fsdp_) micro_step_begin();
      forward_and_loss();
      backward();
    }
    if (fsdp_) {
      finish_reduces();
      for (size_t g = 0; g < groups_.size(); ++g) free_group(g);
    }
    MemoryEstimate m;
    walk_.fill(m);
    m.gradients_held = micro_steps > 1;
    m.gradients_after_step = 4.0 * (fsdp_ ? shard_total_ : parameters_);
    return m;
  }

 protected:
  // The model's forward with its loss, and its backward, for micro-batch micro_.
  virtual void forward_and_loss() = 0;
  virtual void backward() = 0;

  std::string block_name(size_t unit) const { return fmt::format("block {}", unit); }
  size_t root() const { return groups_.size() - 1; }
  std::string micro_text() const {
    return job_.grad_accum_steps > 1 ? fmt::format(" (micro-batch {})", micro_ + 1) : "";
  }

  // ---- FSDP (src/dist/fsdp.cpp) ----
  void start_gather(size_t g) {
    if (!fsdp_ || gathered_[g] || in_flight_[g]) return;
    in_flight_[g] = true;
    walk_.add(kCommunication, gather_buffer_bytes(g), "an all-gather");
  }
  double gather_buffer_bytes(size_t g) const {
    // The [W x S] buffer, and the shard cast to the gather dtype when that differs.
    return world_ * shard_[g] * gathered_dtype_ + (mixed_ ? shard_[g] * gathered_dtype_ : 0.0);
  }
  void ensure_gathered(size_t g, const std::string& moment) {
    if (!fsdp_ || gathered_[g]) return;
    start_gather(g);
    walk_.add(kCommunication, full_[g] * gathered_dtype_, moment);
    walk_.free(kCommunication, gather_buffer_bytes(g));
    in_flight_[g] = false;
    gathered_[g] = true;
  }
  void free_group(size_t g) {
    if (!fsdp_) return;
    if (in_flight_[g]) walk_.free(kCommunication, gather_buffer_bytes(g));
    in_flight_[g] = false;
    if (gathered_[g]) walk_.free(kCommunication, full_[g] * gathered_dtype_);
    gathered_[g] = false;
  }
  void launch_reduce(size_t g, const std::string& moment) {
    walk_.add(kCommunication, 4.0 * world_ * shard_[g], moment);  // the fp32 [W x S] input
    walk_.free(kGradients, grad_bytes_[g]);                       // the full gradients
    grad_bytes_[g] = 0;
    has_grad_[g] = false;
    walk_.add(kCommunication, 4.0 * shard_[g], moment);  // the [S] output
    reduce_bytes_[g] = 4.0 * (world_ + 1.0) * shard_[g];
    free_group(g);
  }
  void finish_reduces() {
    for (size_t g = 0; g < groups_.size(); ++g) {
      walk_.free(kCommunication, reduce_bytes_[g]);
      reduce_bytes_[g] = 0;
    }
  }
  // A unit's FSDP moments around its forward and its (recomputation and) backward: gather it
  // (prefetching the next unit in that direction) and, after the forward, free it when the
  // forward reshards or checkpointing will regather it. No-ops without FSDP.
  std::string unit_forward_moment(size_t g) const {
    return fmt::format("{}'s forward{}", block_name(g), micro_text());
  }
  std::string unit_backward_moment(size_t k) const {
    return fmt::format("{}'s {}{}", block_name(k),
                       job_.activation_checkpointing ? "recomputation and backward" : "backward",
                       micro_text());
  }
  void gather_for_forward(size_t g, size_t units, const std::string& moment) {
    if (!fsdp_) return;
    ensure_gathered(g, moment);
    if (job_.fsdp_prefetch && g + 1 < units) start_gather(g + 1);
  }
  void release_after_forward(size_t g) {
    if (fsdp_ && (job_.fsdp_reshard_after_forward || job_.activation_checkpointing)) free_group(g);
  }
  void gather_for_backward(size_t k, const std::string& moment) {
    if (!fsdp_) return;
    ensure_gathered(k, moment);
    const bool prefetch =
        job_.fsdp_prefetch && (job_.fsdp_reshard_after_forward || job_.activation_checkpointing);
    if (prefetch && k > 0) start_gather(k - 1);
  }
  void micro_step_begin() {
    if (micro_ > 0 && job_.fsdp_accumulate_sharded) finish_reduces();
    for (size_t g = 0; g + 1 < groups_.size(); ++g) free_group(g);
    ensure_gathered(root(), "gathering the embeddings" + micro_text());
    if (job_.fsdp_prefetch) start_gather(0);
  }
  // All of group g's gradients arrived.
  void group_ready(size_t g, const std::string& moment) {
    if (!fsdp_) return;
    if (communicating_) {
      launch_reduce(g, moment);
    } else {
      free_group(g);  // the full gradients stay, accumulating
    }
  }

  // ---- a parameter's gradient, as autograd accumulates it ----
  void parameter_gradient(size_t g, const Param& p, const std::string& moment) {
    const double n = p.numel();
    if (fsdp_) {
      const double computed = gathered_dtype_ * n;  // the gathered parameter's dtype
      if (communicating_) {
        if (has_grad_[g] && !mixed_) {  // fp32, unsharded accumulation: added in place
          walk_.add(kBackward, computed, moment);
          walk_.free(kBackward, computed);
        } else {
          walk_.add(kGradients, computed, moment);
          grad_bytes_[g] += computed;
        }
        return;
      }
      if (mixed_) {  // accumulated in fp32 beside, the bf16 gradient dropped
        walk_.add(kGradients, computed, moment);
        if (micro_ == 0) {
          walk_.add(kGradients, 4.0 * n, moment);
          grad_bytes_[g] += 4.0 * n;
        }
        walk_.free(kGradients, computed);
      } else if (micro_ == 0) {
        walk_.add(kGradients, 4.0 * n, moment);
        grad_bytes_[g] += 4.0 * n;
      } else {
        walk_.add(kBackward, 4.0 * n, moment);
        walk_.free(kBackward, 4.0 * n);
      }
      has_grad_[g] = true;
      return;
    }
    // One process or DDP: fp32 gradients; a cast weight's gradient is computed in the compute
    // dtype and cast back (ToCopyBackward).
    const bool through_cast = cast_ && p.linear_weight;
    if (through_cast) walk_.add(kBackward, e_ * n, moment);
    if (micro_ == 0) {
      walk_.add(kGradients, 4.0 * n, moment);
    } else {  // accumulated into .grad in place
      walk_.add(kBackward, 4.0 * n, moment);
      walk_.free(kBackward, 4.0 * n);
    }
    if (through_cast) walk_.free(kBackward, e_ * n);
  }
  void gradients(size_t g, std::initializer_list<size_t> indices, const std::string& moment) {
    for (size_t k : indices) parameter_gradient(g, groups_[g][k], moment);
  }

  // ---- tensor parallelism (src/models/tensor_parallel.cpp) ----
  // A row-parallel layer's output (whole, e X): under tensor parallelism this rank's partial
  // sum, and its copy for the all-reduce while the sum is made.
  void row_parallel_output(const std::string& moment) {
    walk_.add(kActivations, e_ * x_, moment);
    if (tp_ > 1) {
      walk_.add(kActivations, e_ * x_, moment);
      walk_.free(kActivations, e_ * x_);
    }
  }
  // The gradient of the column-parallel layers' whole input (`bytes`, live): under tensor
  // parallelism this rank's partial sum, copied for its all-reduce (Megatron's f backward).
  void all_reduced_input_gradient(double bytes, const std::string& moment) {
    if (tp_ <= 1) return;
    walk_.add(kBackward, bytes, moment);
    walk_.free(kBackward, bytes);
  }

  // Autocast's copy of group g's parameter k (cached for the autocast scope).
  double weight_copy(size_t g, size_t k) const { return cast_ ? e_ * groups_[g][k].numel() : 0; }

  const ModelShape& s_;
  const JobShape& job_;
  double b_ = 0, t_ = 0, h_ = 0, heads_ = 0, v_ = 0, tok_ = 0, x_ = 0;
  double e_ = 4, r_ = 4, gathered_dtype_ = 4, world_ = 1, tp_ = 1;
  bool mixed_ = false, fsdp_ = false, ddp_ = false, cast_ = false;
  std::vector<std::vector<Param>> groups_;
  std::vector<double> full_, shard_, grad_bytes_, reduce_bytes_;
  std::vector<bool> gathered_, in_flight_, has_grad_;
  double parameters_ = 0, shard_total_ = 0, optimizer_per_parameter_ = 0;
  int micro_ = 0;
  bool communicating_ = true;
  Walk walk_;
};

/// The llama walk (memory_llama.cpp).
MemoryEstimate llama_step_estimate(const ModelShape& shape, const JobShape& job);

}  // namespace kiln::plan_walk
