#include "kiln/models.h"

#include <fmt/format.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "models/internal.h"
#include "models/split_forward.h"
#include "models/tensor_parallel.h"

namespace kiln {
namespace {

namespace nn = torch::nn;
namespace F = torch::nn::functional;

// ---- the seed MLP: input_dim -> hidden_dim -> ReLU -> num_classes -------------------------------

class Mlp final : public Model {
 public:
  Mlp(int64_t input_dim, int64_t hidden_dim, int64_t num_classes, bool data_dependent_branch,
      at::Generator& generator)
      : input_dim_(input_dim),
        hidden_dim_(hidden_dim),
        num_classes_(num_classes),
        data_dependent_branch_(data_dependent_branch) {
    fc1_ = register_module("fc1", nn::Linear(input_dim, hidden_dim));
    fc2_ = register_module("fc2", nn::Linear(hidden_dim, num_classes));
    torch::NoGradGuard no_grad;
    // PyTorch's nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
    for (auto* layer : {&fc1_, &fc2_}) {
      double bound = 1.0 / std::sqrt(static_cast<double>((*layer)->weight.size(1)));
      (*layer)->weight.uniform_(-bound, bound, generator);
      (*layer)->bias.uniform_(-bound, bound, generator);
    }
  }
  torch::Tensor forward(const torch::Tensor& inputs) override {
    auto hidden = run_unit(0, [this](const torch::Tensor& x) { return fc1_->forward(x); }, inputs);
    // The test model for graph breaks: a branch on the data (a host sync), as `if x.sum() > 0`.
    const bool negative = data_dependent_branch_ && !(inputs.sum().item<double>() > 0);
    hidden = negative ? torch::tanh(hidden) : torch::relu(hidden);
    return run_unit(1, [this](const torch::Tensor& x) { return fc2_->forward(x); }, hidden);
  }
  std::string architecture() const override { return "mlp"; }
  bool classifier() const override { return true; }
  nlohmann::json describe() const override {
    nlohmann::json out = {
        {"input_dim", input_dim_}, {"hidden_dim", hidden_dim_}, {"num_classes", num_classes_}};
    if (data_dependent_branch_) out["data_dependent_branch"] = true;
    return out;
  }
  double train_flops_per_sample(int64_t) const override {
    return 6.0 * static_cast<double>(parameter_count(*this));
  }
  std::vector<ModelUnit> units() const override {
    return {{"fc1", {"fc1.weight", "fc1.bias"}}, {"fc2", {"fc2.weight", "fc2.bias"}}};
  }

