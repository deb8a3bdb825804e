#include "kiln/models.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <map>
#include <set>

#include "kiln/data.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/train.h"
#include "models/split_forward.h"
#include "support/compose.h"
#include "support/helpers.h"
#include "train/activation_checkpointing.h"
#include "train/precision.h"

namespace kiln::testing {
namespace {

Config gpt_preset(const std::string& preset) {
  return Config::parse("", "x", {"model.name=gpt", "data.name=text", "model.preset=" + preset});
}

TEST(Gpt, PresetShapesAndParameterCounts) {
  struct Expect {
    std::string preset;
    int64_t lo, hi;
  };
  for (const auto& e :
       {Expect{"tiny", 900'000, 1'200'000}, Expect{"small", 9'000'000, 12'000'000}}) {
    auto model = make_model(gpt_preset(e.preset));
    EXPECT_GE(parameter_count(*model), e.lo) << e.preset;
    EXPECT_LE(parameter_count(*model), e.hi) << e.preset;
  }
  // GPT-2 small: exactly Hugging Face's count with the tied head (124,439,808).
  GptConfig g = resolve_gpt_config(gpt_preset("gpt2-124m"));
  EXPECT_EQ(g.n_layer, 12);
  EXPECT_EQ(g.n_embd, 768);
  EXPECT_EQ(g.vocab_size, 50257);
  auto big = make_model(gpt_preset("gpt2-124m"));
  EXPECT_EQ(parameter_count(*big), 124'439'808);
}

TEST(Gpt, ParameterNamesFollowHuggingFaceGpt2) {
  auto model = make_model(gpt_preset("tiny"));
  std::set<std::string> names;
  for (const auto& item : model->named_parameters()) names.insert(item.key());
  for (auto name :
       {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
        "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_attn.bias", "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.ln_2.weight", "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.bias", "transformer.ln_f.weight", "transformer.ln_f.bias"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
  EXPECT_FALSE(names.count("lm_head.weight"));  // tied to wte
}

TEST(Gpt, LogitsShapeAndCausalMasking) {
  auto model = make_model(gpt_preset("tiny"));
  model->eval();
  torch::NoGradGuard no_grad;
  auto tokens = torch::randint(0, 256, {2, 16}, torch::kLong);
  auto logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 256}));
  auto changed = tokens.clone();
  changed.index_put_({torch::indexing::Slice(), 10},
                     (tokens.index({torch::indexing::Slice(), 10}) + 1) % 256);
  auto after = model->forward(changed);
  using torch::indexing::Slice;
  EXPECT_TRUE(
      torch::equal(logits.index({Slice(), Slice(0, 10)}), after.index({Slice(), Slice(0, 10)})));
  EXPECT_FALSE(
      torch::allclose(logits.index({Slice(), Slice(10)}), after.index({Slice(), Slice(10)})));
}

// Whether a tensor drawn i.i.d. from N(0, expected_std^2) could have the sample std it has. For n
// normal draws the sample std s has standard error sigma / sqrt(2 (n - 1)) (the delta method on
// Var(s^2) = 2 sigma^4 / (n - 1)), so |s - sigma| <= 6 of those errors: a correct init fails
// with probability about 2e-9 per tensor (the mean likewise, standard error sigma / sqrt(n)). At
// gpt `small`'s sizes (6 layers of 384; the smallest weights, wte and wpe, 256 x 384 = 98,304
// draws) 6 standard errors are at most 1.4% of sigma, so an init off by 5% (0.021 for 0.02) fails,
// as do 0.03 for 0.02 and a residual scale of 1/sqrt(n_layer) for 1/sqrt(2 n_layer) (+41%). The
// earlier absolute 2e-3 was +-35% of c_proj's 0.00577 and +-10% of 0.02.
::testing::AssertionResult std_within_sampling_error(const torch::Tensor& p, double expected_std) {
  const double n = static_cast<double>(p.numel());
  const double standard_error = expected_std / std::sqrt(2.0 * (n - 1.0));
  const double sample_std = p.std().item<double>();
  const double mean = p.mean().item<double>();  // the mean's standard error: sigma / sqrt(n)
  const double mean_error = expected_std / std::sqrt(n);
  if (std::abs(sample_std - expected_std) <= 6.0 * standard_error &&
      std::abs(mean) <= 6.0 * mean_error) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << fmt::format(
             "sample std {:.6g} (mean {:.3g}) over {} draws, expected std {:.6g} +- "
             "{:.3g} (6 standard errors), mean 0 +- {:.3g}",
             sample_std, mean, p.numel(), expected_std, 6.0 * standard_error, 6.0 * mean_error);
}

TEST(Gpt, InitialisationFollowsGpt2) {
  Config config = gpt_preset("small");
  auto model = make_model(config);
  GptConfig g = resolve_gpt_config(config);
  ASSERT_EQ(g.init_std, 0.02);
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(g.n_layer));
  int weights_checked = 0;
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const auto& p = item.value();
    if (p.dim() >= 2) {  // wte, wpe, c_attn, c_fc; both c_proj scaled by 1/sqrt(2 n_layer)
      EXPECT_TRUE(
          std_within_sampling_error(p, name.ends_with("c_proj.weight") ? residual_std : 0.02))
          << name;
      ++weights_checked;
    } else if (name.find("ln_") != std::string::npos && name.ends_with(".weight")) {
      EXPECT_TRUE(torch::all(p == 1).item<bool>()) << name;
    } else if (name.ends_with(".bias")) {
      EXPECT_TRUE(torch::all(p == 0).item<bool>()) << name;
    }
  }
  EXPECT_EQ(weights_checked, 2 + 4 * g.n_layer);
  EXPECT_EQ(weights_hash(*model), weights_hash(*make_model(config)));  // seeded
  // The check's resolution: an init 5% off (model.init_std = 0.021) is told apart from 0.02, in
  // the smallest weight (wpe) and in a residual projection.
  auto wrong = make_model(Config::parse(
      "", "x", {"model.name=gpt", "data.name=text", "model.preset=small", "model.init_std=0.021"}));
  const auto params = wrong->named_parameters();
  EXPECT_FALSE(std_within_sampling_error(params["transformer.wpe.weight"], 0.02));
  EXPECT_FALSE(
      std_within_sampling_error(params["transformer.h.0.attn.c_proj.weight"], residual_std));
}

TEST(Gpt, InitialLossIsNearUniform) {
  auto model = make_model(gpt_preset("tiny"));
  auto tokens = torch::randint(0, 256, {4, 32}, torch::kLong);
  auto targets = torch::randint(0, 256, {4, 32}, torch::kLong);  // not the inputs: the head is tied
  auto loss = model->loss(model->forward(tokens), targets).item<double>();
  EXPECT_NEAR(loss, std::log(256.0), 0.1);
}

TEST(Gpt, BadShapesAreUserErrors) {
  EXPECT_THROW(
      resolve_gpt_config(Config::parse(
          "", "x", {"model.name=gpt", "data.name=text", "model.n_embd=100", "model.n_head=3"})),
      UserError);
  EXPECT_THROW(resolve_gpt_config(Config::parse(
                   "", "x", {"model.name=gpt", "data.name=text", "data.seq_len=512"})),
               UserError);
}

// Records the order wrappers run in and passes through (or doubles) the unit's output.
class RecordingWrapper : public UnitWrapper {
 public:
  RecordingWrapper(std::string tag, std::vector<std::string>& log, double scale = 1.0)
      : tag_(std::move(tag)), log_(log), scale_(scale) {}
  torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) override {
    log_.push_back(tag_ + " in " + std::to_string(unit));
    auto out = forward(input) * scale_;
    log_.push_back(tag_ + " out " + std::to_string(unit));
    return out;
  }

