// plan.json through PlanResult (kiln/results.h): make_plan's result as the plan rung writes it,
// read back field for field, the parts laid out as src/plan's own serializers lay them out, an
// older file still read, and the keys docs/plan.md documents ("Outputs") held to the file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "kiln/config.h"
#include "kiln/pilot.h"
#include "kiln/plan.h"
#include "kiln/results.h"
#include "kiln/run.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using nlohmann::json;

// gpt-tiny: a job under a day (the recommendation says no reservation is needed).
Config tiny_job(const TempDir& dir) {
  Config config = Config::load(source_dir() / "configs" / "gpt-tiny.toml");
  config.set_from_string("run.dir=" + (dir / "runs").string());
  return config;
}

// gpt-6.7b on two priced rows: reservation prices and costs, a recommendation with a cost.
Config priced_job(const TempDir& dir) {
  Config config = Config::load(source_dir() / "configs" / "gpt-6.7b.toml");
  for (const char* o : {"plan.hardware=h100-sxm, mi300x", "plan.tokens=2e9",
                        "plan.price_7d_per_gpu_hour={ h100-sxm = 3.0, mi300x = 2.0 }",
                        "plan.price_30d_per_gpu_hour={ h100-sxm = 2.0, mi300x = 1.5 }"})
    config.set_from_string(o);
  config.set_from_string("run.dir=" + (dir / "runs").string());
  return config;
}

std::set<std::string> keys_of(const json& object) {
  std::set<std::string> out;
  for (const auto& [key, value] : object.items()) out.insert(key);
  return out;
}

// Every key path of a written plan: "model.parameters", "rows[].strategy.reason".
void key_paths(const json& j, const std::string& prefix, std::set<std::string>& out) {
  if (j.is_object()) {
    for (const auto& [key, value] : j.items()) {
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      out.insert(path);
      key_paths(value, path, out);
    }
  } else if (j.is_array()) {
    for (const auto& item : j) key_paths(item, prefix + "[]", out);
  }
}

// docs/plan.md's two key tables under "## Outputs": each documented key (the first cell's
// backticked names; the row table's under "rows[].") and the names its description backticks.
std::map<std::string, std::set<std::string>> documented_keys() {
  std::istringstream doc(slurp(source_dir() / "docs" / "plan.md"));
  std::map<std::string, std::set<std::string>> out;
  const std::regex name("`([a-z0-9_]+)[^`]*`");
  bool outputs = false;
  std::string prefix;
  std::string line;
  while (std::getline(doc, line)) {
    if (line.starts_with("## ")) outputs = line == "## Outputs";
    if (!outputs) continue;
    if (line.starts_with("Each row of `rows`")) prefix = "rows[].";
    if (!line.starts_with("| `")) continue;
    const size_t split = line.find(" | ", 2);
    const std::string keys = line.substr(2, split - 2), what = line.substr(split + 3);
    std::set<std::string> described;
    for (std::sregex_iterator m(what.begin(), what.end(), name), end; m != end; ++m)
      described.insert((*m)[1].str());
    for (std::sregex_iterator m(keys.begin(), keys.end(), name), end; m != end; ++m)
      out[prefix + (*m)[1].str()] = described;
  }
  return out;
}

TEST(PlanResult, WrittenByThePlanRungAndReadBackFieldForField) {
  TempDir dir;
  for (const Config& config : {tiny_job(dir), priced_job(dir)}) {
    const PlanResult made = make_plan(config, nullptr, /*require_cost=*/false);
    run_plan(config);
    const auto file = run_directory(config) / "plan.json";
    // The rung's file is the struct, written once through the results writer.
    const json on_disk = json::parse(slurp(file));
    EXPECT_EQ(on_disk, json::parse(json(made).dump()));
    EXPECT_EQ(on_disk["schema_version"], kResultSchemaVersion);
    // Read back: every field the writer writes, equal (a non-finite number is null both ways).
    const PlanResult read = read_result<PlanResult>(file);
    EXPECT_EQ(json(read), on_disk);
    EXPECT_EQ(read.status.passed, made.status.passed);
    EXPECT_EQ(read.status.verdict, made.status.verdict);
    EXPECT_EQ(read.job_hash, job_hash(config));
    EXPECT_EQ(read.largest_unit_parameters, made.largest_unit_parameters);
    EXPECT_EQ(read.evals, made.evals);
    EXPECT_EQ(read.memory_per_device.estimate.peak_at, made.memory_per_device.estimate.peak_at);
    EXPECT_EQ(read.memory_per_device.activation_calibration, 1.0);  // no pilot
    EXPECT_EQ(read.assumed_write_bytes_per_second, made.assumed_write_bytes_per_second);
    EXPECT_FALSE(read.pilot_write_bytes_per_second.has_value());
    EXPECT_EQ(read.warnings, made.warnings);
    ASSERT_EQ(read.rows.size(), made.rows.size());
    for (size_t k = 0; k < read.rows.size(); ++k) {
      const PlanRow &r = read.rows[k], &m = made.rows[k];
      EXPECT_EQ(r.strategy_text(), m.strategy_text());
      EXPECT_EQ(r.strategy_communication_seconds, m.strategy_communication_seconds);
      EXPECT_EQ(r.host.host_memory_bytes, m.host.host_memory_bytes);
      EXPECT_EQ(r.host.staging_bytes_per_node, m.host.staging_bytes_per_node);
      EXPECT_EQ(r.save_stall_source, m.save_stall_source);
      EXPECT_EQ(r.recovery_source, m.recovery_source);
      EXPECT_EQ(r.wall_seconds, m.wall_seconds);
      EXPECT_EQ(r.reservation_7d.price_per_gpu_hour, m.reservation_7d.price_per_gpu_hour);
      EXPECT_EQ(r.reservation_30d.cost, m.reservation_30d.cost);
    }
    ASSERT_TRUE(read.recommendation.has_value());
    EXPECT_EQ(read.recommendation->hardware, made.recommendation->hardware);
    EXPECT_EQ(read.recommendation->cost, made.recommendation->cost);
    EXPECT_EQ(read.recommendation->reservation_needed, made.recommendation->reservation_needed);
    EXPECT_EQ(plan_markdown(read), plan_markdown(made));

    // The parts src/plan's own serializers lay out, under the same keys: the memory estimate
    // whole, the strategy decision's and the host needs' keys.
    EXPECT_EQ(on_disk["memory_per_device"]["estimate"],
              to_json(estimate_memory(model_shape(config), job_shape(config))));
    EXPECT_EQ(keys_of(on_disk["rows"][0]["strategy"]), keys_of(to_json(StrategyDecision{})));
    EXPECT_EQ(keys_of(on_disk["rows"][0]["host"]), keys_of(to_json(HostNeeds{})));
  }
}