 private:
  int64_t input_dim_, hidden_dim_, num_classes_;
  bool data_dependent_branch_;
  nn::Linear fc1_{nullptr}, fc2_{nullptr};
};

// ---- GPT-2 (B = batch, T = time, C = channels, H = heads, V = vocabulary) ---------------------

// A linear layer on a [B, T, C] input through at::linear, as Python's nn.Linear runs it, not
// through nn::Linear::forward: the C++ frontend's F::linear computes a 3-D input as a matmul, then
// `+= bias`. Under autocast that adds the fp32 bias into the bf16 product through a promoted fp32
// temporary (gpt small bf16-mixed: 32 ms of a 378 ms step in aten::add_ and the temporary's
// fill under run.deterministic), and in fp32 it misses addmm's fused bias; at::linear flattens
// to one addmm, with autocast casting the bias with the weight.
torch::Tensor linear(const nn::Linear& layer, const torch::Tensor& x) {
  return torch::linear(x, layer->weight, layer->bias);
}

// A row-parallel layer's output under tensor parallelism: the ranks' partial products summed,
// then the (whole, replicated) bias added once, in the product's dtype (under autocast the
// bf16 product, as at::linear adds its cast bias without TP, not promoted to fp32).
torch::Tensor row_parallel(const nn::Linear& layer, const torch::Tensor& x, Communicator& tp) {
  const torch::Tensor sum = tensor_parallel::reduce_from_ranks(torch::linear(x, layer->weight), tp);
  return sum + layer->bias.to(sum.scalar_type());
}

using Placements = std::map<std::string, TensorParallelPlacement>;

class CausalSelfAttention final : public nn::Module {
 public:
  CausalSelfAttention(int64_t n_embd, int64_t n_head) : head_dim_(n_embd / n_head) {
    c_attn_ = register_module("c_attn", nn::Linear(n_embd, 3 * n_embd));
    c_proj_ = register_module("c_proj", nn::Linear(n_embd, n_embd));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1);
    const int64_t width = c_proj_->weight.size(1);  // C, or this rank's C / tp
    const torch::Tensor in = tp_ ? tensor_parallel::copy_to_ranks(x, *tp_) : x;
    auto qkv = linear(c_attn_, in).split(width, /*dim=*/2);  // 3 x [B, T, width]
    auto heads = [&](const torch::Tensor& t) {
      return t.view({B, T, width / head_dim_, head_dim_}).transpose(1, 2);  // [B, H, T, C/H]
    };
    auto y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]),
                                              /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                              /*is_causal=*/true);
    y = y.transpose(1, 2).contiguous().view({B, T, width});
    return tp_ ? row_parallel(c_proj_, y, *tp_) : linear(c_proj_, y);
  }
  nn::Linear c_proj() const { return c_proj_; }

  // Tensor parallelism: this rank's H/tp heads. c_attn stacks q, k and v on its output rows,
  // so its slice is the heads' rows of each (a fused placement of 3 blocks), column-parallel;
  // c_proj's matching input columns, row-parallel, its bias whole (added once, after the sum).
  void shard(std::shared_ptr<Communicator> tp, const std::string& prefix, Placements& placements) {
    placements[prefix + "c_attn.weight"] = tensor_parallel::shard(c_attn_->weight, 0, *tp, 3);
    placements[prefix + "c_attn.bias"] = tensor_parallel::shard(c_attn_->bias, 0, *tp, 3);
    placements[prefix + "c_proj.weight"] = tensor_parallel::shard(c_proj_->weight, 1, *tp);
    tp_ = std::move(tp);
  }

 private:
  int64_t head_dim_;
  nn::Linear c_attn_{nullptr}, c_proj_{nullptr};
  std::shared_ptr<Communicator> tp_;  // set by shard()
};

class Block final : public nn::Module {
 public:
  Block(int64_t n_embd, int64_t n_head) {
    ln_1_ = register_module("ln_1", nn::LayerNorm(nn::LayerNormOptions({n_embd})));
    attn_ = register_module("attn", std::make_shared<CausalSelfAttention>(n_embd, n_head));
    ln_2_ = register_module("ln_2", nn::LayerNorm(nn::LayerNormOptions({n_embd})));
    mlp_ = register_module("mlp", std::make_shared<nn::Module>());
    c_fc_ = mlp_->register_module("c_fc", nn::Linear(n_embd, 4 * n_embd));
    c_proj_ = mlp_->register_module("c_proj", nn::Linear(4 * n_embd, n_embd));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn_->forward(ln_1_->forward(x));
    torch::Tensor in = ln_2_->forward(x);
    if (tp_) in = tensor_parallel::copy_to_ranks(in, *tp_);
    auto h = torch::gelu(linear(c_fc_, in), "tanh");  // [B, T, 4C] (4C / tp)
    return x + (tp_ ? row_parallel(c_proj_, h, *tp_) : linear(c_proj_, h));
  }
  // Tensor parallelism: the attention's heads, and the MLP's c_fc columns (with their bias)
  // and c_proj's matching rows.
  void shard(const std::shared_ptr<Communicator>& tp, const std::string& prefix,
             Placements& placements) {
    attn_->shard(tp, prefix + "attn.", placements);
    placements[prefix + "mlp.c_fc.weight"] = tensor_parallel::shard(c_fc_->weight, 0, *tp);
    placements[prefix + "mlp.c_fc.bias"] = tensor_parallel::shard(c_fc_->bias, 0, *tp);
    placements[prefix + "mlp.c_proj.weight"] = tensor_parallel::shard(c_proj_->weight, 1, *tp);
    tp_ = tp;
  }
  // The two residual projections, whose init is scaled by 1/sqrt(2 * n_layer).
  std::vector<torch::Tensor> residual_projections() const {
    return {attn_->c_proj()->weight, c_proj_->weight};
  }

