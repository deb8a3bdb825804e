// A Llama-style decoder (Hugging Face LlamaForCausalLM): RMSNorm, rotary position embeddings,
// SwiGLU MLP, grouped-query attention, no biases, optionally tied embeddings.
// B = batch, T = time, C = channels, H = query heads, K = key/value heads, D = head size,
// I = MLP width, V = vocabulary.
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <numeric>
#include <optional>

#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/models.h"
#include "models/internal.h"
#include "models/split_forward.h"
#include "models/tensor_parallel.h"

namespace kiln {
namespace {

namespace nn = torch::nn;
namespace F = torch::nn::functional;

nn::Linear linear(int64_t in, int64_t out) {
  return nn::Linear(nn::LinearOptions(in, out).bias(false));
}

// RMSNorm as one autograd node: the forward is Hugging Face's LlamaRMSNorm op for op (normalised
// in fp32, cast back to the input's dtype, then scaled: the same bits), the backward written out
// (d weight = sum of d out * normed; d x = rstd * (d normed - normed * mean(d normed * normed)))
// instead of autograd's chain through pow, mean, add, rsqrt and two products: about half the
// passes over [B, T, C]; d x may differ from autograd's chain in the last bits.
struct RmsNormFunction final : public torch::autograd::Function<RmsNormFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    const auto h = x.to(torch::kFloat);
    const auto rstd = torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);  // [..., 1]
    const auto normed = h * rstd;                                               // fp32
    const auto cast = normed.to(x.scalar_type());  // normed itself in fp32
    ctx->save_for_backward({normed, cast, rstd, weight});
    return weight * cast;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &normed = saved[0], &cast = saved[1], &rstd = saved[2], &weight = saved[3];
    const auto& grad = grads[0];
    torch::Tensor grad_x, grad_weight;
    if (ctx->needs_input_grad(1)) {  // summed over every dimension but the last
      std::vector<int64_t> dims(static_cast<size_t>(grad.dim() - 1));
      std::iota(dims.begin(), dims.end(), 0);
      grad_weight = (grad * cast).sum(dims).to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      // Through the casts as autograd would: to the input's dtype (cast's), then to fp32.
      // grad_normed is a fresh tensor (the product's), so the rest runs in place on it.
      auto grad_normed = (grad * weight).to(cast.scalar_type()).to(torch::kFloat);
      const auto mean = (grad_normed * normed).mean(-1, /*keepdim=*/true);
      grad_x = grad_normed.sub_(normed * mean).mul_(rstd).to(cast.scalar_type());
    }
    return {grad_x, grad_weight, torch::Tensor()};
  }
};

class RmsNorm final : public nn::Module {
 public:
  RmsNorm(int64_t width, double eps) : eps_(eps) {
    weight_ = register_parameter("weight", torch::ones({width}));
  }
  torch::Tensor forward(const torch::Tensor& x) const {
    return RmsNormFunction::apply(x, weight_, eps_);
  }

 private:
  double eps_;
  torch::Tensor weight_;
};

// The rotary tables for positions 0..T-1, [T, D] fp32, computed once per forward and shared by
// every layer: cos, and sin with its first half negated, so that rotate_half(x) * sin (Hugging
// Face's rotate-half convention, x = (x1, x2) -> (-x2, x1)) is swap_halves(x) * sin_signed, bit
// for bit (negation is exact) and one pass fewer. Each frequency serves both halves of a head
// (Hugging Face's default rope: inv_freq = 1 / theta^(2i / D)).
struct RotaryTables {
  torch::Tensor cos, sin_signed;
};

RotaryTables rotary_tables(int64_t T, int64_t D, double theta, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  auto exponent = torch::arange(0, D, 2, torch::TensorOptions().dtype(torch::kLong).device(device))
                      .to(torch::kFloat) /
                  static_cast<double>(D);
  auto inv_freq = 1.0 / torch::pow(theta, exponent);           // [D/2]
  auto freqs = torch::arange(T, f32).unsqueeze(1) * inv_freq;  // [T, D/2]
  auto sin = freqs.sin();
  return {torch::cat({freqs, freqs}, -1).cos(), torch::cat({-sin, sin}, -1)};
}