// The two plans between them hold every key docs/plan.md documents, and every key they write is
// documented (in the key column, or named in its parent's description).
TEST(PlanResult, TheFileHasTheKeysDocsPlanMdDocuments) {
  TempDir dir;
  std::set<std::string> written;
  for (const Config& config : {tiny_job(dir), priced_job(dir)})
    key_paths(json(make_plan(config, nullptr, false)), "", written);
  EXPECT_TRUE(written.count("recommendation.reservation_needed"));         // the tiny job's
  EXPECT_TRUE(written.count("rows[].reservation_7d.price_per_gpu_hour"));  // the priced one's
  const auto documented = documented_keys();
  ASSERT_GT(documented.size(), 40u);
  for (const auto& [key, described] : documented)
    EXPECT_TRUE(written.count(key)) << key << ": documented in docs/plan.md, not written";
  for (const std::string& path : written) {
    if (documented.count(path)) continue;
    // The nearest documented parent names it in its description.
    std::string parent = path.substr(0, path.rfind('.'));
    while (!documented.count(parent) && parent.find('.') != std::string::npos)
      parent = parent.substr(0, parent.rfind('.'));
    const std::string leaf = path.substr(path.rfind('.') + 1);
    EXPECT_TRUE(documented.count(parent) && documented.at(parent).count(leaf))
        << path << ": written, not in docs/plan.md's key tables";
  }
}

// A plan.json written before a key was added (the keys the report did not read then, added
// without a schema version) reads with that key at its default; a key the reader always read is
// still required.
TEST(PlanResult, AnOlderPlanWithoutTheAddedKeysStillReads) {
  TempDir dir;
  json older = json(make_plan(priced_job(dir), nullptr, false));
  for (const char* key : {"job_hash", "warnings", "memory_per_device"}) older.erase(key);
  older["model"].erase("largest_unit_parameters");
  older["job"].erase("evals");
  older["checkpoint"].erase("assumed_write_bytes_per_second");
  for (auto& row : older["rows"]) {
    for (const char* key : {"host", "save_stall_source", "full_save_seconds", "wall_seconds",
                            "peak_flops_source", "recovery_source"})
      row.erase(key);
    row["strategy"].erase("tp_degree");
    row["strategy"].erase("communication_seconds");
  }
  const PlanResult read = older.get<PlanResult>();
  ASSERT_EQ(read.rows.size(), 2u);
  EXPECT_EQ(read.rows[0].tp_degree, 1);
  EXPECT_EQ(read.rows[0].host.staging_bytes_per_node, 0);
  EXPECT_TRUE(read.rows[0].host.host_fits);
  EXPECT_FALSE(read.rows[0].wall_seconds.has_value());
  EXPECT_TRUE(read.rows[0].wall_days.has_value());
  EXPECT_EQ(read.memory_per_device.activation_calibration, 1.0);
  EXPECT_TRUE(read.warnings.empty());
  EXPECT_THAT(plan_markdown(read), ::testing::HasSubstr("| mi300x | yes |"));
  older["rows"][0].erase("step_seconds");
  try {
    older.get<PlanResult>();
    FAIL() << "read without rows[0].step_seconds";
  } catch (const ResultFormatError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("rows[0].step_seconds is missing"));
  }
}

}  // namespace
}  // namespace kiln::testing