 private:
  nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<nn::Module> mlp_;
  nn::Linear c_fc_{nullptr}, c_proj_{nullptr};
  std::shared_ptr<Communicator> tp_;  // set by shard()
};

class Gpt final : public Model, public SplitForward {
 public:
  Gpt(const GptConfig& config, at::Generator& generator) : config_(config) {
    auto transformer = register_module("transformer", std::make_shared<nn::Module>());
    wte_ = transformer->register_module("wte", nn::Embedding(config.vocab_size, config.n_embd));
    wpe_ = transformer->register_module("wpe", nn::Embedding(config.block_size, config.n_embd));
    h_ = transformer->register_module("h", nn::ModuleList());
    for (int64_t layer = 0; layer < config.n_layer; ++layer) {
      auto block = std::make_shared<Block>(config.n_embd, config.n_head);
      h_->push_back(block);
      blocks_.push_back(block);
    }
    ln_f_ =
        transformer->register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({config.n_embd})));
    initialise(generator);
  }

  torch::Tensor forward(const torch::Tensor& idx) override {
    return after_units(through_units(before_units(idx)));
  }

  // SplitForward: the root around the blocks (compile.root compiles the two pieces).
  std::vector<std::string> before_units_parameters() const override {
    return {"transformer.wte.weight", "transformer.wpe.weight"};
  }
  std::vector<std::string> after_units_parameters() const override {
    return {"transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wte.weight"};
  }
  torch::Tensor before_units(const torch::Tensor& idx) override {
    const int64_t T = idx.size(1);
    if (T > config_.block_size) {
      throw UserError("sequence length " + std::to_string(T) + " exceeds model.block_size " +
                      std::to_string(config_.block_size));
    }
    auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    return wte_->forward(idx) + wpe_->forward(pos);  // [B, T, C]
  }
  torch::Tensor through_units(const torch::Tensor& hidden) override {
    torch::Tensor x = hidden;
    for (size_t i = 0; i < blocks_.size(); ++i) {
      x = run_unit(
          static_cast<int>(i),
          [block = blocks_[i].get()](const torch::Tensor& in) { return block->forward(in); }, x);
    }
    return x;
  }
  torch::Tensor after_units(const torch::Tensor& hidden) override {
    return F::linear(ln_f_->forward(hidden), wte_->weight);  // [B, T, V], head tied to wte
  }

  std::string architecture() const override { return "gpt"; }
  nlohmann::json describe() const override {
    return {{"n_layer", config_.n_layer},
            {"n_head", config_.n_head},
            {"n_embd", config_.n_embd},
            {"block_size", config_.block_size},
            {"vocab_size", config_.vocab_size},
            {"init_std", config_.init_std},
            {"tied_head", true},
            {"activation", "gelu_tanh"},
            {"norm", "pre-LayerNorm"}};
  }
  double train_flops_per_sample(int64_t seq_len) const override {
    return gpt_math(config_).train_flops_per_token(seq_len) * static_cast<double>(seq_len);
  }
  std::vector<ModelUnit> units() const override { return block_units("transformer.h", blocks_); }

  // The blocks split (heads, MLP width); the embeddings, the norms and the tied head stay whole
  // on every rank: the head's logits are computed whole, so the loss needs no
  // vocabulary-parallel cross-entropy, and the tied wte needs no split embedding lookup (the
  // cost: the [C, V] matmul on every rank).
  void shard_tensor_parallel(std::shared_ptr<Communicator> tp) override {
    if (!tensor_parallel_.empty()) throw std::logic_error("gpt: already tensor-parallel");
    if (std::string problem = gpt_tensor_parallel_problem(config_, tp->world_size());
        !problem.empty())
      throw UserError(problem);
    for (size_t i = 0; i < blocks_.size(); ++i)
      blocks_[i]->shard(tp, fmt::format("transformer.h.{}.", i), tensor_parallel_);
  }

 private:
  void initialise(at::Generator& generator) {
    torch::NoGradGuard no_grad;
    const double std = config_.init_std;
    for (auto& item : named_parameters()) {
      auto& p = item.value();
      if (p.dim() >= 2) {
        p.normal_(0.0, std, generator);
      } else if (item.key().find("ln_") != std::string::npos) {
        item.key().ends_with(".weight") ? p.fill_(1.0) : p.zero_();
      } else {
        p.zero_();  // biases
      }
    }
    const double residual_std = std / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
    for (auto& block : blocks_) {
      for (auto& w : block->residual_projections()) w.normal_(0.0, residual_std, generator);
    }
  }

  GptConfig config_;
  nn::Embedding wte_{nullptr}, wpe_{nullptr};
  nn::ModuleList h_{nullptr};
  nn::LayerNorm ln_f_{nullptr};
  std::vector<std::shared_ptr<Block>> blocks_;
};

}  // namespace