// x cos + rotate_half(x) sin over the last dimension (D), the tables cast to x's dtype. The
// product with sin is added in place into x cos (a fresh tensor no backward saved): one buffer
// fewer.
torch::Tensor apply_rotary(const torch::Tensor& x, const RotaryTables& tables) {
  const int64_t half = x.size(-1) / 2;
  auto rotated = x * tables.cos.to(x.scalar_type());
  rotated.add_(torch::cat({x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) *
               tables.sin_signed.to(x.scalar_type()));
  return rotated;
}

class Attention final : public nn::Module {
 public:
  explicit Attention(const LlamaConfig& c)
      : n_head_(c.n_head), n_kv_head_(c.n_kv_head), head_dim_(c.head_dim()) {
    q_proj_ = register_module("q_proj", linear(c.n_embd, c.n_head * head_dim_));
    k_proj_ = register_module("k_proj", linear(c.n_embd, c.n_kv_head * head_dim_));
    v_proj_ = register_module("v_proj", linear(c.n_embd, c.n_kv_head * head_dim_));
    o_proj_ = register_module("o_proj", linear(c.n_head * head_dim_, c.n_embd));
  }
  torch::Tensor forward(const torch::Tensor& input, const RotaryTables& rotary) {
    const int64_t B = input.size(0), T = input.size(1);
    auto heads = [&](const torch::Tensor& t, int64_t n) {
      return t.view({B, T, n, head_dim_}).transpose(1, 2);  // [B, n, T, D]
    };
    const torch::Tensor x = tp_ ? tensor_parallel::copy_to_ranks(input, *tp_) : input;
    auto q = apply_rotary(heads(q_proj_->forward(x), n_head_), rotary);     // [B, H, T, D]
    auto k = apply_rotary(heads(k_proj_->forward(x), n_kv_head_), rotary);  // [B, K, T, D]
    auto v = heads(v_proj_->forward(x), n_kv_head_);
    // Grouped-query attention inside SDPA (enable_gqa): each key/value head serves H/K
    // consecutive query heads, as repeat_interleave to H heads would, without the copies.
    auto y =
        at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                         /*is_causal=*/true, /*scale=*/std::nullopt,
                                         /*enable_gqa=*/n_kv_head_ != n_head_);  // [B, H, T, D]
    auto out = o_proj_->forward(y.transpose(1, 2).contiguous().view({B, T, n_head_ * head_dim_}));
    return tp_ ? tensor_parallel::reduce_from_ranks(out, *tp_) : out;
  }
  torch::Tensor o_proj_weight() const { return o_proj_->weight; }

  // Tensor parallelism: this rank's H/tp query heads and K/tp key/value heads (each key/value
  // head stays with the query heads it serves: tp divides K), column-parallel; o_proj's matching
  // input columns, row-parallel.
  void shard(std::shared_ptr<Communicator> tp, const std::string& prefix,
             std::map<std::string, TensorParallelPlacement>& placements) {
    placements[prefix + "q_proj.weight"] = tensor_parallel::shard(q_proj_->weight, 0, *tp);
    placements[prefix + "k_proj.weight"] = tensor_parallel::shard(k_proj_->weight, 0, *tp);
    placements[prefix + "v_proj.weight"] = tensor_parallel::shard(v_proj_->weight, 0, *tp);
    placements[prefix + "o_proj.weight"] = tensor_parallel::shard(o_proj_->weight, 1, *tp);
    n_head_ /= tp->world_size();
    n_kv_head_ /= tp->world_size();
    tp_ = std::move(tp);
  }

 private:
  int64_t n_head_, n_kv_head_, head_dim_;
  std::shared_ptr<Communicator> tp_;  // set by shard()
  nn::Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, o_proj_{nullptr};
};

class SwiGlu final : public nn::Module {
 public:
  SwiGlu(int64_t width, int64_t hidden) {
    gate_proj_ = register_module("gate_proj", linear(width, hidden));
    up_proj_ = register_module("up_proj", linear(width, hidden));
    down_proj_ = register_module("down_proj", linear(hidden, width));
  }
  torch::Tensor forward(const torch::Tensor& input) {
    const torch::Tensor x = tp_ ? tensor_parallel::copy_to_ranks(input, *tp_) : input;
    auto out = down_proj_->forward(torch::silu(gate_proj_->forward(x)) * up_proj_->forward(x));
    return tp_ ? tensor_parallel::reduce_from_ranks(out, *tp_) : out;
  }
  torch::Tensor down_proj_weight() const { return down_proj_->weight; }