 private:
  std::string tag_;
  std::vector<std::string>& log_;
  double scale_;
};

TEST(Units, PartitionTheParametersOutsideTheRootGroup) {
  auto gpt = make_model(gpt_preset("tiny"));
  auto units = gpt->units();
  ASSERT_EQ(units.size(), 5u);  // one per block
  std::set<std::string> names;
  for (const auto& item : gpt->named_parameters()) names.insert(item.key());
  std::set<std::string> in_units;
  for (const auto& unit : units) {
    EXPECT_EQ(unit.parameters.size(), 12u)
        << unit.name;  // ln_1, c_attn, c_proj, ln_2, c_fc, c_proj
    for (const auto& name : unit.parameters) {
      EXPECT_TRUE(names.count(name)) << name;
      EXPECT_TRUE(in_units.insert(name).second) << name << " in two units";
    }
  }
  EXPECT_EQ(units[0].name, "transformer.h.0");
  // The root group: embeddings and the final norm (the head is tied to wte).
  EXPECT_EQ(names.size() - in_units.size(), 4u);
  auto mlp = make_model(Config::parse("", "x", {"model.name=mlp"}));
  ASSERT_EQ(mlp->units().size(), 2u);
  EXPECT_EQ(mlp->units()[1].parameters, (std::vector<std::string>{"fc2.weight", "fc2.bias"}));
}

