// The cross-key rules each component declares with its config section: every rule's example is
// refused by Config::validate() with that rule's message alone, and by both `kiln config validate`
// and `kiln train` before anything is written. Also the schema's enum and table machinery, and
// toml_quote.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <algorithm>
#include <map>

#include "core/schema_sections.h"
#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "support/helpers.h"

namespace kiln {
namespace {

using ::testing::HasSubstr;

struct NamedRule {
  std::string section;
  const ConfigRule* rule;
};

std::vector<NamedRule> every_rule() {
  std::vector<NamedRule> out;
  for (const auto& section : config_sections()) {
    for (const auto& rule : section.rules) out.push_back({section.name, &rule});
  }
  return out;
}

Config defaults_with(const std::vector<std::string>& assignments) {
  Config config = Config::defaults();
  for (const auto& a : assignments) config.set_from_string(a);
  return config;
}

TEST(ConfigRules, TheSectionsDeclareTheKnownRules) {
  // The rules that used to live in Config::validate(), check_model_keys() and the constructors
  // `kiln train` runs, now declared next to their components.
  std::map<std::string, int> per_section;
  for (const auto& [section, rule] : every_rule()) ++per_section[section];
  EXPECT_EQ(per_section["model"],
            10);  // + registered name, llama heads, preset, init_from, package, tp plan
  EXPECT_EQ(per_section["data"], 7);  // + a registered dataset name (kiln/dataset_registry.h)
  EXPECT_EQ(per_section["optim"], 2);
  EXPECT_EQ(per_section["train"], 1);    // stop_after_step within train.steps
  EXPECT_EQ(per_section["dist"], 3);     // nccl needs cuda; dp_replicate needs fsdp; tp needs eager
  EXPECT_EQ(per_section["compile"], 9);  // probe_seq_lens + the step matrix's eight
}

// The production step's matrix: compile.backend x train.precision x
// train.activation_checkpointing x parallelism x train.grad_accum_steps, on a CPU and on a CUDA
// device. Every cell either passes validate() or is refused by a rule; the expected refusals are
// written out here, independently of the rules: "inductor" compiles per unit when checkpointing
// or FSDP is on (compile.granularity = "auto"), so it takes every cell; "inductor+cudagraphs"
// compiles the whole step (one graph has no activation checkpointing), no captured step runs
// under FSDP, CUDA graphs need a CUDA device and capture the fp32 step without checkpointing.
// (`kiln train` refuses what validate refuses: ValidateAndTrainRefuseEveryExampleWritingNothing;
// a sample of the accepted cells trains in tests/compile/compiled_step_test.cpp and
// compiled_units_test.cpp.)
TEST(ConfigRules, TheProductionStepMatrixIsDecidedByRules) {
  int accepted = 0, refused = 0;
  for (const std::string device : {"cpu", "cuda"}) {
    for (const std::string backend : {"eager", "inductor", "cudagraphs", "inductor+cudagraphs"}) {
      for (const std::string precision : {"fp32", "bf16-mixed", "fp16-mixed"}) {
        for (const std::string checkpointing : {"none", "block"}) {
          for (const std::string strategy : {"single", "ddp", "fsdp"}) {
            for (const int accumulation : {1, 2}) {
              const bool inductor = backend == "inductor" || backend == "inductor+cudagraphs";
              const bool captured = backend == "cudagraphs" || backend == "inductor+cudagraphs";
              std::vector<std::string> why;  // the lines any of which may refuse the cell
              if (inductor && captured && checkpointing == "block")
                why.push_back("cannot recompute a block's activations");
              if (captured && strategy == "fsdp")
                why.push_back("FSDP gathers each unit's parameters around its forward");
              if (captured && device == "cpu") why.push_back("needs a CUDA device");
              if (captured && precision != "fp32")
                why.push_back("not verified under mixed precision");
              if (backend == "cudagraphs" && checkpointing == "block")
                why.push_back("a CUDA graph capture cannot read");
              const std::vector<std::string> cell = {
                  "run.device=" + device, "compile.backend=" + backend,
                  "train.precision=" + precision, "train.activation_checkpointing=" + checkpointing,
                  // single: a world of one, whatever dist.strategy says ("auto" here)
                  "dist.strategy=" + std::string(strategy == "single" ? "auto" : strategy),
                  "train.grad_accum_steps=" + std::to_string(accumulation)};
              std::string trace;
              for (const auto& a : cell) trace += a + " ";
              SCOPED_TRACE(trace);
              Config config = defaults_with(cell);
              std::string problem;
              try {
                config.validate();
              } catch (const UserError& e) {
                problem = e.what();
              }
              if (why.empty()) {
                EXPECT_EQ(problem, "");
                ++accepted;
                continue;
              }
              ++refused;
              EXPECT_TRUE(std::any_of(
                  why.begin(), why.end(),
                  [&](const std::string& w) { return problem.find(w) != std::string::npos; }))
                  << "refused with: " << problem;
              EXPECT_EQ(problem.find('\n'), std::string::npos) << problem;
            }
          }
        }
      }
    }
  }
  // eager and inductor: 36 cells per device each; cudagraphs and inductor+cudagraphs on CUDA:
  // fp32, no checkpointing, single/ddp, 1/2 = 4 each.
  EXPECT_EQ(accepted, 2 * (36 + 36) + 4 + 4);
  EXPECT_EQ(accepted + refused, 2 * 144);
}

TEST(ConfigRules, EachExampleBreaksItsRuleAndNoOther) {
  const auto rules = every_rule();
  ASSERT_FALSE(rules.empty());
  for (const auto& [section, rule] : rules) {
    SCOPED_TRACE("[" + section + "] " + rule->description);
    Config config = defaults_with(rule->example);
    const std::string problem = rule->check(config);
    ASSERT_FALSE(problem.empty()) << "the example does not break its rule";
    for (const auto& [other_section, other] : rules) {
      if (other == rule) continue;
      EXPECT_EQ(other->check(config), "") << "the example also breaks: " << other->description;
    }
    try {
      config.validate();
      ADD_FAILURE() << "validate() accepted the example";
    } catch (const UserError& e) {
      EXPECT_EQ(std::string(e.what()), "<defaults>: " + problem);
    }
    // The message names a key of the config.
    EXPECT_TRUE(std::any_of(schema().begin(), schema().end(), [&](const KeyDef& def) {
      return problem.find(def.full_name()) != std::string::npos;
    })) << problem;
  }
  EXPECT_NO_THROW(Config::defaults().validate());
}

// `kiln config validate` rejects every config that `kiln train` would reject, before anything is
// written: both refuse each rule's example with exit 2 and one line, and leave no run directory.
TEST(ConfigRules, ValidateAndTrainRefuseEveryExampleWritingNothing) {
  for (const auto& [section, rule] : every_rule()) {
    SCOPED_TRACE("[" + section + "] " + rule->description);
    testing::TempDir dir;
    Config config = defaults_with(rule->example);
    const auto run_dir = dir / "runs";
    config.set("run.dir", run_dir.string());
    config.set("run.progress", std::string("off"));
    const auto file = dir / "example.toml";
    testing::write_text(file, config.to_toml(true));
    const std::string problem = rule->check(config);
    for (const std::string command : {"config validate", "train"}) {
      auto r = testing::run_kiln(command + " " + file.string());
      EXPECT_EQ(r.exit_code, 2) << command << ": " << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << command << ": " << r.err;
      EXPECT_THAT(r.err, HasSubstr(file.string() + ": " + problem)) << command;
      EXPECT_FALSE(std::filesystem::exists(run_dir)) << command << " wrote " << run_dir;
      size_t entries = 0;
      for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path()))
        ++entries;
      EXPECT_EQ(entries, 1u) << command << " wrote into " << dir.path();
    }
  }
}