  // Tensor parallelism: I/tp of the hidden features (gate and up column-parallel, down
  // row-parallel).
  void shard(std::shared_ptr<Communicator> tp, const std::string& prefix,
             std::map<std::string, TensorParallelPlacement>& placements) {
    placements[prefix + "gate_proj.weight"] = tensor_parallel::shard(gate_proj_->weight, 0, *tp);
    placements[prefix + "up_proj.weight"] = tensor_parallel::shard(up_proj_->weight, 0, *tp);
    placements[prefix + "down_proj.weight"] = tensor_parallel::shard(down_proj_->weight, 1, *tp);
    tp_ = std::move(tp);
  }

 private:
  nn::Linear gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
  std::shared_ptr<Communicator> tp_;  // set by shard()
};

class DecoderLayer final : public nn::Module {
 public:
  explicit DecoderLayer(const LlamaConfig& c) {
    self_attn_ = register_module("self_attn", std::make_shared<Attention>(c));
    mlp_ = register_module("mlp", std::make_shared<SwiGlu>(c.n_embd, c.intermediate_size));
    input_layernorm_ =
        register_module("input_layernorm", std::make_shared<RmsNorm>(c.n_embd, c.norm_eps));
    post_attention_layernorm_ = register_module("post_attention_layernorm",
                                                std::make_shared<RmsNorm>(c.n_embd, c.norm_eps));
  }
  torch::Tensor forward(torch::Tensor x, const RotaryTables& rotary) {
    x = x + self_attn_->forward(input_layernorm_->forward(x), rotary);
    return x + mlp_->forward(post_attention_layernorm_->forward(x));
  }
  void shard(const std::shared_ptr<Communicator>& tp, const std::string& prefix,
             std::map<std::string, TensorParallelPlacement>& placements) {
    self_attn_->shard(tp, prefix + "self_attn.", placements);
    mlp_->shard(tp, prefix + "mlp.", placements);
  }
  // The two residual projections, whose init is scaled by 1/sqrt(2 * n_layer).
  std::vector<torch::Tensor> residual_projections() const {
    return {self_attn_->o_proj_weight(), mlp_->down_proj_weight()};
  }

 private:
  std::shared_ptr<Attention> self_attn_;
  std::shared_ptr<SwiGlu> mlp_;
  std::shared_ptr<RmsNorm> input_layernorm_, post_attention_layernorm_;
};

class Llama final : public Model, public SplitForward {
 public:
  Llama(const LlamaConfig& config, at::Generator& generator) : config_(config) {
    auto model = register_module("model", std::make_shared<nn::Module>());
    embed_tokens_ =
        model->register_module("embed_tokens", nn::Embedding(config.vocab_size, config.n_embd));
    layers_ = model->register_module("layers", nn::ModuleList());
    for (int64_t i = 0; i < config.n_layer; ++i) {
      auto layer = std::make_shared<DecoderLayer>(config);
      layers_->push_back(layer);
      blocks_.push_back(layer);
    }
    norm_ =
        model->register_module("norm", std::make_shared<RmsNorm>(config.n_embd, config.norm_eps));
    if (!config.tie_embeddings) {
      lm_head_ = register_module("lm_head", linear(config.n_embd, config.vocab_size));
    }
    initialise(generator);
  }

  torch::Tensor forward(const torch::Tensor& idx) override {
    return after_units(through_units(before_units(idx)));
  }