TEST(Units, WrappersNestInTheOrderAddedAndSeeEveryUnit) {
  torch::manual_seed(0);
  auto mlp = make_model(Config::parse("", "x", {"model.name=mlp"}));
  auto inputs = torch::randn({3, mlp->named_parameters()["fc1.weight"].size(1)});
  auto plain = mlp->forward(inputs);
  std::vector<std::string> log;
  mlp->add_unit_wrapper(std::make_shared<RecordingWrapper>("outer", log));
  mlp->add_unit_wrapper(std::make_shared<RecordingWrapper>("inner", log));
  auto wrapped = mlp->forward(inputs);
  EXPECT_TRUE(torch::equal(plain, wrapped));
  EXPECT_EQ(log,
            (std::vector<std::string>{"outer in 0", "inner in 0", "inner out 0", "outer out 0",
                                      "outer in 1", "inner in 1", "inner out 1", "outer out 1"}));
  // A wrapper's result is the unit's output: doubling the last layer doubles the logits.
  mlp->clear_unit_wrappers();
  log.clear();
  struct LastOnly : UnitWrapper {
    torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) override {
      return unit == 1 ? forward(input) * 2.0 : forward(input);
    }
  };
  mlp->add_unit_wrapper(std::make_shared<LastOnly>());
  EXPECT_TRUE(torch::allclose(mlp->forward(inputs), plain * 2.0));
  auto gpt = make_model(gpt_preset("tiny"));
  gpt->add_unit_wrapper(std::make_shared<RecordingWrapper>("w", log));
  gpt->forward(torch::zeros({1, 8}, torch::kLong));
  EXPECT_EQ(log.size(), 10u);  // in and out of each of the 5 blocks
  EXPECT_EQ(log.back(), "w out 4");
}

// ---- llama
// ---------------------------------------------------------------------------------------

Config llama(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"model.name=llama", "data.name=text"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return Config::parse("", "x", sets);
}

// One small shape for the tests that build: 2 layers, width 32, 4 query heads over 2 key/value.
const std::vector<std::string> kSmallLlama = {"model.n_layer=2",
                                              "model.n_embd=32",
                                              "model.n_head=4",
                                              "model.n_kv_head=2",
                                              "model.intermediate_size=48",
                                              "data.seq_len=16"};