// ---- enums --------------------------------------------------------------------------------------

enum class NonFinite { kAbort, kSkip };

TEST(ConfigEnum, ReadsAChoiceAsAnEnum) {
  Config config = Config::parse("[train]\nnonfinite = \"skip\"\n", "x");
  EXPECT_EQ(config.get_enum<NonFinite>("train.nonfinite",
                                       {{"abort", NonFinite::kAbort}, {"skip", NonFinite::kSkip}}),
            NonFinite::kSkip);
  EXPECT_EQ(Config::defaults().get_enum<NonFinite>(
                "train.nonfinite", {{"abort", NonFinite::kAbort}, {"skip", NonFinite::kSkip}}),
            NonFinite::kAbort);
}

TEST(ConfigEnum, AMappingThatDisagreesWithTheChoicesFailsWhateverTheValue) {
  const Config config = Config::defaults();  // train.nonfinite = "abort", a mapped choice
  try {                                      // a choice without an enumerator
    config.get_enum<NonFinite>("train.nonfinite", {{"abort", NonFinite::kAbort}});
    FAIL();
  } catch (const std::logic_error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("choice \"skip\" has no enumerator"));
  }
  try {  // an enumerator naming no choice
    config.get_enum<NonFinite>(
        "train.nonfinite",
        {{"abort", NonFinite::kAbort}, {"skip", NonFinite::kSkip}, {"retry", NonFinite::kSkip}});
    FAIL();
  } catch (const std::logic_error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("enumerator \"retry\" names no choice"));
  }
  EXPECT_THROW(config.get_enum<NonFinite>("train.steps", {{"abort", NonFinite::kAbort}}),
               std::logic_error);  // not a key with choices
}

