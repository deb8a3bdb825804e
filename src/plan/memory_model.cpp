// The memory model (docs/plan.md, "Memory"): one optimizer step on one device, walked allocation
// by allocation in the order kiln's step makes them (src/train/trainer.cpp device_step, the gpt
// of src/models/models.cpp, src/train/checkpointing.cpp, src/dist/fsdp.cpp and ddp.cpp), with the
// live bytes summed by part and the peak kept. A walk rather than a closed formula because the
// peak moves: the loss's backward without checkpointing, the first blocks' recomputation with
// it (the gradients have grown by then), a later micro-batch under accumulation.
//
// Units: b micro-batch, t tokens, h = n_embd, X = b t h elements, e bytes of the compute dtype
// (4 fp32, 2 under bf16/fp16-mixed), r bytes of the residual stream (fp32 under autocast: the
// embeddings and the residual adds stay fp32; bf16 under FSDP mixed precision, whose gathered
// parameters are bf16 themselves).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kiln/plan.h"
#include "plan/step_walk.h"

namespace kiln {
namespace {

using plan_walk::kActivations;
using plan_walk::kBackward;
using plan_walk::kCommunication;
using plan_walk::kCopies;
using plan_walk::kGradients;
using plan_walk::kLogits;
using plan_walk::Param;

// gpt's parameters per FSDP group: each block (Model::units()), then the root (wte, wpe, ln_f).
// Under tensor parallelism over `tp` ranks, this rank's slices (Gpt::shard_tensor_parallel):
// c_attn's and c_fc's rows, the c_projs' columns; the norms and the c_projs' biases whole.
std::vector<std::vector<Param>> gpt_groups(const ModelShape& s, double tp) {
  const double h = static_cast<double>(s.n_embd);
  const std::vector<Param> block = {{h, 1, false},         {h, 1, false},          // ln_1
                                    {3 * h / tp, h, true}, {3 * h / tp, 1, true},  // attn.c_attn
                                    {h, h / tp, true},     {h, 1, true},           // attn.c_proj
                                    {h, 1, false},         {h, 1, false},          // ln_2
                                    {4 * h / tp, h, true}, {4 * h / tp, 1, true},  // mlp.c_fc
                                    {h, 4 * h / tp, true}, {h, 1, true}};          // mlp.c_proj
  std::vector<std::vector<Param>> groups(static_cast<size_t>(s.n_layer), block);
  groups.push_back({{static_cast<double>(s.vocab_size), h, false},
                    {static_cast<double>(s.block_size), h, false},
                    {h, 1, false},
                    {h, 1, false}});
  return groups;
}

// The gpt step on one device (src/models/models.cpp).
class GptStep final : public plan_walk::StepWalk {
 public:
  GptStep(const ModelShape& s, const JobShape& job)
      : StepWalk(s, job, gpt_groups(s, static_cast<double>(std::max<int64_t>(1, job.tp)))) {}

 private:
  // Autocast's weight copies of block g's linears (cached for the autocast scope; the weights'
  // copies are also saved for backward, the biases' are not).
  double block_weight_copies(size_t g) const {
    return weight_copy(g, 2) + weight_copy(g, 4) + weight_copy(g, 8) + weight_copy(g, 10);
  }
  double block_bias_copies(size_t g) const {
    return weight_copy(g, 3) + weight_copy(g, 5) + weight_copy(g, 9) + weight_copy(g, 11);
  }