GptConfig gpt_preset(const std::string& name) {
  if (name == "small") return {6, 6, 384, 256, 256};
  if (name == "gpt2-124m") return {12, 12, 768, 1024, 50257};
  return {5, 4, 128, 256, 256};  // tiny; also the fallback for a preset the rules refuse
}

void Model::add_unit_wrapper(std::shared_ptr<UnitWrapper> wrapper) {
  unit_wrappers_.push_back(std::move(wrapper));
}

torch::Tensor Model::run_unit(int unit, const UnitForward& forward, const torch::Tensor& input) {
  if (unit_wrappers_.empty()) return forward(input);
  // Wrapper k gets the chain of wrappers k+1.. around `forward`: the first added is outermost.
  // Each link owns its inner chain by value, so a wrapper may keep its `forward` and call it
  // again after this returns (activation checkpointing recomputes in backward).
  UnitForward chain = forward;
  for (size_t k = unit_wrappers_.size() - 1; k > 0; --k) {
    chain = [wrapper = unit_wrappers_[k], unit, inner = std::move(chain)](const torch::Tensor& x) {
      return wrapper->run(unit, inner, x);
    };
  }
  return unit_wrappers_[0]->run(unit, chain, input);
}

torch::Tensor Model::loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

torch::Tensor Model::correct_predictions(const torch::Tensor& logits,
                                         const torch::Tensor& targets) const {
  if (!classifier()) return {};
  return logits.argmax(-1).eq(targets).sum();
}

GptConfig resolve_gpt_config(const Config& config) {
  const GptConfig out = gpt_shape(config);
  if (out.n_embd % out.n_head != 0) {
    throw UserError("model.n_embd = " + std::to_string(out.n_embd) +
                    " is not divisible by model.n_head = " + std::to_string(out.n_head) +
                    "; pick a head count that divides the width");
  }
  if (const int64_t seq_len = ModelBuildOptions::from_config(config).seq_len;
      seq_len > out.block_size) {
    throw UserError("data.seq_len = " + std::to_string(seq_len) +
                    " exceeds the model's block_size " + std::to_string(out.block_size) +
                    "; lower data.seq_len or raise model.block_size");
  }
  return out;
}

std::string gpt_tensor_parallel_problem(const GptConfig& g, int64_t tp) {
  if (g.n_head % tp != 0) {
    return fmt::format(
        "dist.tp = {} must divide the attention heads (model.n_head = {}; the MLP width 4 x "
        "model.n_embd follows): each rank computes whole heads; pick a tp that divides n_head",
        tp, g.n_head);
  }
  return "";
}

ModelMath gpt_math(const GptConfig& g) {
  const int64_t C = g.n_embd;
  // ln_1 2C, c_attn 3C^2 + 3C, attn.c_proj C^2 + C, ln_2 2C, c_fc 4C^2 + 4C, mlp.c_proj 4C^2 + C
  const int64_t block = 12 * C * C + 13 * C;
  const int64_t root = g.vocab_size * C + g.block_size * C + 2 * C;  // wte (the head), wpe, ln_f
  ModelMath m;
  m.parameters = root + g.n_layer * block;
  m.largest_unit_parameters = std::max(block, root);
  m.flop_parameters = m.parameters - g.block_size * C;  // the position embedding is a lookup
  m.n_layer = g.n_layer;
  m.attention_width = C;
  m.n_embd = C;
  m.n_head = g.n_head;
  m.n_kv_head = g.n_head;
  m.intermediate_size = 4 * C;
  m.vocab_size = g.vocab_size;
  m.block_size = g.block_size;
  m.tie_embeddings = true;
  m.units = g.n_layer;
  // Sliced by the plan (Gpt::shard_tensor_parallel): c_attn, attn.c_proj and the MLP's weights,
  // with c_attn's and c_fc's biases; the norms and the row-parallel biases (6C) stay whole.
  m.tensor_parallel_parameters = g.n_layer * (block - 6 * C);
  m.tensor_parallel_block_parameters = block;
  m.step_layout = ModelMath::StepLayout::kGptDecoder;
  return m;
}

