#include "kiln/config.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>
#include <sstream>

#include "core/schema_sections.h"
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

// The keys of the generated table in docs/config.md ("| `section.key` | ...").
std::set<std::string> documented_keys(const std::string& docs) {
  std::set<std::string> out;
  static const std::regex row(R"(^\| `([a-z0-9_]+\.[a-z0-9_]+)` \|)");
  std::istringstream in(docs);
  std::smatch m;
  for (std::string line; std::getline(in, line);) {
    if (std::regex_search(line, m, row)) out.insert(m[1].str());
  }
  return out;
}

// Every schema key has its default, is in docs/config.md's table (and the table names no other
// key), and is read by its full name somewhere in src/ outside the schema files: a key declared
// but never read, or documented but gone, fails here.
TEST(Config, DefaultsCoverEverySchemaKey) {
  Config c = Config::defaults();
  for (const auto& def : schema()) EXPECT_NO_THROW(c.get(def.full_name())) << def.full_name();
  EXPECT_EQ(c.get_string("optim.name"), "adamw");
  EXPECT_EQ(c.get_int("model.input_dim"), 100);
  EXPECT_EQ(c.get_int("model.hidden_dim"), 256);
  EXPECT_EQ(c.get_int("model.num_classes"), 10);

  std::set<std::string> keys;
  for (const auto& def : schema()) keys.insert(def.full_name());
  const auto documented = documented_keys(testing::slurp(testing::source_dir() / "docs/config.md"));
  for (const auto& key : documented) {
    EXPECT_TRUE(keys.count(key)) << key << " is in docs/config.md but not in the schema; "
                                 << "regenerate the table with scripts/update-config-docs";
  }
  for (const auto& key : keys) EXPECT_TRUE(documented.count(key)) << key << " is undocumented";

  std::string sources;
  for (const auto& entry :
       std::filesystem::recursive_directory_iterator(testing::source_dir() / "src")) {
    const auto name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == "schema.cpp") continue;
    if (name.ends_with(".cpp") || name.ends_with(".h")) sources += testing::slurp(entry.path());
  }
  ASSERT_GT(sources.size(), 100000u) << "the scan of src/ found too little";
  for (const auto& key : keys) {
    EXPECT_TRUE(sources.find("\"" + key + "\"") != std::string::npos)
        << key << " is declared in the schema but never read in src/";
  }
}

// A schema with the mistakes schema_problems() must catch, one per key.
ConfigSections broken_schema() {
  ConfigSection s{
      "s",
      {int_key("s", "low", 0, 1, 10, "default below its range"),
       float_key("s", "high", 2.0, 0.0, 1.0, "default above its range"),
       string_key("s", "pick", "c", {"a", "b"}, "default not a choice"),
       bool_key("s", "undocumented", true, ""), int_key("s", "low", 1, 1, 10, "declared twice"),
       int_key("other", "stray", 1, 1, 10, "in the wrong section")},
      {{"a rule without an example", [](const Config&) { return std::string(); }, {}}}};
  KeyDef typed = int_key("s", "typed", 1, 0, 10, "default of the wrong type");
  typed.default_value = std::string("1");
  s.keys.push_back(typed);
  return {s};
}

TEST(Config, SchemaKeysHaveDocsAndValidDefaults) {
  for (const auto& def : schema()) {
    EXPECT_FALSE(def.doc.empty()) << def.full_name();
    EXPECT_EQ(def.default_value.index(), static_cast<size_t>(def.type)) << def.full_name();
  }
  // Each default within its range and choices, every rule complete, no duplicates.
  for (const auto& problem : schema_problems(config_sections())) ADD_FAILURE() << problem;
  // The same check sees each kind of mistake.
  const auto problems = schema_problems(broken_schema());
  auto has = [&](const std::string& text) {
    return std::any_of(problems.begin(), problems.end(),
                       [&](const std::string& p) { return p.find(text) != std::string::npos; });
  };
  EXPECT_TRUE(has("default s.low = 0 is out of range; expected an integer in [1, 10]"));
  EXPECT_TRUE(has("default s.high = 2.0 is out of range"));
  EXPECT_TRUE(has("default s.pick = \"c\" is not allowed"));
  EXPECT_TRUE(has("s.undocumented has no doc"));
  EXPECT_TRUE(has("s.low is declared twice"));
  EXPECT_TRUE(has("other.stray is declared in section [s]"));
  EXPECT_TRUE(has("s.typed: the default is not an integer"));
  EXPECT_TRUE(has("lacks a description, a check or an example: a rule without an example"));
  EXPECT_EQ(problems.size(), 8u);
  EXPECT_THROW(Config::defaults(std::make_shared<const ConfigSections>(broken_schema())),
               std::logic_error);
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
  // Nesterov momentum is SGD's: with adamw it used to pass here and fail in `kiln train`.
  EXPECT_THAT(error_of("[optim]\nnesterov = true\n"),
              HasSubstr("cfg.toml: optim.nesterov = true needs optim.name = \"sgd\""));
  EXPECT_THAT(error_of("[optim]\nnesterov = true\nmomentum = 0.9\n"),
              HasSubstr("needs optim.name = \"sgd\""));
  // Checks `kiln train` made only after start-up, now rules.
  EXPECT_THAT(error_of("[data]\nval_samples = 8\n"),
              HasSubstr("data.val_samples = 8 is fewer than one batch (train.batch_size = 32)"));
  EXPECT_THAT(error_of("[dist]\nbackend = \"nccl\"\n[run]\ndevice = \"cpu\"\n"),
              HasSubstr("dist.backend = \"nccl\" needs CUDA"));
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
  // The tables are generated: exactly what `kiln config keys` prints.
  EXPECT_NE(docs.find(keys_markdown()), std::string::npos)
      << "docs/config.md's key table is stale; run scripts/update-config-docs";
  EXPECT_NE(docs.find(rules_markdown()), std::string::npos)
      << "docs/config.md's rule table is stale; run scripts/update-config-docs";
}

}  // namespace
}  // namespace kiln
