// The memory model's walk of a llama step (src/models/llama.cpp; docs/plan.md, "Memory"): as the
// gpt's (memory_model.cpp), with RMSNorm computed in fp32 (one autograd node), grouped-query
// attention (SDPA's enable_gqa: the key and value heads are not repeated), rotary embeddings
// applied to the queries and keys, a SwiGLU MLP of width I, no biases and no position embedding.
//
// Units as step_walk.h; besides: q = b t (H D) = X query elements, kv = b t (K D) key (and value)
// elements, m = b t I MLP elements. Autocast casts an activation again for every linear that
// reads it (only weights are cached), so the q, k and v projections keep three copies of the
// normed input and the gate and up projections two.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kiln/plan.h"
#include "plan/step_walk.h"

namespace kiln::plan_walk {
namespace {

// llama's parameters per FSDP group: each decoder layer in registration order (q, k, v, o,
// gate, up, down, input_layernorm, post_attention_layernorm), then the root (embed_tokens, norm,
// and lm_head when untied).
// Under tensor parallelism over `tp` ranks, this rank's slices (Llama::shard_tensor_parallel):
// q, k, v, gate and up's rows, o and down's columns.
std::vector<std::vector<Param>> llama_groups(const ModelShape& s, double tp) {
  const double c = static_cast<double>(s.n_embd);
  const double d = c / static_cast<double>(s.n_head);
  const double kv = static_cast<double>(s.n_kv_head) * d / tp;
  const double i = static_cast<double>(s.intermediate_size) / tp;
  const std::vector<Param> layer = {{c / tp, c, true}, {kv, c, true}, {kv, c, true},
                                    {c, c / tp, true}, {i, c, true},  {i, c, true},
                                    {c, i, true},      {c, 1, false}, {c, 1, false}};
  std::vector<std::vector<Param>> groups(static_cast<size_t>(s.n_layer), layer);
  const double v = static_cast<double>(s.vocab_size);
  std::vector<Param> root = {{v, c, s.tie_embeddings}, {c, 1, false}};
  if (!s.tie_embeddings) root.push_back({v, c, true});
  groups.push_back(root);
  return groups;
}

enum LayerParam { kQ, kK, kV, kO, kGate, kUp, kDown, kNorm1, kNorm2 };

class LlamaStep final : public StepWalk {
 public:
  // Under tensor parallelism the heads' tensors (q_ query elements, kv_, the log-sum-exp) and
  // the MLP's (m_) are this rank's 1/tp; the residual stream and the norms stay whole.
  LlamaStep(const ModelShape& s, const JobShape& job)
      : StepWalk(s, job, llama_groups(s, static_cast<double>(std::max<int64_t>(1, job.tp)))) {
    const double d = h_ / heads_;
    q_ = x_ / tp_;
    kv_ = tok_ * static_cast<double>(s.n_kv_head) * d / tp_;
    m_ = tok_ * static_cast<double>(s.intermediate_size) / tp_;
  }

 private:
  // ---- RMSNorm (fp32 inside; the output in the residual's dtype) ----
  // Saved: rsqrt [tok] fp32, the normed input (r bytes) and, for a bf16 residual, its fp32 copy.
  double norm_saved() const { return 4.0 * tok_ + r_ * x_ + (r_ < 4.0 ? 4.0 * x_ : 0.0); }
  void norm_forward(const std::string& moment) {
    const double X = x_;
    if (r_ < 4.0) walk_.add(kActivations, 4.0 * X, moment);  // x.to(float)
    walk_.add(kBackward, 4.0 * X, moment);                   // h^2, freed after the mean
    walk_.add(kActivations, 4.0 * tok_, moment);             // rsqrt
    walk_.free(kBackward, 4.0 * X);
    walk_.add(kActivations, 4.0 * X, moment);  // h * rsqrt
    if (r_ < 4.0) {                            // cast back to the residual's dtype
      walk_.add(kActivations, r_ * X, moment);
      walk_.free(kActivations, 4.0 * X);
    }
    walk_.add(kActivations, r_ * X, moment);  // weight * normed: the output
  }
  // The norm's backward from the gradient of its output (live, r X): d weight, then d input
  // (r X, left live), the saved tensors freed; fp32 working buffers in between.
  void norm_backward(size_t g, size_t param, const std::string& moment) {
    const double X = x_;
    walk_.add(kBackward, r_ * X, moment);  // d normed = d out * weight
    parameter_gradient(g, groups_[g][param], moment);
    walk_.add(kBackward, 8.0 * X, moment);  // d h and the rsqrt path's product, fp32
    walk_.free(kBackward, r_ * X);
    walk_.add(kBackward, r_ * X, moment);  // d input
    walk_.free(kBackward, 8.0 * X);
    walk_.free(kActivations, norm_saved());
  }

