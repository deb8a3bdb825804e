#include "kiln/config.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kiln/error.h"
#include "support/helpers.h"

namespace kiln {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  try {
    Config::parse(toml, "cfg.toml", overrides);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Config, DefaultsCoverEverySchemaKey) {
  Config c = Config::defaults();
  for (const auto& def : schema()) EXPECT_NO_THROW(c.get(def.full_name())) << def.full_name();
  EXPECT_EQ(c.get_string("optim.name"), "adamw");
  EXPECT_EQ(c.get_int("model.input_dim"), 100);
  EXPECT_EQ(c.get_int("model.hidden_dim"), 256);
  EXPECT_EQ(c.get_int("model.num_classes"), 10);
}

TEST(Config, SchemaKeysHaveDocsAndValidDefaults) {
  for (const auto& def : schema()) {
    EXPECT_FALSE(def.doc.empty()) << def.full_name();
    EXPECT_EQ(def.default_value.index(), static_cast<size_t>(def.type)) << def.full_name();
  }
}

TEST(Config, ParsesValuesAndConvertsIntegersToFloats) {
  Config c = Config::parse("[optim]\nlr = 1\nname = \"sgd\"\n[train]\nsteps = 7\n", "x.toml");
  EXPECT_DOUBLE_EQ(c.get_float("optim.lr"), 1.0);
  EXPECT_EQ(c.get_string("optim.name"), "sgd");
  EXPECT_EQ(c.get_int("train.steps"), 7);
}

TEST(Config, UnknownKeySuggestsTheClosest) {
  std::string e = error_of("[optim]\nlrr = 0.1\n");
  EXPECT_THAT(e, HasSubstr("cfg.toml:2"));
  EXPECT_THAT(e, HasSubstr("unknown key optim.lrr"));
  EXPECT_THAT(e, HasSubstr("did you mean optim.lr?"));
}

TEST(Config, KeyInTheWrongSectionSuggestsTheRightOne) {
  EXPECT_THAT(error_of("[train]\nlr = 0.1\n"), HasSubstr("did you mean optim.lr?"));
}

TEST(Config, UnknownSectionSuggestsTheClosest) {
  EXPECT_THAT(error_of("[optimm]\nlr = 0.1\n"),
              HasSubstr("unknown section [optimm] (did you mean [optim]?)"));
}

TEST(Config, WrongTypeNamesFileLineKeyAndExpectation) {
  std::string e = error_of("[train]\n\nsteps = \"many\"\n");
  EXPECT_THAT(e, HasSubstr("cfg.toml:3"));
  EXPECT_THAT(e, HasSubstr("train.steps"));
  EXPECT_THAT(e, HasSubstr("expected an integer"));
}

TEST(Config, OutOfRangeNamesTheRange) {
  std::string e = error_of("[optim]\nlr = -1.0\n");
  EXPECT_THAT(e, HasSubstr("cfg.toml:2"));
  EXPECT_THAT(e, HasSubstr("optim.lr = -1.0 is out of range"));
  EXPECT_THAT(e, HasSubstr("[0, inf]"));
}

TEST(Config, BadChoiceListsTheChoices) {
  EXPECT_THAT(error_of("[optim]\nname = \"adam\"\n"),
              HasSubstr("expected one of \"adamw\", \"sgd\""));
}

TEST(Config, SyntaxErrorNamesTheLine) {
  EXPECT_THAT(error_of("[train]\nsteps = = 3\n"), HasSubstr("cfg.toml:2: TOML syntax error"));
}

TEST(Config, MissingFileSaysWhich) {
  try {
    Config::load("/nonexistent/kiln.toml");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("/nonexistent/kiln.toml does not exist"));
  }
}

