#include "kiln/models.h"

#include <gtest/gtest.h>

#include <set>

#include "kiln/error.h"
#include "support/helpers.h"

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

TEST(Gpt, InitialisationFollowsGpt2) {
  Config config = gpt_preset("small");
  auto model = make_model(config);
  GptConfig g = resolve_gpt_config(config);
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const auto& p = item.value();
    if (name.ends_with("c_proj.weight")) {
      EXPECT_NEAR(p.std().item<double>(), 0.02 / std::sqrt(2.0 * g.n_layer), 2e-3) << name;
    } else if (name.ends_with("c_attn.weight") || name.ends_with("wte.weight")) {
      EXPECT_NEAR(p.std().item<double>(), 0.02, 2e-3) << name;
    } else if (name.find("ln_") != std::string::npos && name.ends_with(".weight")) {
      EXPECT_TRUE(torch::all(p == 1).item<bool>()) << name;
    } else if (name.ends_with(".bias")) {
      EXPECT_TRUE(torch::all(p == 0).item<bool>()) << name;
    }
  }
  EXPECT_EQ(weights_hash(*model), weights_hash(*make_model(config)));  // seeded
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

}  // namespace
}  // namespace kiln::testing