  // ---- forward ----
  // One block's forward. `saving`: grad mode (the saved tensors stay); else (activation
  // checkpointing's first forward) each tensor is freed where the C++ statement ends.
  // One block's forward. Under tensor parallelism (tp_ ranks) the heads' and the MLP's tensors
  // are this rank's 1/tp_; the residual stream and the norms stay whole.
  void block_forward(size_t g, bool saving, const std::string& moment) {
    const double X = x_, e = e_, r = r_, stats = 2.0 * 4.0 * tok_, T = tp_;
    const double lse = 4.0 * heads_ * tok_ / T;
    // x = x + attn(ln_1(x))
    walk_.add(kActivations, stats + r * X, moment);  // ln_1: mean/rstd, output
    if (cast_) walk_.add(kCopies, weight_copy(g, 2) + weight_copy(g, 3), moment);
    if (cast_) walk_.add(kActivations, e * X, moment);  // the input cast for c_attn
    walk_.add(kActivations, 3 * e * X / T, moment);     // qkv
    walk_.add(kActivations, e * X / T + lse, moment);   // attention output, log-sum-exp
    if (cast_) walk_.add(kCopies, weight_copy(g, 4) + weight_copy(g, 5), moment);
    row_parallel_output(moment);                 // c_proj's output
    walk_.add(kActivations, r * X, moment);      // x2, the residual sum
    walk_.free(kActivations, e * X);             // c_proj's output
    if (cast_) walk_.free(kActivations, r * X);  // ln_1's fp32 output (its cast is saved)
    if (!saving) {
      walk_.free(kActivations, stats + (cast_ ? e : r) * X + 4 * e * X / T + lse);
    }
    // h = gelu(c_fc(ln_2(x)))
    walk_.add(kActivations, stats + r * X, moment);
    if (cast_) walk_.add(kCopies, weight_copy(g, 8) + weight_copy(g, 9), moment);
    if (cast_) walk_.add(kActivations, e * X, moment);
    walk_.add(kActivations, 4 * e * X / T, moment);  // c_fc's output
    walk_.add(kActivations, 4 * e * X / T, moment);  // gelu's output
    if (cast_) walk_.free(kActivations, r * X);
    if (!saving) walk_.free(kActivations, stats + (cast_ ? e : r) * X + 4 * e * X / T);
    // x + c_proj(h)
    if (cast_) walk_.add(kCopies, weight_copy(g, 10) + weight_copy(g, 11), moment);
    row_parallel_output(moment);
    walk_.add(kActivations, r * X, moment);  // the block's output
    walk_.free(kActivations, e * X);
    if (!saving) walk_.free(kActivations, 4 * e * X / T + r * X);  // h and x2
  }

  void forward_and_loss() override {
    const std::string fwd = "the forward" + micro_text();
    const double X = x_, r = r_;
    walk_.add(kActivations, 2.0 * 8.0 * tok_, fwd);  // the batch: inputs and targets, int64
    // Embeddings: wte(idx) + wpe(pos).
    walk_.add(kActivations, r * X + r * t_ * h_, fwd);
    walk_.add(kActivations, r * X, fwd);  // x0
    walk_.free(kActivations, r * X + r * t_ * h_);
    const size_t units = groups_.size() - 1;
    for (size_t g = 0; g < units; ++g) {
      const std::string moment = unit_forward_moment(g);
      gather_for_forward(g, units, moment);
      block_forward(g, !job_.activation_checkpointing, moment);
      release_after_forward(g);
    }
    // ln_f, the tied head, cross-entropy in fp32.
    const std::string loss = "the loss" + micro_text();
    const double lnf = 2.0 * 4.0 * tok_ + r * X;
    walk_.add(kActivations, lnf, loss);
    if (cast_) walk_.add(kCopies, e_ * v_ * h_, loss);      // the head's weight (wte) copy
    if (cast_) walk_.add(kActivations, e_ * X, loss);       // ln_f's output cast for the head
    const double logits = (mixed_ ? e_ : 4.0) * tok_ * v_;  // the head's output
    walk_.add(kLogits, logits, loss);
    if (mixed_) walk_.add(kLogits, 4.0 * tok_ * v_, loss);  // cross-entropy's fp32 input
    walk_.add(kLogits, 4.0 * tok_ * v_, loss);              // log-softmax's output (saved)
    if (mixed_) walk_.free(kLogits, 4.0 * tok_ * v_);
    if (cast_) walk_.free(kActivations, r * X);  // ln_f's fp32 output (its cast is saved)
    walk_.free(kLogits, logits);                 // the forward scope ends
    if (cast_) {  // autocast's scope ends: its cache (the biases' copies) is cleared
      const size_t blocks = groups_.size() - 1;
      for (size_t g = 0; g < blocks; ++g) {
        walk_.free(kCopies, block_bias_copies(g));
        if (job_.activation_checkpointing) walk_.free(kCopies, block_weight_copies(g));
      }
    }
  }