TEST(Config, OverridesAreTypedAndValidated) {
  Config c = Config::parse("", "x",
                           {"optim.lr=3e-4", "train.steps=12", "run.deterministic=false",
                            "run.name=\"abc\"", "optim.name=sgd"});
  EXPECT_DOUBLE_EQ(c.get_float("optim.lr"), 3e-4);
  EXPECT_EQ(c.get_int("train.steps"), 12);
  EXPECT_FALSE(c.get_bool("run.deterministic"));
  EXPECT_EQ(c.get_string("run.name"), "abc");
  EXPECT_THAT(error_of("", {"train.steps=abc"}), HasSubstr("'abc' is not an integer"));
  EXPECT_THAT(error_of("", {"train.stepz=3"}), HasSubstr("did you mean train.steps?"));
  EXPECT_THAT(error_of("", {"train.steps"}), HasSubstr("expected section.key=value"));
  EXPECT_THAT(error_of("", {"train.steps=0"}), HasSubstr("out of range"));
}

TEST(Config, OverridesWinOverTheFile) {
  Config c = Config::parse("[train]\nsteps = 5\n", "x", {"train.steps=9"});
  EXPECT_EQ(c.get_int("train.steps"), 9);
}

TEST(Config, ResolvedTomlRoundTripsWithTheSameHash) {
  Config a = Config::parse("[optim]\nlr = 0.0123\n[data]\nname = \"synthetic\"\n", "x");
  Config b = Config::parse(a.to_toml(true), "y");
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_DOUBLE_EQ(b.get_float("optim.lr"), 0.0123);
  EXPECT_NE(a.hash(), Config::defaults().hash());
}

TEST(Config, RejectsInconsistentCombinations) {
  EXPECT_THAT(error_of("[model]\nname = \"gpt\"\n"), HasSubstr("needs token data"));
  EXPECT_THAT(error_of("[data]\nname = \"text\"\n"), HasSubstr("model.name = \"mlp\" trains on"));
  EXPECT_THAT(error_of("[model]\nname = \"gpt\"\n[data]\nname = \"tokens\"\n"),
              HasSubstr("data.path"));
}

// Checks that need a preset's shape run in validate() too, so `kiln config validate` rejects
// what training would reject, and before any run directory exists.
TEST(Config, RejectsShapesTheModelCannotBuild) {
  const std::string gpt = "[model]\nname = \"gpt\"\npreset = \"tiny\"\n[data]\nname = \"text\"\n";
  EXPECT_EQ(error_of(gpt), "");
  EXPECT_THAT(error_of(gpt, {"model.n_head=3"}),
              HasSubstr("cfg.toml: model.n_embd = 128 is not divisible"));
  EXPECT_THAT(error_of(gpt, {"data.seq_len=512"}), HasSubstr("exceeds the model's block_size"));
  EXPECT_THAT(error_of(gpt, {"model.vocab_size=100"}),
              HasSubstr("smaller than the 256 byte values"));
  EXPECT_THAT(error_of("[optim]\nname = \"sgd\"\nnesterov = true\n"),
              HasSubstr("optim.nesterov = true needs optim.momentum > 0"));
  EXPECT_EQ(error_of("[optim]\nname = \"sgd\"\nnesterov = true\nmomentum = 0.9\n"), "");
}

TEST(Config, NonFiniteAndHexNumbersAreRejected) {
  EXPECT_THAT(error_of("", {"optim.lr=inf"}), HasSubstr("out of range"));
  EXPECT_THAT(error_of("", {"optim.weight_decay=nan"}), HasSubstr("out of range"));
  EXPECT_THAT(error_of("[optim]\nlr = inf\n"), HasSubstr("out of range"));
  EXPECT_THAT(error_of("", {"optim.lr=0x10"}), HasSubstr("'0x10' is not a float"));
  EXPECT_EQ(error_of("", {"optim.lr=1e-3"}), "");
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// docs/config.md carries the generated key table (`kiln config keys`); keep it complete.
TEST(ConfigDocs, EveryKeyIsDocumented) {
  std::string docs = testing::slurp(testing::source_dir() / "docs/config.md");
  for (const auto& def : schema()) {
    EXPECT_NE(docs.find(fmt::format("`{}`", def.full_name())), std::string::npos)
        << def.full_name()
        << " is missing from docs/config.md; regenerate its table with `kiln config keys`";
  }
}

}  // namespace
}  // namespace kiln