  // One decoder layer's forward. `saving`: grad mode; else (activation checkpointing's first
  // forward) what the layer saves is freed as it goes.
  void layer_forward(size_t g, bool saving, const std::string& moment) {
    const double X = x_, e = e_, r = r_, q = q_, kv = kv_, m = m_;
    const double lse = 4.0 * heads_ * tok_ / tp_;
    // x = x + attention(input_layernorm(x))
    norm_forward(moment);
    if (cast_) {
      walk_.add(kCopies, weight_copy(g, kQ) + weight_copy(g, kK) + weight_copy(g, kV), moment);
      walk_.add(kActivations, 3.0 * e * X, moment);  // the normed input cast for q, k, v
      walk_.free(kActivations, r * X);               // its fp32 original
    }
    const double normed_inputs = cast_ ? 3.0 * e * X : r * X;
    walk_.add(kActivations, e * q + 2.0 * e * kv, moment);  // q, k, v
    // Rotary: q cos, plus (in place) the swapped halves times the signed sin.
    walk_.add(kActivations, e * q, moment);     // rotated q
    walk_.add(kBackward, 2.0 * e * q, moment);  // the swapped halves, their product
    walk_.free(kBackward, 2.0 * e * q);
    walk_.free(kActivations, e * q);          // q
    walk_.add(kActivations, e * kv, moment);  // rotated k
    walk_.add(kBackward, 2.0 * e * kv, moment);
    walk_.free(kBackward, 2.0 * e * kv);
    walk_.free(kActivations, e * kv);  // k
    // Attention reads the key/value heads as they are (grouped inside SDPA).
    const double attention_inputs = e * q + 2.0 * e * kv;
    walk_.add(kActivations, e * q + lse, moment);  // attention output (saved), log-sum-exp
    if (cast_) walk_.add(kCopies, weight_copy(g, kO), moment);
    row_parallel_output(moment);             // o_proj's output
    walk_.add(kActivations, r * X, moment);  // x2, the residual sum
    walk_.free(kActivations, e * X);         // o_proj's output
    if (!saving)
      walk_.free(kActivations, norm_saved() + normed_inputs + attention_inputs + e * q + lse);
    // x2 + down(silu(gate(n)) * up(n)), n = post_attention_layernorm(x2)
    norm_forward(moment);
    if (cast_) {
      walk_.add(kCopies, weight_copy(g, kGate) + weight_copy(g, kUp), moment);
      walk_.add(kActivations, 2.0 * e * X, moment);
      walk_.free(kActivations, r * X);
    }
    walk_.add(kActivations, 4.0 * e * m, moment);  // gate, silu(gate), up, their product
    if (cast_) walk_.add(kCopies, weight_copy(g, kDown), moment);
    row_parallel_output(moment);             // down's output
    walk_.add(kActivations, r * X, moment);  // the layer's output
    walk_.free(kActivations, e * X);
    if (!saving) {
      walk_.free(kActivations, norm_saved() + (cast_ ? 2.0 * e * X : r * X) + 4.0 * e * m);
      walk_.free(kActivations, r * X);  // x2
    } else {
      // The norms save their normed values, not their inputs: x2 goes, and so does the layer's
      // input, unless activation checkpointing keeps it (until the layer's backward).
      walk_.free(kActivations, r * X);
      if (!job_.activation_checkpointing) walk_.free(kActivations, r * X);
    }
  }