  // SplitForward: the root around the layers (compile.root compiles the two pieces). The rotary
  // tables depend on the sequence length only, so through_units builds them from its input.
  std::vector<std::string> before_units_parameters() const override {
    return {"model.embed_tokens.weight"};
  }
  std::vector<std::string> after_units_parameters() const override {
    return {"model.norm.weight", lm_head_ ? "lm_head.weight" : "model.embed_tokens.weight"};
  }
  torch::Tensor before_units(const torch::Tensor& idx) override {
    if (idx.size(1) > config_.block_size) {
      throw UserError(fmt::format("sequence length {} exceeds model.block_size {}", idx.size(1),
                                  config_.block_size));
    }
    return embed_tokens_->forward(idx);  // [B, T, C]
  }
  torch::Tensor through_units(const torch::Tensor& hidden) override {
    // Shared by every layer, and owned by each layer's closure: activation checkpointing
    // recomputes a layer in backward, after this returns.
    const RotaryTables rotary =
        rotary_tables(hidden.size(1), config_.head_dim(), config_.rope_theta, hidden.device());
    torch::Tensor x = hidden;
    for (size_t i = 0; i < blocks_.size(); ++i) {
      x = run_unit(
          static_cast<int>(i),
          [layer = blocks_[i].get(), rotary](const torch::Tensor& in) {
            return layer->forward(in, rotary);
          },
          x);
    }
    return x;
  }
  torch::Tensor after_units(const torch::Tensor& hidden) override {
    const auto& head = lm_head_ ? lm_head_->weight : embed_tokens_->weight;
    return F::linear(norm_->forward(hidden), head);  // [B, T, V]
  }

  std::string architecture() const override { return "llama"; }
  nlohmann::json describe() const override {
    return {{"n_layer", config_.n_layer},
            {"n_head", config_.n_head},
            {"n_kv_head", config_.n_kv_head},
            {"n_embd", config_.n_embd},
            {"intermediate_size", config_.intermediate_size},
            {"block_size", config_.block_size},
            {"vocab_size", config_.vocab_size},
            {"rope_theta", config_.rope_theta},
            {"norm_eps", config_.norm_eps},
            {"tie_embeddings", config_.tie_embeddings},
            {"init_std", config_.init_std},
            {"activation", "swiglu"},
            {"norm", "pre-RMSNorm"}};
  }
  double train_flops_per_sample(int64_t seq_len) const override {
    return llama_math(config_).train_flops_per_token(seq_len) * static_cast<double>(seq_len);
  }
  std::vector<ModelUnit> units() const override { return block_units("model.layers", blocks_); }

  // The decoder layers split (heads, MLP width); the embedding, the norms and the head stay
  // whole on every rank: the head's logits are computed whole, so the loss needs no
  // vocabulary-parallel cross-entropy (its cost: the [C, V] matmul on every rank).
  void shard_tensor_parallel(std::shared_ptr<Communicator> tp) override {
    if (!tensor_parallel_.empty()) throw std::logic_error("llama: already tensor-parallel");
    if (std::string problem = llama_tensor_parallel_problem(config_, tp->world_size());
        !problem.empty())
      throw UserError(problem);
    for (size_t i = 0; i < blocks_.size(); ++i)
      blocks_[i]->shard(tp, fmt::format("model.layers.{}.", i), tensor_parallel_);
  }

 private:
  void initialise(at::Generator& generator) {
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) {
      if (p.dim() >= 2) p.normal_(0.0, config_.init_std, generator);  // norms stay 1
    }
    const double residual_std =
        config_.init_std / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
    for (auto& block : blocks_) {
      for (auto& w : block->residual_projections()) w.normal_(0.0, residual_std, generator);
    }
  }

  LlamaConfig config_;
  nn::Embedding embed_tokens_{nullptr};
  nn::ModuleList layers_{nullptr};
  std::shared_ptr<RmsNorm> norm_;
  nn::Linear lm_head_{nullptr};
  std::vector<std::shared_ptr<DecoderLayer>> blocks_;
};

}  // namespace

LlamaConfig llama_preset(const std::string& name) {
  LlamaConfig c;
  if (name == "llama3-8b") {
    c.n_layer = 32, c.n_head = 32, c.n_kv_head = 8, c.n_embd = 4096, c.intermediate_size = 14336;
    c.block_size = 8192, c.vocab_size = 128256, c.rope_theta = 500000.0;
  } else if (name == "small" || name == "llama-small") {  // ~19M
    c.n_layer = 12, c.n_head = 6, c.n_kv_head = 2, c.n_embd = 384, c.intermediate_size = 1024;
    c.block_size = 512, c.vocab_size = 256;
  } else {  // llama-tiny (~1M); also the fallback for a preset the rules refuse
    c.n_layer = 5, c.n_head = 4, c.n_kv_head = 2, c.n_embd = 128, c.intermediate_size = 352;
    c.block_size = 256, c.vocab_size = 256;
  }
  return c;
}