// ---- tables of per-name values ------------------------------------------------------------------

std::shared_ptr<const ConfigSections> cost_schema() {
  ConfigSection cost{
      "cost",
      {table_key("cost", "gpu_prices", 0.0, 1000.0, {}, "price per GPU-hour by GPU name"),
       table_key("cost", "regions", 0.0, 1.0, {"eu", "us"}, "share by region"),
       float_key("cost", "budget", 10.0, 0.0, kUnbounded, "budget")},
      {{"budget covers one hour of every GPU",
        [](const Config& c) -> std::string {
          double total = 0;
          for (const auto& [name, price] : c.get_table("cost.gpu_prices")) total += price;
          return total > c.get_float("cost.budget") ? "cost.gpu_prices sum to more than cost.budget"
                                                    : "";
        },
        {"cost.gpu_prices.h100=20"}}}};
  return std::make_shared<const ConfigSections>(ConfigSections{cost});
}

std::string cost_error(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  try {
    Config::parse(toml, "cost.toml", overrides, cost_schema());
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(ConfigTable, ParsesInlineAndSubTables) {
  Config a =
      Config::parse("[cost]\ngpu_prices = { h100 = 2.5, a100 = 1 }\n", "x", {}, cost_schema());
  EXPECT_EQ(a.get_table("cost.gpu_prices"), (NumberTable{{"a100", 1.0}, {"h100", 2.5}}));
  Config b = Config::parse("[cost.gpu_prices]\nh100 = 2.5\na100 = 1.0\n", "x", {}, cost_schema());
  EXPECT_EQ(b.get_table("cost.gpu_prices"), a.get_table("cost.gpu_prices"));
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_TRUE(Config::defaults(cost_schema()).get_table("cost.gpu_prices").empty());
}

TEST(ConfigTable, ChecksTypesRangesAndNames) {
  std::string e = cost_error("[cost]\n\ngpu_prices = 3\n");
  EXPECT_THAT(e, HasSubstr("cost.toml:3: cost.gpu_prices has a integer; expected a table of "
                           "name = float with values in [0, 1000]"));
  e = cost_error("[cost]\ngpu_prices = { h100 = \"cheap\" }\n");
  EXPECT_THAT(e, HasSubstr("cost.toml:2: cost.gpu_prices.h100 has a string; expected a float"));
  e = cost_error("[cost]\ngpu_prices = { h100 = -1 }\n");
  EXPECT_THAT(e, HasSubstr("cost.gpu_prices.h100 = -1.0 is out of range; expected a float in "
                           "[0, 1000]"));
  EXPECT_THAT(cost_error("[cost]\ngpu_prices = { h100 = nan }\n"), HasSubstr("out of range"));
  EXPECT_THAT(
      cost_error("[cost]\nregions = { asia = 0.5 }\n"),
      HasSubstr("cost.regions.asia: unknown name \"asia\"; expected one of \"eu\", \"us\""));
  EXPECT_EQ(cost_error("[cost]\nregions = { eu = 0.5 }\n"), "");
  // The rules of a test-defined section run too.
  EXPECT_THAT(cost_error("", {"cost.gpu_prices.h100=20"}),
              HasSubstr("cost.toml: cost.gpu_prices sum to more than cost.budget"));
}

TEST(ConfigTable, OverridesSetOneNameOrTheWholeTable) {
  Config c = Config::parse("[cost]\ngpu_prices = { h100 = 2.5 }\n", "x",
                           {"cost.gpu_prices.a100=1.5", "cost.gpu_prices.h100=3"}, cost_schema());
  EXPECT_EQ(c.get_table("cost.gpu_prices"), (NumberTable{{"a100", 1.5}, {"h100", 3.0}}));
  c.set_from_string("cost.gpu_prices={ l4 = 0.5 }");
  EXPECT_EQ(c.get_table("cost.gpu_prices"), (NumberTable{{"l4", 0.5}}));
  c.set_from_string("cost.gpu_prices={}");
  EXPECT_TRUE(c.get_table("cost.gpu_prices").empty());
  EXPECT_THAT(cost_error("", {"cost.gpu_prices.h100=abc"}), HasSubstr("'abc' is not a float"));
  EXPECT_THAT(cost_error("", {"cost.gpu_prices.h100=2000"}), HasSubstr("out of range"));
  EXPECT_THAT(cost_error("", {"cost.gpu_prices=3"}), HasSubstr("'3' is not a table"));
  EXPECT_THAT(cost_error("", {"cost.regions.asia=0.1"}), HasSubstr("unknown name \"asia\""));
  EXPECT_THAT(cost_error("", {"cost.budgets.x=1"}), HasSubstr("unknown key cost.budgets.x"));
}

TEST(ConfigTable, ShowsRoundTripsHashesAndDocuments) {
  Config c = Config::parse("", "x", {"cost.gpu_prices.h100=2.5", "cost.gpu_prices.a100=1.8"},
                           cost_schema());
  const std::string shown = c.to_toml(true);
  EXPECT_THAT(shown, HasSubstr("gpu_prices = { a100 = 1.8, h100 = 2.5 }"));
  EXPECT_THAT(shown, HasSubstr("regions = {}"));
  EXPECT_THAT(shown, HasSubstr("# price per GPU-hour by GPU name"));
  Config back = Config::parse(shown, "y", {}, cost_schema());
  EXPECT_EQ(back.get_table("cost.gpu_prices"), c.get_table("cost.gpu_prices"));
  EXPECT_EQ(back.hash(), c.hash());
  EXPECT_NE(Config::parse("", "x", {"cost.gpu_prices.h100=2.6", "cost.gpu_prices.a100=1.8"},
                          cost_schema())
                .hash(),
            c.hash());
  // A name that is not a bare TOML key is quoted, and still round-trips.
  Config odd =
      Config::parse("[cost]\ngpu_prices = { \"rtx 4090\" = 0.4 }\n", "x", {}, cost_schema());
  EXPECT_THAT(odd.to_toml(false), HasSubstr("gpu_prices = { \"rtx 4090\" = 0.4 }"));
  EXPECT_EQ(Config::parse(odd.to_toml(false), "y", {}, cost_schema()).hash(), odd.hash());
  const std::string table = keys_markdown(*cost_schema());
  EXPECT_THAT(table, HasSubstr("| `cost.gpu_prices` | table of name = float | `{}` | [0, 1000] | "
                               "price per GPU-hour by GPU name |"));
  EXPECT_THAT(table, HasSubstr("| `cost.regions` | table of name = float | `{}` | names eu, us; "
                               "values [0, 1] |"));
}

// ---- toml_quote ---------------------------------------------------------------------------------

TEST(TomlQuote, AwkwardStringsRoundTripThroughTomlPlusPlus) {
  std::vector<std::string> cases = {"",
                                    "plain",
                                    "quote \" and backslash \\",
                                    "C:\\path\\",
                                    "tab\tnew\nline\r",
                                    "caf\xc3\xa9 \xe2\x9c\x93",
                                    std::string("nul\0byte", 8),
                                    "del\x7f",
                                    "\x1b[31mred\x1b[0m",
                                    "\\u0041 is not an escape here",
                                    "'single' \"\"\" triple"};
  std::string every_ascii;
  for (int c = 0; c < 128; ++c) every_ascii += static_cast<char>(c);
  cases.push_back(every_ascii);
  for (const auto& text : cases) {
    const std::string quoted = toml_quote(text);
    toml::table root;
    try {
      root = toml::parse("v = " + quoted);
    } catch (const toml::parse_error& e) {
      ADD_FAILURE() << quoted << ": " << e.description();
      continue;
    }
    auto value = root["v"].value<std::string>();
    ASSERT_TRUE(value.has_value()) << quoted;
    EXPECT_EQ(*value, text) << quoted;
  }
  EXPECT_EQ(toml_quote("a\x7f"), "\"a\\u007F\"");
  EXPECT_EQ(toml_quote(std::string(1, '\0')), "\"\\u0000\"");
}

}  // namespace
}  // namespace kiln

namespace kiln::testing {
namespace {

TEST(Strings, DurationsReadAtEveryScale) {
  EXPECT_EQ(format_duration(0.0016), "1.6ms");  // a planned step on many GPUs
  EXPECT_EQ(format_duration(0.045), "45ms");
  EXPECT_EQ(format_duration(0.26), "0.3s");
  EXPECT_EQ(format_duration(12.34), "12.3s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(3720), "1h02m");
  EXPECT_EQ(format_duration(-1), "?");
}

}  // namespace
}  // namespace kiln::testing