  // One layer's backward from the gradient of its output (live in kBackward, r X).
  void layer_backward(size_t g, const std::string& moment) {
    const double X = x_, e = e_, r = r_, q = q_, kv = kv_, m = m_;
    const double lse = 4.0 * heads_ * tok_ / tp_;
    const bool ac = job_.activation_checkpointing;
    // The MLP.
    if (cast_) walk_.add(kBackward, e * X, moment);  // the branch's gradient, cast
    walk_.add(kBackward, e * m, moment);             // d product
    gradients(g, {kDown}, moment);
    walk_.free(kActivations, e * m);  // the product
    walk_.free(kCopies, weight_copy(g, kDown));
    if (cast_) walk_.free(kBackward, e * X);
    walk_.add(kBackward, 2.0 * e * m, moment);  // d silu, d up
    walk_.free(kBackward, e * m);
    walk_.free(kActivations, 2.0 * e * m);  // silu(gate), up
    walk_.add(kBackward, e * X, moment);    // d n through up
    gradients(g, {kUp}, moment);
    walk_.add(kBackward, e * m, moment);  // d gate
    walk_.free(kBackward, 2.0 * e * m);
    walk_.free(kActivations, e * m);      // gate
    walk_.add(kBackward, e * X, moment);  // d n through gate
    gradients(g, {kGate}, moment);
    walk_.free(kBackward, e * m);
    walk_.free(kCopies, weight_copy(g, kGate) + weight_copy(g, kUp));
    walk_.free(kActivations, cast_ ? 2.0 * e * X : r * X);
    walk_.add(kBackward, r * X, moment);  // d n, summed (fp32 under autocast)
    walk_.free(kBackward, 2.0 * e * X);
    all_reduced_input_gradient(r * X, moment);
    norm_backward(g, kNorm2, moment);
    walk_.free(kBackward, r * X);  // d n
    // Summed into the residual gradient: in place, except inside checkpointing's recomputed
    // graph, where the outer gradient is still referenced.
    if (ac) walk_.add(kBackward, r * X, moment);
    walk_.free(kBackward, r * X);
    // Attention.
    if (cast_) walk_.add(kBackward, e * X, moment);
    walk_.add(kBackward, e * q, moment);  // d attention output
    gradients(g, {kO}, moment);
    walk_.free(kCopies, weight_copy(g, kO));
    if (cast_) walk_.free(kBackward, e * X);
    walk_.add(kBackward, e * q + 2.0 * e * kv, moment);  // d q, d k, d v (their own heads)
    walk_.free(kBackward, e * q);
    walk_.free(kActivations, e * q + lse + e * q + 2.0 * e * kv);  // output, lse, q, k, v
    // Rotary's backward for d q and d k.
    walk_.add(kBackward, 2.0 * e * q + 2.0 * e * kv, moment);
    walk_.free(kBackward, 2.0 * e * q + 2.0 * e * kv);
    walk_.free(kActivations, e * q + e * kv);   // rotated q, k
    walk_.add(kBackward, 3.0 * e * X, moment);  // d n through q, k, v
    gradients(g, {kQ, kK, kV}, moment);
    walk_.free(kBackward, e * q + 2.0 * e * kv);  // d q, d k, d v
    walk_.free(kCopies, weight_copy(g, kQ) + weight_copy(g, kK) + weight_copy(g, kV));
    walk_.free(kActivations, cast_ ? 3.0 * e * X : r * X);
    walk_.add(kBackward, r * X, moment);  // d n, summed
    walk_.free(kBackward, 3.0 * e * X);
    all_reduced_input_gradient(r * X, moment);
    norm_backward(g, kNorm1, moment);
    if (ac) walk_.free(kActivations, r * X);  // the layer's input, kept by the checkpoint
    walk_.free(kBackward, r * X);             // d n
    walk_.free(kBackward, r * X);             // summed in place into the residual gradient
    if (ac) {
      walk_.free(kActivations, r * X);  // the recomputed output
      walk_.free(kBackward, r * X);     // the outer gradient of the layer's output
    }
    group_ready(g, moment);
  }

  double layer_weight_copies(size_t g) const {
    double sum = 0;
    for (size_t k = kQ; k <= kDown; ++k) sum += weight_copy(g, k);
    return sum;
  }