  // ---- backward ----
  // One block's backward from the gradient of its output (live in kBackward).
  void block_backward(size_t g, const std::string& moment) {
    const double X = x_, e = e_, r = r_, stats = 2.0 * 4.0 * tok_, T = tp_;
    const double lse = 4.0 * heads_ * tok_ / T;
    const bool ac = job_.activation_checkpointing;
    // x3 = x2 + c_proj(h): the bf16 branch's gradient is a cast copy.
    if (cast_) walk_.add(kBackward, e * X, moment);
    walk_.add(kBackward, 4 * e * X / T, moment);  // d h
    gradients(g, {10, 11}, moment);
    walk_.free(kActivations, 4 * e * X / T);  // h
    walk_.free(kCopies, weight_copy(g, 10));
    if (cast_) walk_.free(kBackward, e * X);
    walk_.add(kBackward, 4 * e * X / T, moment);  // d c_fc output (gelu's backward)
    walk_.free(kActivations, 4 * e * X / T);
    walk_.free(kBackward, 4 * e * X / T);
    walk_.add(kBackward, e * X, moment);  // d ln_2 output
    gradients(g, {8, 9}, moment);
    walk_.free(kActivations, (cast_ ? e : r) * X);
    walk_.free(kCopies, weight_copy(g, 8));
    walk_.free(kBackward, 4 * e * X / T);
    if (cast_) {
      walk_.add(kBackward, r * X, moment);
      walk_.free(kBackward, e * X);
    }
    const double d_ln = cast_ ? r * X : e * X;
    all_reduced_input_gradient(d_ln, moment);
    walk_.add(kBackward, r * X, moment);  // d x2 through ln_2
    gradients(g, {6, 7}, moment);
    walk_.free(kActivations, stats + r * X);  // ln_2's mean/rstd, x2
    walk_.free(kBackward, d_ln);
    // Summed into the residual gradient: in place, except inside checkpointing's recomputed
    // graph, where the outer gradient is still referenced.
    if (ac) walk_.add(kBackward, r * X, moment);
    walk_.free(kBackward, r * X);
    // x2 = x + attn(ln_1(x))
    if (cast_) walk_.add(kBackward, e * X, moment);
    walk_.add(kBackward, e * X / T, moment);  // d attention output
    gradients(g, {4, 5}, moment);
    walk_.free(kCopies, weight_copy(g, 4));
    if (cast_) walk_.free(kBackward, e * X);
    walk_.add(kBackward, 3 * e * X / T, moment);  // d q, d k, d v
    walk_.free(kBackward, e * X / T);
    walk_.free(kActivations, e * X / T + lse);
    walk_.add(kBackward, 3 * e * X / T, moment);  // d qkv
    walk_.free(kBackward, 3 * e * X / T);
    walk_.add(kBackward, e * X, moment);  // d ln_1 output
    gradients(g, {2, 3}, moment);
    walk_.free(kActivations, 3 * e * X / T + (cast_ ? e : r) * X);
    walk_.free(kCopies, weight_copy(g, 2));
    walk_.free(kBackward, 3 * e * X / T);
    if (cast_) {
      walk_.add(kBackward, r * X, moment);
      walk_.free(kBackward, e * X);
    }
    all_reduced_input_gradient(d_ln, moment);
    walk_.add(kBackward, r * X, moment);  // d x through ln_1
    gradients(g, {0, 1}, moment);
    walk_.free(kActivations, stats + r * X);  // ln_1's mean/rstd, the block's input
    walk_.free(kBackward, d_ln);
    walk_.free(kBackward, r * X);  // summed in place into the residual gradient
    if (ac) {
      walk_.free(kActivations, r * X);  // the recomputed output
      walk_.free(kBackward, r * X);     // the outer gradient of the block's output
    }
    group_ready(g, moment);
  }