TEST(Llama, PresetsCountAsTheModelMathSays) {
  // Built: tiny (~1M) and small (~19M); their analytic count is the built one, tied or not.
  for (const auto& [preset, lo, hi] :
       {std::tuple{"llama-tiny", 900'000, 1'100'000}, std::tuple{"tiny", 900'000, 1'100'000},
        std::tuple{"llama-small", 18'000'000, 21'000'000}}) {
    const Config config = llama({std::string("model.preset=") + preset});
    auto model = make_model(config);
    EXPECT_GE(parameter_count(*model), lo) << preset;
    EXPECT_LE(parameter_count(*model), hi) << preset;
    EXPECT_EQ(model_math(config).parameters, parameter_count(*model)) << preset;
  }
  const Config tied = llama({"model.tie_embeddings=true", "model.n_kv_head=4"});
  EXPECT_EQ(model_math(tied).parameters, parameter_count(*make_model(tied)));
  // Llama 3 8B: the published shape and count (8,030,261,248), never built.
  const Config big = llama(
      {"model.preset=llama3-8b", "data.name=tokens", "data.path=train.bin", "data.seq_len=8192"});
  const LlamaConfig l = resolve_llama_config(big);
  EXPECT_EQ(std::vector<int64_t>(
                {l.n_layer, l.n_embd, l.n_head, l.n_kv_head, l.intermediate_size, l.vocab_size}),
            std::vector<int64_t>({32, 4096, 32, 8, 14336, 128256}));
  EXPECT_EQ(l.rope_theta, 500000.0);
  const ModelMath m = model_math(big);
  EXPECT_EQ(m.parameters, 8'030'261'248);
  // 6N without the (untied) input embedding, + 12 L C T: torchtitan's count.
  EXPECT_EQ(m.train_flops_per_token(8192),
            6.0 * (8'030'261'248.0 - 128256.0 * 4096) + 12.0 * 32 * 4096 * 8192);
}

TEST(Llama, ParameterNamesFollowHuggingFaceLlamaForCausalLM) {
  auto model = make_model(llama(kSmallLlama));
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  std::vector<std::string> expected = {"model.embed_tokens.weight"};
  for (int i = 0; i < 2; ++i) {
    for (const char* leaf : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                             "input_layernorm", "post_attention_layernorm"}) {
      expected.push_back(fmt::format("model.layers.{}.{}.weight", i, leaf));
    }
  }
  expected.push_back("model.norm.weight");
  expected.push_back("lm_head.weight");
  EXPECT_EQ(names, expected);
  const auto params = model->named_parameters();
  EXPECT_EQ(params["model.layers.0.self_attn.k_proj.weight"].sizes(),
            (std::vector<int64_t>{16, 32}));  // 2 key/value heads of 8
  auto tied = make_model(llama({"model.tie_embeddings=true", "model.n_layer=1"}));
  EXPECT_FALSE(tied->named_parameters().contains("lm_head.weight"));
}

TEST(Llama, CausalLogitsAndNearUniformInitialLoss) {
  auto model = make_model(llama(kSmallLlama));
  model->eval();
  torch::NoGradGuard no_grad;
  auto tokens = torch::randint(0, 256, {2, 16}, torch::kLong);
  auto logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 256}));
  auto changed = tokens.clone();
  using torch::indexing::Slice;
  changed.index_put_({Slice(), 10}, (tokens.index({Slice(), 10}) + 1) % 256);
  auto after = model->forward(changed);
  EXPECT_TRUE(
      torch::equal(logits.index({Slice(), Slice(0, 10)}), after.index({Slice(), Slice(0, 10)})));
  EXPECT_FALSE(
      torch::allclose(logits.index({Slice(), Slice(10)}), after.index({Slice(), Slice(10)})));
  // Rotary positions: without them causal attention is blind to the order of the earlier tokens;
  // with them, swapping two earlier tokens changes the last position's logits.
  auto order = model->forward(torch::tensor({{5, 9, 7}}, torch::kLong));
  auto swapped = model->forward(torch::tensor({{9, 5, 7}}, torch::kLong));
  EXPECT_FALSE(torch::allclose(order.index({0, 2}), swapped.index({0, 2})));
  auto targets = torch::randint(0, 256, {2, 16}, torch::kLong);
  EXPECT_NEAR(model->loss(logits, targets).item<double>(), std::log(256.0), 0.1);
}