  void forward_and_loss() override {
    const std::string fwd = "the forward" + micro_text();
    const double X = x_, r = r_;
    walk_.add(kActivations, 2.0 * 8.0 * tok_, fwd);  // the batch: inputs and targets, int64
    walk_.add(kActivations, r * X, fwd);             // x0 = embed_tokens(idx)
    const size_t units = groups_.size() - 1;
    for (size_t g = 0; g < units; ++g) {
      const std::string moment = unit_forward_moment(g);
      gather_for_forward(g, units, moment);
      layer_forward(g, !job_.activation_checkpointing, moment);
      release_after_forward(g);
    }
    // The final norm, the head, cross-entropy in fp32.
    const std::string loss = "the loss" + micro_text();
    norm_forward(loss);
    walk_.free(kActivations, r * X);  // the last layer's output (the norm keeps its normed value)
    const size_t head = s_.tie_embeddings ? 0 : 2;
    if (cast_) walk_.add(kCopies, weight_copy(root(), head), loss);
    if (cast_) walk_.add(kActivations, e_ * X, loss);  // the normed output cast for the head
    const double logits = (mixed_ ? e_ : 4.0) * tok_ * v_;
    walk_.add(kLogits, logits, loss);
    if (mixed_) walk_.add(kLogits, 4.0 * tok_ * v_, loss);  // cross-entropy's fp32 input
    walk_.add(kLogits, 4.0 * tok_ * v_, loss);              // log-softmax's output (saved)
    if (mixed_) walk_.free(kLogits, 4.0 * tok_ * v_);
    if (cast_) walk_.free(kActivations, r * X);  // the fp32 normed output (its cast is saved)
    walk_.free(kLogits, logits);
    if (cast_ && job_.activation_checkpointing) {  // the first forward's copies, uncached
      for (size_t g = 0; g < units; ++g) walk_.free(kCopies, layer_weight_copies(g));
    }
  }

  void backward() override {
    const double X = x_, r = r_;
    const size_t rg = root();
    const std::string loss = "the loss's backward" + micro_text();
    walk_.add(kLogits, 8.0 * tok_ * v_, loss);  // d log-softmax, d logits (fp32)
    walk_.free(kLogits, 8.0 * tok_ * v_);
    if (mixed_) {
      walk_.add(kLogits, e_ * tok_ * v_, loss);
      walk_.free(kLogits, 4.0 * tok_ * v_);
    }
    const double d_logits = (mixed_ ? e_ : 4.0) * tok_ * v_;
    const std::string head_moment = "the head's backward" + micro_text();
    const size_t head = s_.tie_embeddings ? 0 : 2;
    walk_.add(kBackward, (mixed_ ? e_ : 4.0) * X, head_moment);  // d normed output
    parameter_gradient(rg, groups_[rg][head], head_moment);
    walk_.free(kLogits, d_logits);
    walk_.free(kActivations, cast_ ? e_ * X : r * X);  // the normed output as the head saw it
    if (cast_) walk_.free(kCopies, weight_copy(rg, head));
    if (cast_) {
      walk_.add(kBackward, r * X, head_moment);
      walk_.free(kBackward, e_ * X);
    }
    // The final norm: d of the last layer's output.
    norm_backward(rg, 1, head_moment);
    walk_.free(kBackward, (mixed_ && !cast_ ? e_ : r) * X);
    const size_t units = groups_.size() - 1;
    for (size_t k = units; k-- > 0;) {
      const std::string moment = unit_backward_moment(k);
      gather_for_backward(k, moment);
      if (job_.activation_checkpointing) {  // the kept input's layer, recomputed with grad
        layer_forward(k, true, moment);
      }
      layer_backward(k, moment);
    }
    // embed_tokens' gradient (dense [V, C]; tied: summed into the head's).
    const std::string embed = "the embeddings' backward" + micro_text();
    if (s_.tie_embeddings) {
      walk_.add(kBackward, r * v_ * h_, embed);
      walk_.free(kBackward, r * v_ * h_);
    } else {
      parameter_gradient(rg, groups_[rg][0], embed);
    }
    walk_.free(kBackward, r * X);                // the gradient of x0
    walk_.free(kActivations, 2.0 * 8.0 * tok_);  // the batch
    group_ready(rg, embed);
    if (ddp_ && communicating_) walk_.free(kGradients, walk_.live(kGradients));
  }

  double q_ = 0, kv_ = 0, m_ = 0;
};

}  // namespace

MemoryEstimate llama_step_estimate(const ModelShape& shape, const JobShape& job) {
  return LlamaStep(shape, job).run();
}

}  // namespace kiln::plan_walk