  void backward() override {
    const double X = x_, r = r_;
    const size_t rg = root();
    // Cross-entropy's backward: d log-softmax, d logits (fp32), then the head's.
    const std::string loss = "the loss's backward" + micro_text();
    walk_.add(kLogits, 4.0 * tok_ * v_, loss);
    walk_.add(kLogits, 4.0 * tok_ * v_, loss);
    walk_.free(kLogits, 8.0 * tok_ * v_);  // the log-softmax output and its gradient
    if (mixed_) {
      walk_.add(kLogits, e_ * tok_ * v_, loss);
      walk_.free(kLogits, 4.0 * tok_ * v_);
    }
    const double d_logits = (mixed_ ? e_ : 4.0) * tok_ * v_;
    const std::string head = "the head's backward" + micro_text();
    walk_.add(kBackward, (mixed_ ? e_ : 4.0) * X, head);  // d ln_f output
    parameter_gradient(rg, {v_, h_, true}, head);         // the tied head's share of wte
    walk_.free(kLogits, d_logits);
    walk_.free(kActivations, cast_ ? e_ * X : r * X);  // ln_f's output as the head saw it
    if (cast_) walk_.free(kCopies, e_ * v_ * h_);
    if (cast_) {
      walk_.add(kBackward, r * X, head);
      walk_.free(kBackward, e_ * X);
    }
    walk_.add(kBackward, r * X, head);  // d of the last block's output
    parameter_gradient(rg, groups_[rg][2], head);
    parameter_gradient(rg, groups_[rg][3], head);
    walk_.free(kActivations, 2.0 * 4.0 * tok_ + r * X);  // ln_f's mean/rstd and input
    walk_.free(kBackward, (mixed_ && !cast_ ? e_ : r) * X);
    const size_t units = groups_.size() - 1;
    for (size_t k = units; k-- > 0;) {
      const std::string moment = unit_backward_moment(k);
      gather_for_backward(k, moment);
      if (job_.activation_checkpointing) {  // the kept input's block, recomputed with grad
        block_forward(k, true, moment);
        if (cast_) walk_.free(kCopies, block_bias_copies(k));
      }
      block_backward(k, moment);
    }
    // The embeddings: wte's gradient (summed into the head's), wpe's.
    const std::string embed = "the embeddings' backward" + micro_text();
    walk_.add(kBackward, r * static_cast<double>(s_.vocab_size) * h_, embed);
    walk_.free(kBackward, r * static_cast<double>(s_.vocab_size) * h_);
    walk_.add(kBackward, r * t_ * h_, embed);  // d pos embedding output, summed over the batch
    parameter_gradient(rg, groups_[rg][1], embed);
    walk_.free(kBackward, r * t_ * h_);
    walk_.free(kBackward, r * X);                // the gradient of x0
    walk_.free(kActivations, 2.0 * 8.0 * tok_);  // the batch
    group_ready(rg, embed);
    if (ddp_ && communicating_) {
      // The gradients become views of the averaged buckets.
      walk_.free(kGradients, walk_.live(kGradients));
    }
  }
};

// The mlp (fc1, ReLU, fc2): small enough for a closed form. fc1 saves its input [b, D], ReLU its
// output [b, H], fc2 its input [b, H]; cross-entropy's log-softmax [b, K] and two gradients.
MemoryEstimate mlp_estimate(const ModelShape& s, const JobShape& job) {
  MemoryEstimate m;
  const double n = static_cast<double>(analytic_parameter_count(s));
  const std::string compute = compute_precision(job.precision);
  const double e = compute == "bf16" || compute == "fp16" ? 2.0 : 4.0;
  const double b = static_cast<double>(job.micro_batch);
  m.parameters = 4.0 * n;
  m.optimizer = (state_bytes_per_parameter(job) - 8.0) * n;
  m.activations =
      b * (static_cast<double>(s.input_dim) + 2.0 * static_cast<double>(s.hidden_dim)) * e;
  m.logits = 3.0 * b * static_cast<double>(s.num_classes) * 4.0;
  m.backward_extra = b * static_cast<double>(s.hidden_dim) * e;
  m.gradients_held = job.grad_accum_steps > 1;
  m.gradients = m.gradients_held ? 4.0 * n : 0.0;
  const double moment = std::max(m.activations + m.logits, m.activations + m.backward_extra);
  // DDP holds the gradient buckets across steps (the gradients become views of them).
  m.communication = job.strategy == "ddp" && job.world_size > 1 ? 4.0 * n : 0.0;
  m.peak_bytes = m.parameters + m.optimizer + m.communication +
                 (m.gradients_held ? m.gradients + moment : std::max(moment, 4.0 * n));
  m.peak_at = "the loss's backward";
  m.gradients_after_step = 4.0 * n;
  m.everything_bytes = 4.0 * n + 4.0 * n + m.optimizer + moment;
  return m;
}

// A model kiln knows only by its registered math (ModelSpec::math): the held state and the
// gradients exactly (parameters x bytes); its activations from the figures the math gives
// (ModelMath::activation_elements_per_sample and the unit ones), else none. The step is walked
// as U equal units (the largest unit's parameters each, the rest the root group) and the values
// saved outside the units (O = activations - U x unit's), all live until the backward: the
// backward runs the units last to first, each adding its gradients while the units before it
// still hold their saved values (with checkpointing: their inputs, and the one unit being
// recomputed), so the peak is the forward's end or the first unit's backward.
MemoryEstimate registered_model_estimate(const ModelShape& s, const JobShape& job) {
  MemoryEstimate m;
  const double n = static_cast<double>(analytic_parameter_count(s));
  const bool fsdp = job.strategy == "fsdp" && job.world_size > 1;
  const double share = fsdp ? 1.0 / static_cast<double>(job.world_size) : 1.0;
  const std::string compute = compute_precision(job.precision);
  const bool mixed = compute == "bf16" || compute == "fp16";
  const double e = mixed ? 2.0 : 4.0, b = static_cast<double>(job.micro_batch);
  m.parameters = 4.0 * n * share;
  m.optimizer = (state_bytes_per_parameter(job) - 8.0) * n * share;
  m.communication = job.strategy == "ddp" && job.world_size > 1 ? 4.0 * n : 0.0;
  m.gradients_held = job.grad_accum_steps > 1;
  m.gradients_after_step = 4.0 * n * share;
  m.everything_bytes = n * state_bytes_per_parameter(job);
  const double held = m.parameters + m.optimizer + m.communication;
  // Gradients across micro-batches: the full ones accumulate (FSDP too, unless it accumulates
  // sharded), beside FSDP's gradient shards.
  const bool full_held = m.gradients_held && !(fsdp && job.fsdp_accumulate_sharded);
  const double held_gradients = (full_held ? 4.0 * n : 0.0) + (fsdp ? 4.0 * n * share : 0.0);

  const double all = s.math_activation_elements;
  if (all <= 0) {  // no activation figures: the held state and the gradients
    m.gradients = 4.0 * n * share;
    m.peak_bytes = held + m.gradients;
    m.peak_at = fmt::format(
        "the held state and gradients only (model.name = \"{}\" gives no "
        "ModelMath::activation_elements_per_sample)",
        s.architecture);
    return m;
  }
  const double units = static_cast<double>(std::max<int64_t>(s.math_units, 0));
  const double unit_params =
      units > 0 ? std::min(static_cast<double>(s.math_largest_unit_parameters), n / units) : 0.0;
  const double root_params = n - units * unit_params;
  const double unit_saved =
      std::min(s.math_unit_activation_elements, units > 0 ? all / units : 0.0);
  const double outside = all - units * unit_saved;
  const bool checkpointed = job.activation_checkpointing && units > 0 && unit_saved > 0;
  const double unit_kept = checkpointed ? s.math_unit_input_elements : unit_saved;
  // Autocast's weight copies (the multiplying parameters' share of a group, in the compute dtype),
  // held while the values saved with them live. FSDP mixed precision gathers bf16 itself.
  const double cast = mixed && !fsdp ? e * static_cast<double>(s.math_flop_parameters) / n : 0.0;
  // FSDP: the gathered unit and the prefetched next one, in the gather dtype.
  const double gathered =
      fsdp ? (mixed ? 2.0 : 4.0) * unit_params * (job.fsdp_prefetch ? 2.0 : 1.0) : 0.0;

  // The forward's end: every unit's kept values, the values outside the units, the copies.
  const double forward_acts = b * e * (outside + units * unit_kept);
  const double forward_copies = cast * n;
  double peak = held + held_gradients + forward_acts + forward_copies + gathered;
  m.activations = forward_acts;
  m.autocast_copies = forward_copies;
  m.gradients = held_gradients;
  m.communication += gathered;
  m.peak_at = "the forward's end";
  // Unit k's backward (k = U-1 .. 0) in the last micro-batch: units 0..k still hold their values
  // (unit k its whole saved set, recomputed under checkpointing), the root's gradients and those
  // of units k..U-1 exist (accumulating or under FSDP: the held ones, plus unit k's fresh
  // gradients before they are added or reduce-scattered), and one unit-input-sized gradient flows
  // between units.
  for (int64_t k = static_cast<int64_t>(units) - 1; k >= 0; --k) {
    const double before = static_cast<double>(k);
    const double acts = b * e * (outside + before * unit_kept + unit_saved);
    const double copies = cast * (root_params + (before + 1.0) * unit_params);
    const double grads = held_gradients > 0 ? held_gradients + 4.0 * unit_params
                                            : 4.0 * (root_params + (units - before) * unit_params);
    const double flowing = b * e * s.math_unit_input_elements;
    const double live = held + acts + copies + grads + flowing + gathered;
    if (live > peak) {
      peak = live;
      m.activations = acts;
      m.autocast_copies = copies;
      m.gradients = grads;
      m.backward_extra = flowing;
      m.peak_at =
          fmt::format("unit {}'s {}", k, checkpointed ? "recomputation and backward" : "backward");
    }
  }
  // No units: the whole backward at once, every gradient beside every saved value.
  if (units == 0) {
    const double grads = std::max(held_gradients, 4.0 * n * share);
    const double live = held + forward_acts + forward_copies + grads + gathered;
    if (live > peak) {
      peak = live;
      m.gradients = grads;
      m.peak_at = "the backward";
    }
  }
  m.peak_bytes = peak;
  return m;
}

}  // namespace

MemoryEstimate estimate_memory(const ModelShape& shape, const JobShape& job) {
  using Layout = ModelMath::StepLayout;
  if (shape.layout == Layout::kMlp) return mlp_estimate(shape, job);
  if (shape.layout == Layout::kGeneric) return registered_model_estimate(shape, job);
  // A decoder kiln walks allocation by allocation (the layout the model's math names).
  auto walk = [&shape](const JobShape& j) {
    return shape.layout == Layout::kLlamaDecoder ? plan_walk::llama_step_estimate(shape, j)
                                                 : GptStep(shape, j).run();
  };
  MemoryEstimate m = walk(job);
  // The strategy rule's figure: DDP on every device, one micro-batch.
  JobShape ddp = job;
  ddp.strategy = "ddp";
  ddp.world_size = 2;
  ddp.grad_accum_steps = 1;
  m.everything_bytes = walk(ddp).peak_bytes;
  return m;
}

nlohmann::json to_json(const MemoryEstimate& m) {
  return {{"parameters_bytes", m.parameters},
          {"gradients_bytes", m.gradients},
          {"optimizer_bytes", m.optimizer},
          {"activations_bytes", m.activations},
          {"logits_bytes", m.logits},
          {"backward_extra_bytes", m.backward_extra},
          {"autocast_copies_bytes", m.autocast_copies},
          {"communication_bytes", m.communication},
          {"gradients_after_step_bytes", m.gradients_after_step},
          {"gradients_held_across_micro_batches", m.gradients_held},
          {"peak_at", m.peak_at},
          {"step_peak_bytes", m.step_peak()},
          {"total_bytes", m.total()}};
}

StrategyInput strategy_input(const ModelShape& shape, const JobShape& job,
                             double device_memory_bytes, double headroom_fraction) {
  JobShape unsharded = job;
  unsharded.strategy = "none";
  const MemoryEstimate m = estimate_memory(shape, unsharded);
  const double n = static_cast<double>(analytic_parameter_count(shape));
  StrategyInput in;
  in.ddp_model_state_bytes = n * state_bytes_per_parameter(job);
  in.largest_unit_parameter_bytes = 4.0 * static_cast<double>(largest_unit_parameter_count(shape));
  // The parts live at the unsharded step's peak beyond the state: the activations (they do not
  // shard), and autocast's weight copies apart (DDP's whole model; FSDP gathers a unit in the
  // compute dtype itself, no copies: the unit term).
  in.activation_bytes = m.activations + m.logits + m.backward_extra;
  in.weight_copy_bytes = m.autocast_copies;
  in.activation_checkpointing = job.activation_checkpointing;
  in.device_memory_bytes = device_memory_bytes;
  in.headroom_fraction = headroom_fraction;
  in.gpu_count = job.world_size;
  const int64_t tp_parameters = shape.math_tensor_parallel_parameters;
  if (tp_parameters > 0 && n > 0) {
    in.tensor_parallel_degrees = shape.tensor_parallel_degrees;
    in.tensor_parallel_fraction = static_cast<double>(tp_parameters) / n;
    const double units = static_cast<double>(std::max<int64_t>(1, shape.math_units));
    const double block = static_cast<double>(shape.math_tensor_parallel_block_parameters);
    const double sliced = static_cast<double>(tp_parameters) / units;
    const double rest = n - units * block;  // embeddings, final norm, head: one whole group
    for (int64_t t : shape.tensor_parallel_degrees) {
      in.tensor_parallel_unit_bytes[t] =
          4.0 * std::max(rest, block - sliced + sliced / static_cast<double>(t));
    }
    // The bytes TP all-reduces per micro-batch: 2 per layer forward (after attention and after
    // the MLP), 2 backward (their inputs' gradients), each [b, s, C] in the compute dtype.
    const double compute_bytes = job.precision == "fp32" ? 4.0 : 2.0;
    in.tensor_parallel_bytes = 4.0 * static_cast<double>(shape.n_layer) *
                               static_cast<double>(job.micro_batch * job.seq_len) *
                               static_cast<double>(shape.n_embd) * compute_bytes;
  }
  in.parameter_bytes = 4.0 * n;
  in.grad_accum_steps = job.grad_accum_steps;
  return in;
}

}  // namespace kiln