TEST(Llama, UnitsAreTheDecoderLayers) {
  auto model = make_model(llama(kSmallLlama));
  const auto units = model->units();
  ASSERT_EQ(units.size(), 2u);
  EXPECT_EQ(units[1].name, "model.layers.1");
  EXPECT_EQ(units[1].parameters.size(), 9u);
  std::vector<std::string> log;  // every layer runs through the wrappers
  model->add_unit_wrapper(std::make_shared<RecordingWrapper>("w", log));
  model->forward(torch::zeros({1, 4}, torch::kLong));
  EXPECT_EQ(log, (std::vector<std::string>{"w in 0", "w out 0", "w in 1", "w out 1"}));
  model->clear_unit_wrappers();
  std::set<std::string> in_units;
  for (const auto& unit : units) in_units.insert(unit.parameters.begin(), unit.parameters.end());
  std::set<std::string> root;
  for (const auto& item : model->named_parameters()) {
    if (!in_units.count(item.key())) root.insert(item.key());
  }
  EXPECT_EQ(root, (std::set<std::string>{"model.embed_tokens.weight", "model.norm.weight",
                                         "lm_head.weight"}));
  EXPECT_EQ(model_math(llama(kSmallLlama)).largest_unit_parameters,
            2 * 256 * 32 + 32);  // the root group: embedding, head, final norm
  // FLOPs per sample: 6N (N without the input embedding) + 12 L C T, per token, times T.
  const double n = static_cast<double>(parameter_count(*model) - 256 * 32);
  EXPECT_DOUBLE_EQ(model->train_flops_per_sample(16), 16.0 * (6.0 * n + 12.0 * 2 * 32 * 16));
}

TEST(Llama, ActivationCheckpointingRecomputesTheLayersBitwise) {
  TempDir dir;
  std::vector<std::vector<double>> losses;
  for (const char* mode : {"none", "block"}) {
    std::vector<std::string> sets = kSmallLlama;
    sets.push_back(fmt::format("train.activation_checkpointing={}", mode));
    sets.insert(sets.end(), {"model.name=llama", "model.preset=tiny", "model.block_size=0",
                             "model.vocab_size=0", "train.batch_size=4", "data.num_workers=0"});
    Config config = gpt_config(dir.path(), sets);
    apply_runtime_settings(config);
    Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
    install_configured_checkpointing(trainer);
    EXPECT_EQ(trainer.model().has_unit_wrappers(), std::string(mode) == "block");
    losses.emplace_back();
    for (int k = 0; k < 3; ++k) losses.back().push_back(trainer.train_step().loss);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_LT(losses[0].back(), losses[0].front());
}

// compile.root's split (src/models/split_forward.h), eager: before_units (the token embedding)
// -> through_units (the layers, the rotary tables built from the hidden's length) -> after_units
// (final norm, head) is forward() with model.loss, bitwise, also under activation checkpointing
// (a layer recomputed in backward, after through_units returned, with the tables it captured);
// and each piece reads exactly the parameters it names, which are what a compiled piece is given
// by name (the Python twin's pieces hold the same names: tests/python, RootPieces).
TEST(Llama, TheSplitForwardIsForwardAndEachPieceReadsTheParametersItNames) {
  using Grads = std::map<std::string, torch::Tensor>;
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied head" : "untied head");
    std::vector<std::string> sets = kSmallLlama;
    if (tied) sets.push_back("model.tie_embeddings=true");
    auto model = make_model(llama(sets));
    SplitForward* split = split_forward_of(*model);
    ASSERT_NE(split, nullptr);
    const std::string head = tied ? "model.embed_tokens.weight" : "lm_head.weight";
    EXPECT_EQ(split->before_units_parameters(),
              (std::vector<std::string>{"model.embed_tokens.weight"}));
    EXPECT_EQ(split->after_units_parameters(),
              (std::vector<std::string>{"model.norm.weight", head}));
    // The loss of `loss_of` and the gradients it leaves, by parameter (undefined: not read).
    auto run = [&](const std::function<torch::Tensor()>& loss_of) {
      for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
      const torch::Tensor loss = loss_of();
      loss.backward();
      Grads grads;
      for (const auto& item : model->named_parameters()) {
        if (item.value().grad().defined()) grads[item.key()] = item.value().grad().clone();
      }
      return std::pair{loss.item<double>(), grads};
    };
    torch::manual_seed(5);
    // 12 positions of the model's 256: the rotary tables follow the input, not the block size.
    const torch::Tensor idx = torch::randint(0, 256, {2, 12}, torch::kLong);
    const torch::Tensor targets = torch::randint(0, 256, {2, 12}, torch::kLong);
    const auto whole = run([&] { return model->loss(model->forward(idx), targets); });
    ASSERT_EQ(whole.second.size(), model->named_parameters().size());
    model->add_unit_wrapper(make_activation_checkpointing(*model, model->units()));
    const auto pieces = run([&] {
      torch::Tensor hidden = split->through_units(split->before_units(idx));
      return model->loss(split->after_units(hidden), targets);
    });
    model->clear_unit_wrappers();
    EXPECT_EQ(pieces.first, whole.first);
    ASSERT_EQ(pieces.second.size(), whole.second.size());
    for (const auto& [name, grad] : whole.second) {
      EXPECT_TRUE(torch::equal(pieces.second.at(name), grad)) << name;
    }
    // Each piece alone: gradients land on the parameters it names and on no other.
    auto read_by = [](const Grads& grads) {
      std::vector<std::string> names;
      for (const auto& [name, grad] : grads) {
        if (grad.abs().sum().item<double>() > 0) names.push_back(name);
      }
      return std::set<std::string>(names.begin(), names.end());
    };
    auto named = [](const std::vector<std::string>& names) {
      return std::set<std::string>(names.begin(), names.end());
    };
    const auto before = run([&] { return split->before_units(idx).square().sum(); });
    EXPECT_EQ(read_by(before.second), named(split->before_units_parameters()));
    const torch::Tensor hidden = torch::randn({2, 12, 32});
    const auto after = run([&] { return model->loss(split->after_units(hidden), targets); });
    EXPECT_EQ(read_by(after.second), named(split->after_units_parameters()));
  }
}