ModelSpec mlp_spec() {
  ModelSpec spec;
  spec.name = "mlp";
  spec.description = "the seed MLP: input_dim -> hidden_dim -> ReLU -> num_classes";
  spec.input = ModelInput::kFeatures;
  spec.build = [](const Config& config, at::Generator& generator) -> std::shared_ptr<Model> {
    const MlpShape shape = MlpShape::from_config(config);
    return std::make_shared<Mlp>(shape.input_dim, shape.hidden_dim, shape.num_classes,
                                 shape.data_dependent_branch, generator);
  };
  spec.math = [](const Config& config) {
    const MlpShape shape = MlpShape::from_config(config);
    const int64_t d = shape.input_dim, h = shape.hidden_dim, k = shape.num_classes;
    ModelMath m;
    m.parameters = d * h + h + h * k + k;
    m.largest_unit_parameters = std::max(d * h + h, h * k + k);  // units fc1, fc2
    m.flop_parameters = m.parameters;
    m.input_dim = d;
    m.hidden_dim = h;
    m.num_classes = k;
    m.units = 2;
    m.step_layout = ModelMath::StepLayout::kMlp;
    return m;
  };
  spec.python_twin = "kiln_py.models";
  return spec;
}

ModelSpec gpt_spec() {
  ModelSpec spec;
  spec.name = "gpt";
  spec.description = "GPT-2-style decoder (Hugging Face GPT2LMHeadModel names)";
  spec.input = ModelInput::kTokens;
  spec.build = [](const Config& config, at::Generator& generator) -> std::shared_ptr<Model> {
    return std::make_shared<Gpt>(resolve_gpt_config(config), generator);
  };
  spec.vocab_size = [](const Config& config) { return gpt_shape(config).vocab_size; };
  spec.math = [](const Config& config) { return gpt_math(resolve_gpt_config(config)); };
  spec.python_twin = "kiln_py.models";
  spec.load_hf = load_hf_gpt2;
  spec.save_hf = save_hf_gpt2;
  spec.tensor_parallel_problem = [](const Config& config, int64_t tp) {
    return gpt_tensor_parallel_problem(gpt_shape(config), tp);
  };
  return spec;
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t total = 0;
  for (const auto& p : module.parameters()) total += p.numel();
  return total;
}

std::string weights_hash(const torch::nn::Module& module) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owner(XXH3_createState(),
                                                                 XXH3_freeState);
  XXH3_state_t* state = owner.get();
  XXH3_64bits_reset(state);
  auto feed = [&](const std::string& name, const torch::Tensor& tensor) {
    auto cpu = tensor.detach().to(torch::kCPU).contiguous();
    std::string header = name + "|" + std::string(c10::toString(cpu.scalar_type())) + "|";
    for (auto d : cpu.sizes()) header += std::to_string(d) + ",";
    XXH3_64bits_update(state, header.data(), header.size());
    XXH3_64bits_update(state, cpu.data_ptr(), cpu.nbytes());
  };
  for (const auto& item : module.named_parameters()) feed(item.key(), item.value());
  for (const auto& item : module.named_buffers()) feed(item.key(), item.value());
  return hex64(XXH3_64bits_digest(state));
}

nlohmann::json model_identity(const Model& model) {
  nlohmann::json out = {{"architecture", model.architecture()},
                        {"hyperparameters", model.describe()},
                        {"parameter_count", parameter_count(model)},
                        {"initial_weights_xxh3", weights_hash(model)}};
  if (!model.init_from.is_null()) out["init_from"] = model.init_from;
  return out;
}

}  // namespace kiln