std::string llama_shape_problem(const LlamaConfig& c) {
  if (c.n_embd % c.n_head != 0 || c.head_dim() % 2 != 0) {
    return fmt::format(
        "model.n_embd = {} over model.n_head = {} is not an even head size (rotary embeddings "
        "rotate pairs); pick a head count that divides the width into an even size",
        c.n_embd, c.n_head);
  }
  if (c.n_head % c.n_kv_head != 0) {
    return fmt::format(
        "model.n_head = {} is not a multiple of model.n_kv_head = {}; each key/value head "
        "serves the same number of query heads",
        c.n_head, c.n_kv_head);
  }
  return "";
}

std::string llama_tensor_parallel_problem(const LlamaConfig& c, int64_t tp) {
  if (c.n_kv_head % tp != 0 || c.intermediate_size % tp != 0) {
    return fmt::format(
        "dist.tp = {} must divide the key/value heads (model.n_kv_head = {}; the query heads, "
        "model.n_head = {}, follow them) and the MLP width (model.intermediate_size = {}): each "
        "rank computes whole heads; pick a tp that divides both",
        tp, c.n_kv_head, c.n_head, c.intermediate_size);
  }
  return "";
}

LlamaConfig resolve_llama_config(const Config& config) {
  const LlamaConfig out = llama_shape(config);
  if (std::string problem = llama_shape_problem(out); !problem.empty()) throw UserError(problem);
  if (const int64_t seq_len = ModelBuildOptions::from_config(config).seq_len;
      seq_len > out.block_size) {
    throw UserError(fmt::format(
        "data.seq_len = {} exceeds the model's block_size {}; lower data.seq_len or raise "
        "model.block_size",
        seq_len, out.block_size));
  }
  return out;
}

ModelMath llama_math(const LlamaConfig& c) {
  const int64_t C = c.n_embd, D = c.head_dim(), kv = c.n_kv_head * D;
  const int64_t layer = C * c.n_head * D * 2 + 2 * C * kv + 3 * C * c.intermediate_size + 2 * C;
  const int64_t embedding = c.vocab_size * C;
  ModelMath m;
  m.parameters = embedding * (c.tie_embeddings ? 1 : 2) + c.n_layer * layer + C;
  m.largest_unit_parameters = std::max(layer, m.parameters - c.n_layer * layer);
  // The head's matmul counts; an untied embedding is a lookup and does not (torchtitan).
  m.flop_parameters = m.parameters - (c.tie_embeddings ? 0 : embedding);
  m.n_layer = c.n_layer;
  m.attention_width = c.n_head * D;
  m.n_embd = C;
  m.n_head = c.n_head;
  m.n_kv_head = c.n_kv_head;
  m.intermediate_size = c.intermediate_size;
  m.vocab_size = c.vocab_size;
  m.block_size = c.block_size;
  m.tie_embeddings = c.tie_embeddings;
  m.units = c.n_layer;
  // Sliced by the plan (src/models/llama.cpp shard_tensor_parallel): q/k/v/o and gate/up/down;
  // the norms, embedding and head stay whole.
  m.tensor_parallel_parameters = c.n_layer * (layer - 2 * C);
  m.tensor_parallel_block_parameters = layer;
  m.step_layout = ModelMath::StepLayout::kLlamaDecoder;
  return m;
}

ModelSpec llama_spec() {
  ModelSpec spec;
  spec.name = "llama";
  spec.description =
      "Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention "
      "(Hugging Face LlamaForCausalLM names)";
  spec.input = ModelInput::kTokens;
  spec.build = [](const Config& config, at::Generator& generator) -> std::shared_ptr<Model> {
    return std::make_shared<Llama>(resolve_llama_config(config), generator);
  };
  spec.vocab_size = [](const Config& config) { return llama_shape(config).vocab_size; };
  spec.math = [](const Config& config) { return llama_math(resolve_llama_config(config)); };
  spec.python_twin = "kiln_py.models";
  spec.load_hf = load_hf_llama;
  spec.save_hf = save_hf_llama;
  spec.tensor_parallel_problem = [](const Config& config, int64_t tp) {
    return llama_tensor_parallel_problem(llama_shape(config), tp);
  };
  return spec;
}

}  // namespace kiln