TEST(Llama, BadShapesAreRefusedByTheConfigRules) {
  auto refused = [](const std::vector<std::string>& sets) {
    try {
      llama(sets).validate();
      return std::string("accepted");
    } catch (const UserError& e) {
      return std::string(e.what());
    }
  };
  EXPECT_THAT(refused({"model.n_head=3"}), ::testing::HasSubstr("even head size"));
  EXPECT_THAT(refused({"model.n_embd=96", "model.n_head=16"}),  // head size 6: even
              ::testing::HasSubstr("accepted"));
  EXPECT_THAT(refused({"model.n_embd=36", "model.n_head=4", "model.n_kv_head=4"}),
              ::testing::HasSubstr("even head size"));  // head size 9: rotary needs pairs
  EXPECT_THAT(refused({"model.n_kv_head=3"}),
              ::testing::HasSubstr("model.n_head = 4 is not a multiple of model.n_kv_head = 3"));
  EXPECT_THAT(refused({"model.preset=gpt2-124m"}), ::testing::HasSubstr("is a gpt preset"));
  EXPECT_THAT(refused({"data.seq_len=512"}), ::testing::HasSubstr("block_size 256"));
  EXPECT_THAT(refused({"model.vocab_size=100"}), ::testing::HasSubstr("256 byte values"));
  EXPECT_THROW(resolve_llama_config(llama({"model.n_kv_head=3"})), UserError);
}

// ---- the registry ------------------------------------------------------------------------------

// A user's model, registered the way examples/ and docs/models.md show: a linear map over
// synthetic features, built from the mlp's keys.
class UserLinear final : public Model {
 public:
  UserLinear(int64_t in, int64_t out) { fc_ = register_module("fc", torch::nn::Linear(in, out)); }
  torch::Tensor forward(const torch::Tensor& x) override { return fc_->forward(x); }
  std::string architecture() const override { return "test-linear"; }
  nlohmann::json describe() const override { return {{"kind", "linear"}}; }
  double train_flops_per_sample(int64_t) const override {
    return 6.0 * static_cast<double>(parameter_count(*this));
  }

 private:
  torch::nn::Linear fc_{nullptr};
};

TEST(Registry, BuiltinsAndAUserModelComeFromTheSameRegistry) {
  const auto names = registered_models();
  for (const char* builtin : {"gpt", "llama", "mlp"}) {
    EXPECT_TRUE(std::find(names.begin(), names.end(), builtin) != names.end()) << builtin;
  }
  EXPECT_EQ(find_model("llama")->input, ModelInput::kTokens);
  EXPECT_EQ(find_model("mlp")->input, ModelInput::kFeatures);
  EXPECT_EQ(find_model("gpt")->python_twin, "kiln_py.models");
  EXPECT_EQ(find_model("nonexistent"), nullptr);

  ModelSpec spec;
  spec.name = "test-linear";
  spec.input = ModelInput::kFeatures;
  spec.build = [](const Config& config, at::Generator&) -> std::shared_ptr<Model> {
    return std::make_shared<UserLinear>(config.get_int("model.input_dim"),
                                        config.get_int("model.num_classes"));
  };
  if (!find_model("test-linear")) register_model(spec);       // once per process (gtest repeats)
  EXPECT_THROW(register_model(spec), std::invalid_argument);  // a name is registered once
  ModelSpec nameless = spec;
  nameless.name = "";
  EXPECT_THROW(register_model(nameless), std::invalid_argument);

  Config config = Config::parse("", "x", {"model.name=test-linear", "model.input_dim=6"});
  EXPECT_NO_THROW(config.validate());
  auto model = make_model(config);
  EXPECT_EQ(model->architecture(), "test-linear");
  EXPECT_EQ(parameter_count(*model), 6 * 10 + 10);
  EXPECT_FALSE(model_takes_tokens(config));
  EXPECT_THROW(model_math(config), UserError);  // no ModelSpec::math: not plannable
  EXPECT_TRUE(model_takes_tokens(llama()));
  EXPECT_EQ(model_vocab_size(llama({"model.vocab_size=300"})), 300);
  EXPECT_EQ(model_vocab_size(Config::defaults()), 0);  // the mlp

  // An unknown name: one line listing the registered models.
  try {
    Config::parse("", "x", {"model.name=lama"}).validate();
    FAIL() << "accepted";
  } catch (const UserError& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "x: model.name = \"lama\" is not a registered model; the registered ones: exported, gpt, "
        "llama, mlp, test-linear (a C++ model registers with kiln::register_model, "
        "docs/models.md)");
  }
  EXPECT_THROW(make_model(Config::parse("", "x", {"model.name=lama"})), UserError);
}

// ---- model.init_from takes the shape from config.json ------------------------------------------

TEST(InitFrom, TheShapeComesFromConfigJsonAndAnExplicitKeyMustAgree) {
  TempDir dir;
  for (const std::string name : {"gpt", "llama"}) {
    SCOPED_TRACE(name);
    // A 2-layer model of a width no preset has, exported to Hugging Face's layout.
    std::vector<std::string> shape = {"model.name=" + name, "data.name=text", "model.n_layer=2",
                                      "model.n_embd=32",    "model.n_head=4", "data.seq_len=16"};
    if (name == "llama") shape.push_back("model.intermediate_size=48");
    auto source = make_model(Config::parse("", "x", shape));
    const auto hf = dir / name;
    save_hf(*source, hf, /*force=*/false);
    // Only the architecture and the directory: the shape is config.json's.
    Config config = Config::parse(
        "", "x", {"model.name=" + name, "data.name=text", "model.init_from=" + hf.string()});
    EXPECT_NO_THROW(config.validate());
    auto loaded = make_model(config);
    EXPECT_EQ(loaded->describe()["n_layer"], 2);
    EXPECT_EQ(weights_hash(*loaded), weights_hash(*source));
    EXPECT_EQ(model_math(config).parameters, parameter_count(*source));
    // A shape key set to another value: one line naming both.
    try {
      Config::parse("", "x",
                    {"model.name=" + name, "data.name=text", "model.init_from=" + hf.string(),
                     "model.n_layer=5"})
          .validate();
      FAIL() << "accepted";
    } catch (const UserError& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(" = 2 but model.n_layer = 5 is set"));
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
    // The other architecture's model.name: named, with the fix.
    const std::string other = name == "gpt" ? "llama" : "gpt";
    try {
      Config::parse("", "x",
                    {"model.name=" + other, "data.name=text", "model.init_from=" + hf.string()})
          .validate();
      FAIL() << "accepted";
    } catch (const UserError& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("set model.name = \"" + name + "\""));
    }
  }
  // The mlp exports nothing to Hugging Face.
  auto mlp = make_model(Config::defaults());
  EXPECT_THROW(save_hf(*mlp, dir / "mlp", false), UserError);
}

}  // namespace
}  // namespace kiln::testing
