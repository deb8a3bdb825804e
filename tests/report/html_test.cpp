// report.html and the typed rung results (kiln/results.h): every rung file read through its
// struct, a renamed or missing key refused loudly (and shown as such on the page), old and
// stopped files, the scorecard, the sections' charts, and two runs side by side. (Headless
// Chromium reads the rendered pages of a real ladder in browser_test.py.)
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <tuple>

#include "ckpt/thread_comm.h"
#include "kiln/error.h"
#include "kiln/pilot.h"
#include "kiln/report.h"
#include "kiln/results.h"
#include "kiln/rungs.h"
#include "support/helpers.h"

namespace kiln {
namespace {

using nlohmann::json;
using testing::TempDir;

// pilot.json as the pilot writes it (src/rungs/pilot.cpp): a real CPU pilot's file, verdict cut.
const char* kPilotJson = R"({
  "checkpoint": {"bytes": 445536.0, "save_seconds": 0.025551781,
                 "write_bytes_per_second": 17436592.776057374},
  "config_hash": "278c7f14208e6c92", "device": "cpu", "device_name": "cpu",
  "eval_seconds": 0.000758408, "flops_per_step": 28999680.0, "job_hash": "d5079afb9c129453",
  "loss": 5.500183582305908,
  "memory": {
    "activation_ratio": 1.0002793156350054,
    "estimate": {"activations_bytes": 566272.0, "backward_extra_bytes": 163840.0,
                 "gradients_bytes": 142848.0, "gradients_held_across_micro_batches": false,
                 "logits_bytes": 393216.0, "optimizer_bytes": 285696.0,
                 "parameters_bytes": 142848.0, "step_peak_bytes": 1388032.0,
                 "total_bytes": 1530880.0},
    "estimate_step_peak_bytes": 1388032.0,
    "measured": {"activations_and_logits_bytes": 959756.0, "gradients_bytes": 142848.0,
                 "optimizer_bytes": 285696.0, "parameters_bytes": 142848.0,
                 "peak_bytes": 1388300.0, "process_peak_rss_bytes": 135839744.0,
                 "reserved_bytes": null, "step_peak_above_state_bytes": 959756},
    "measured_over_estimate": 1.0001930791220952,
    "method": "peak of live tensor bytes over the measured step",
    "within_allowed_error": true},
  "mfu": null, "passed": true, "peak_flops_per_second": null,
  "restore": {"differing_tensors": [], "exit_status": 0, "loss_bitwise_equal": true,
              "loss_equal": true, "loss_here": 5.438819408416748,
              "loss_restored": 5.438819408416748, "passed": true, "seconds": 2.486412572,
              "step": 2, "tolerance": 0.0, "world_size": 1},
  "shape": {"grad_accum_steps": 1, "micro_batch": 4, "precision": "fp32", "seq_len": 32},
  "step_seconds": 0.467323103, "steps": 2, "val_loss": 5.453566074371338,
  "verdict": "full cycle at the production shape: 2 steps, eval, save, restore", "wall_seconds": 7.219444047,
  "world_size": 1
})";

size_t occurrences(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = 0; (at = text.find(part, at)) != std::string::npos; at += part.size()) ++n;
  return n;
}

// The scorecard row of a rung (one <tr>).
// The Chart.js configuration of chart `id` as the page carries it (the JSON beside its canvas).
json chart_config(const std::string& html, const std::string& id) {
  const std::string open = "class=\"chart-config\" data-chart=\"" + id + "\">";
  const size_t begin = html.find(open);
  if (begin == std::string::npos) return nullptr;
  const size_t start = begin + open.size();
  return json::parse(html.substr(start, html.find("</script>", start) - start));
}

std::string scorecard_row(const std::string& html, const std::string& rung) {
  const size_t begin = html.find("data-rung=\"" + rung + "\"");
  if (begin == std::string::npos) return "";
  return html.substr(begin, html.find("</tr>", begin) - begin);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ResultFormatError& e) {
    return e.what();
  }
  return "";
}

TEST(Results, EveryKeyReadAndWrittenBackUnderItsName) {
  const json file = json::parse(kPilotJson);
  const PilotResult pilot = file.get<PilotResult>();
  EXPECT_TRUE(pilot.status.passed);
  EXPECT_TRUE(pilot.status.measured);
  EXPECT_EQ(pilot.status.schema_version, 1);  // no schema_version: today's files
  EXPECT_EQ(pilot.measured.step_peak, 1388300.0);
  EXPECT_EQ(pilot.estimated.activations_and_logits, 566272.0 + 393216.0);
  EXPECT_EQ(pilot.job_hash, "d5079afb9c129453");
  EXPECT_FALSE(pilot.mfu.has_value());
  EXPECT_EQ(pilot.restore.step, 2);
  // to_json writes the rung's own keys: each value it writes is the file's, at the same path.
  const json written = pilot;
  EXPECT_EQ(written["schema_version"], kResultSchemaVersion);
  for (const char* path : {"/memory/measured/peak_bytes", "/restore/loss_bitwise_equal",
                           "/checkpoint/save_seconds", "/shape/seq_len", "/job_hash"}) {
    EXPECT_EQ(written[json::json_pointer(path)], file[json::json_pointer(path)]) << path;
  }
  EXPECT_EQ(written.get<PilotResult>().measured.step_peak, pilot.measured.step_peak);
  EXPECT_EQ(json(written.get<PilotResult>()), written);  // a round trip is exact
}

TEST(Results, ARenamedKeyInAWrittenRungFileFailsLoudly) {
  TempDir dir;
  // plan.json as `kiln plan` writes it (no model is built: milliseconds).
  run_plan(testing::gpt_config(dir / "runs", {"plan.hardware=h100-sxm,mi300x"}));
  const auto run = dir / "runs" / "t";
  json plan = json::parse(testing::slurp(run / "plan.json"));
  EXPECT_EQ(read_result<PlanResult>(run / "plan.json").rows.size(), 2u);

  // A key renamed as a rung might rename it: the reader names the file, the key path, the
  // schema version and the command that regenerates the file.
  plan["rows"][1]["strategy"]["fsdp_shards"] = plan["rows"][1]["strategy"]["fsdp_degree"];
  plan["rows"][1]["strategy"].erase("fsdp_degree");
  testing::write_text(run / "plan.json", plan.dump());
  const std::string error = error_of([&] { read_result<PlanResult>(run / "plan.json"); });
  EXPECT_NE(error.find("plan.json: rows[1].strategy.fsdp_degree is missing"), std::string::npos)
      << error;
  EXPECT_NE(error.find(fmt::format("schema version {}", kResultSchemaVersion)), std::string::npos)
      << error;
  EXPECT_NE(error.find("rerun `kiln plan`"), std::string::npos) << error;

  // The page says so where the plan's numbers would be, in its scorecard row and its section,
  // and lists the file as unreadable; no row of the plan is drawn.
  const ReportHtml page = make_report_html(run, dir / "no-chart.js");
  EXPECT_NE(std::find(page.missing.begin(), page.missing.end(), "plan.json (unreadable)"),
            page.missing.end());
  const std::string row = scorecard_row(page.html, "plan");
  EXPECT_NE(row.find("unreadable"), std::string::npos) << row;
  EXPECT_NE(row.find("rows[1].strategy.fsdp_degree is missing"), std::string::npos) << row;
  EXPECT_NE(page.html.find("<p class=\"error\">" + run.string() + "/plan.json: rows[1]"),
            std::string::npos);
  EXPECT_EQ(occurrences(page.html, "<tr class=\"row"), 0u);

  // A wrong type, a newer schema: refused too.
  plan = json::parse(testing::slurp(run / "plan.json"));
  plan["rows"][1]["strategy"]["fsdp_degree"] = "8";
  testing::write_text(run / "plan.json", plan.dump());
  EXPECT_NE(error_of([&] {
              read_result<PlanResult>(run / "plan.json");
            }).find("rows[1].strategy.fsdp_degree is string, expected an integer"),
            std::string::npos);
  json newer = json::parse(kPilotJson);
  newer["schema_version"] = kResultSchemaVersion + 1;
  testing::write_text(run / "pilot.json", newer.dump());
  EXPECT_NE(error_of([&] {
              read_result<PilotResult>(run / "pilot.json");
            }).find("schema_version is 3: written by a newer kiln"),
            std::string::npos);
}

TEST(Results, AStoppedRungRendersItsVerdict) {
  TempDir dir;
  // The baseline's file when its gate failed before measuring (src/rungs/baseline.cpp).
  testing::write_text(
      dir / "baseline.json",
      R"({"passed": false, "reason": "loss is NaN at step 3; lower optim.lr", "losses": [1, null]})");
  const auto baseline = read_result<BaselineResult>(dir / "baseline.json");
  EXPECT_FALSE(baseline.status.measured);
  EXPECT_EQ(baseline.status.verdict, "loss is NaN at step 3; lower optim.lr");
  const ReportHtml page = make_report_html(dir.path(), dir / "no-chart.js");
  const std::string row = scorecard_row(page.html, "baseline");
  EXPECT_NE(row.find("FAILED"), std::string::npos) << row;
  EXPECT_NE(row.find("<code>optim.lr</code>"), std::string::npos) << row;  // the key it names
  EXPECT_NE(page.html.find("<b>Next:</b> the baseline rung failed: loss is NaN"),
            std::string::npos);
}

TEST(Results, BaselineComputeRowGivesTheMeasuredMatmulPeaksMfu) {
  auto compute_row = [](const BaselineResult& b) {
    for (const auto& [name, text] : result_rows(b)) {
      if (name == "compute") return text;
    }
    return std::string();
  };
  BaselineResult b;  // a CPU with no catalog peak: MFU against the catalog is n/a
  b.flops_per_sample = 1e6;
  b.achieved_flops_per_second = 2.5e9;
  EXPECT_EQ(compute_row(b).find("matmul peak"), std::string::npos);  // nothing timed
  b.matmul_peak = MatmulPeakRecord{1e10, 256, 512, 128, "float32", 0.001, 5};
  b.mfu_of_matmul_peak = 0.25;
  const std::string row = compute_row(b);
  EXPECT_NE(row.find("MFU n/a"), std::string::npos) << row;
  EXPECT_NE(row.find("25.0% of the measured float32 matmul peak (1e+10 FLOP/s, 256x512x128)"),
            std::string::npos)
      << row;
}

TEST(ReportHtml, ScorecardFirstThenFocusedChartsFromTheTypedResults) {
  TempDir dir;
  const auto run = dir / "run";
  std::filesystem::create_directories(run);
  // Two steps, an evaluation, a torn line; rung files written through their structs.
  testing::write_text(
      run / "metrics-baseline.jsonl",
      "{\"step\":1,\"loss\":2.5,\"lr\":0.001,\"step_seconds\":0.1,"
      "\"data_wait_seconds\":0.01,\"samples_per_second\":40,\"tokens_per_second\":1280}\n"
      "{\"step\":2,\"loss\":2.0,\"lr\":0.002,\"step_seconds\":0.1,"
      "\"data_wait_seconds\":0.02,\"samples_per_second\":40,\"tokens_per_second\":1300}\n"
      "{\"step\":2,\"val_loss\":2.2}\n{\"step\":3,\"lo");
  CompileResult compile;
  compile.status = {1, true, "keep the compiled step", true};
  compile.backend = "inductor";
  compile.dynamic = "static";
  compile.device = "cpu";
  compile.timed = true;
  compile.cache = "cold";
  compile.eager = {0.02, 0.025, 200, 6400, 1e6};
  compile.compiled = {0.016, 0.018, 250, 8000, 9e5};
  compile.speedup = 1.25;
  compile.min_speedup = 1.05;
  testing::write_text(run / "compile.json", json(compile).dump());
  testing::write_text(run / "pilot.json", kPilotJson);
  testing::write_text(run / "baseline.json", "{\"verdict\": ");  // cut short

  testing::write_text(dir / "chart.js", "/* a stand-in library */ window.Chart = function() {};");
  const ReportHtml page = make_report_html(run, dir / "chart.js");
  EXPECT_TRUE(page.chart_library);
  const std::string& html = page.html;
  // The first screen: the scorecard before any section, one row per rung in ladder order.
  const size_t scorecard = html.find("<section id=\"scorecard\">");
  ASSERT_NE(scorecard, std::string::npos);
  EXPECT_LT(scorecard, html.find("<section class=\"part\""));
  size_t last = scorecard;
  for (const char* rung :
       {"baseline", "compile", "profile", "scale", "checkpoint", "pilot", "plan"}) {
    const size_t at = html.find(std::string("data-rung=\"") + rung + "\"");
    ASSERT_NE(at, std::string::npos) << rung;
    EXPECT_GT(at, last) << rung;
    last = at;
  }
  const std::string row = scorecard_row(html, "compile");
  EXPECT_NE(row.find("data-name=\"speedup\" data-exact=\"1.25\">1.25x speedup"), std::string::npos)
      << row;
  EXPECT_NE(row.find("<code>compile.backend = &quot;inductor&quot;</code>"), std::string::npos)
      << row;
  EXPECT_NE(row.find("href=\"#compile\""), std::string::npos);
  EXPECT_NE(scorecard_row(html, "scale").find("not run"), std::string::npos);
  EXPECT_NE(scorecard_row(html, "baseline").find("baseline.json: not a JSON object"),
            std::string::npos);
  for (const char* missing : {"baseline.json (unreadable)", "manifest.json", "scale.json"}) {
    EXPECT_NE(std::find(page.missing.begin(), page.missing.end(), missing), page.missing.end())
        << missing;
  }
  EXPECT_NE(html.find("Not in this run: "), std::string::npos);
  EXPECT_NE(scorecard_row(html, "pilot").find("data-exact=\"1388300\""), std::string::npos);

  // The charts: loss (train and validation on one axis, a log-scale box), throughput, learning
  // rate, eager vs compiled, the pilot's memory by part, estimated beside measured.
  EXPECT_EQ(page.charts,
            (std::vector<std::string>{"chart-training-loss", "chart-training-throughput",
                                      "chart-training-optimizer", "chart-compile-step-time",
                                      "chart-pilot-memory"}));
  EXPECT_NE(html.find("\"data\":[{\"x\":1.0,\"y\":0.001},{\"x\":2.0,\"y\":0.002}],"
                      "\"label\":\"learning rate\""),
            std::string::npos);
  EXPECT_NE(
      html.find("\"data\":[{\"x\":1.0,\"y\":2.5},{\"x\":2.0,\"y\":2.0}],\"label\":\"train loss\""),
      std::string::npos);
  EXPECT_NE(html.find("\"data\":[{\"x\":2.0,\"y\":2.2}],\"label\":\"validation loss\""),
            std::string::npos);
  EXPECT_NE(html.find("class=\"log-scale\" data-chart=\"chart-training-loss\""), std::string::npos);
  EXPECT_NE(
      html.find(
          "\"data\":[{\"x\":1.0,\"y\":1280.0},{\"x\":2.0,\"y\":1300.0}],\"label\":\"tokens/s\""),
      std::string::npos);
  EXPECT_NE(html.find("\"data\":[0.02,0.016],\"label\":\"median\""), std::string::npos);
  // Read back against pilot.json: MB (its step peak is 1.39 MB), a part per category and the
  // step peak as its own pair of bars (the parts are not all held at once: no stacking).
  const json pilot = json::parse(kPilotJson);
  const json memory_chart = chart_config(html, "chart-pilot-memory");
  EXPECT_EQ(memory_chart["options"]["plugins"]["title"]["text"],
            "Memory by part and the step peak, MB: estimated beside measured");
  EXPECT_EQ(memory_chart["data"]["labels"], json({"parameters", "gradients", "optimizer state",
                                                  "activations + logits", "step peak"}));
  const json& estimate = pilot["memory"]["estimate"];
  const json& measured = pilot["memory"]["measured"];
  const std::vector<double> estimated_mb = {
      estimate["parameters_bytes"].get<double>() / 1e6,
      estimate["gradients_bytes"].get<double>() / 1e6,
      estimate["optimizer_bytes"].get<double>() / 1e6,
      (estimate["activations_bytes"].get<double>() + estimate["logits_bytes"].get<double>()) / 1e6,
      estimate["step_peak_bytes"].get<double>() / 1e6};
  EXPECT_EQ(memory_chart["data"]["datasets"][0]["label"], "estimated");
  EXPECT_EQ(memory_chart["data"]["datasets"][0]["data"].get<std::vector<double>>(), estimated_mb);
  EXPECT_EQ(memory_chart["data"]["datasets"][1]["data"][4].get<double>(),
            measured["peak_bytes"].get<double>() / 1e6);
  EXPECT_EQ(html.find("\"stacked\":true"), std::string::npos);
  // Key/value dumps behind a fold.
  EXPECT_NE(html.find("<details class=\"dump\"><summary>Every number of pilot.json"),
            std::string::npos);

  // Without Chart.js: the same charts as SVG; the memory chart draws 5 x 2 bars.
  const ReportHtml svg = make_report_html(run, dir / "no-such-chart.js");
  EXPECT_EQ(svg.charts, page.charts);
  EXPECT_NE(svg.html.find("plain SVG"), std::string::npos);
  const size_t begin = svg.html.find("<svg class=\"svg-chart\" id=\"chart-pilot-memory\"");
  ASSERT_NE(begin, std::string::npos);
  const std::string memory = svg.html.substr(begin, svg.html.find("</svg>", begin) - begin);
  EXPECT_EQ(occurrences(memory, "<rect"), 1u + 10u);

  // An empty directory still gets a page; a missing one is a user error.
  std::filesystem::create_directories(dir / "empty");
  const ReportHtml empty = write_report_html(dir / "empty", dir / "chart.js");
  EXPECT_TRUE(empty.charts.empty());
  EXPECT_NE(empty.html.find("no rung has run here"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(dir / "empty" / "report.html"));
  EXPECT_THROW(make_report_html(dir / "absent"), UserError);
}

TEST(ReportHtml, PlanRowsWithTheRecommendedOneMarked) {
  TempDir dir;
  run_plan(testing::gpt_config(dir / "runs",
                               {"plan.hardware=h100-sxm,mi300x,b200",
                                "plan.price_7d_per_gpu_hour={ h100-sxm = 2.99, mi300x = 2.5 }"}));
  const auto run = dir / "runs" / "t";
  const ReportHtml page = make_report_html(run, dir / "no-chart.js");
  EXPECT_EQ(occurrences(page.html, "<tr class=\"row"), 3u);
  EXPECT_EQ(occurrences(page.html, "<tr class=\"row chosen\">"), 1u);
  EXPECT_NE(page.html.find("<tr class=\"row chosen\"><td>mi300x (recommended)</td>"),
            std::string::npos);
  const std::string row = scorecard_row(page.html, "plan");
  EXPECT_NE(row.find("x mi300x"), std::string::npos) << row;
  EXPECT_NE(row.find("7 days"), std::string::npos) << row;
}

TEST(ReportHtml, TwoRunsSideBySide) {
  TempDir dir;
  auto make_run = [&](const std::string& name, double tokens_per_second, const std::string& lr) {
    const auto run = dir / name;
    std::filesystem::create_directories(run);
    BaselineResult b;
    b.status = {1, true, "correct eager baseline", true};
    b.device = "cpu";
    b.samples_per_second = tokens_per_second / 64;
    b.tokens_per_second = tokens_per_second;
    b.loss_start = 5;
    b.loss_end = 3;
    testing::write_text(run / "baseline.json", json(b).dump());
    testing::write_text(run / "config.toml",
                        "[run]\nname = \"" + name + "\"\n[optim]\nlr = " + lr + "\nbeta2 = 0.99\n");
    testing::write_text(
        run / "metrics.jsonl",
        fmt::format("{{\"step\":1,\"loss\":4.0,\"tokens_per_second\":{}}}\n", tokens_per_second));
    return run;
  };
  const auto a = make_run("a", 1000, "0.001"), b = make_run("b", 1100, "0.002");
  testing::write_text(dir / "chart.js", "window.Chart = function() {};");
  const ReportHtml page = make_comparison_html(a, b, dir / "chart.js");
  const std::string& html = page.html;
  EXPECT_NE(
      html.find("<tr class=\"compare\" data-rung=\"baseline\" data-name=\"tokens_per_second\">"
                "<td>baseline</td><td>tokens_per_second</td>"
                "<td class=\"a\" data-exact=\"1000\">1000 tokens/s</td>"
                "<td class=\"b\" data-exact=\"1100\">1100 tokens/s</td>"
                "<td class=\"difference\">+100 (+10.0%)</td>"),
      std::string::npos)
      << html;
  // The config keys that differ (and only those).
  EXPECT_NE(html.find("<tr class=\"row\"><td>optim.lr</td><td>0.001</td><td>0.002</td></tr>"),
            std::string::npos);
  EXPECT_NE(html.find("<td>run.name</td>"), std::string::npos);
  EXPECT_EQ(html.find("<td>optim.beta2</td>"), std::string::npos);
  EXPECT_EQ(page.charts,
            (std::vector<std::string>{"chart-compare-loss", "chart-compare-throughput"}));
  EXPECT_NE(html.find("\"label\":\"A: train loss\""), std::string::npos);
  EXPECT_NE(html.find("\"data\":[{\"x\":1.0,\"y\":1100.0}],\"label\":\"B: tokens/s\""),
            std::string::npos);

  // The CLI: two runs need --out; with it, DIR/report.html.
  auto refused = testing::run_kiln("report " + a.string() + " " + b.string());
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("--out"), std::string::npos) << refused.err;
  auto done = testing::run_kiln("report " + a.string() + " " + b.string() + " --out " +
                                (dir / "both").string());
  EXPECT_EQ(done.exit_code, 0) << done.err;
  EXPECT_NE(testing::slurp(dir / "both" / "report.html").find("data-name=\"tokens_per_second\""),
            std::string::npos);
}

// Where a struct's to_json (`written`) and a rung file (`file`) differ, one line each: a value
// written under a key the file lacks or holds otherwise and, with `exact`, a key of the file that
// the struct did not read back. Numbers compare as numbers (12.0 == 12); a NaN written is the
// file's null. "schema_version" is the writer's own (an old file has none).
void result_differences(const json& file, const json& written, const std::string& path, bool exact,
                        std::vector<std::string>& out) {
  if (written.is_object() && file.is_object()) {
    for (const auto& [key, value] : written.items()) {
      if (path.empty() && key == "schema_version") continue;
      if (!file.contains(key)) {
        out.push_back(path + "/" + key + " written, not in the file");
      } else {
        result_differences(file[key], value, path + "/" + key, exact, out);
      }
    }
    if (!exact) return;
    for (const auto& [key, value] : file.items()) {
      if (!written.contains(key) && !(path.empty() && key == "schema_version"))
        out.push_back(path + "/" + key + " in the file, not read back");
    }
  } else if (written.is_array() && file.is_array() && written.size() == file.size()) {
    for (size_t k = 0; k < written.size(); ++k)
      result_differences(file[k], written[k], fmt::format("{}/{}", path, k), exact, out);
  } else if (written.is_number() && file.is_number()) {
    if (written.get<double>() != file.get<double>()) out.push_back(path + " differs");
  } else if (written.is_number_float() && std::isnan(written.get<double>()) && file.is_null()) {
  } else if (written != file) {
    out.push_back(path + ": " + written.dump() + " written, " + file.dump() + " in the file");
  }
}

template <class T>
std::vector<std::string> round_trip_differences(const json& file, bool exact) {
  std::vector<std::string> out;
  result_differences(file, json(file.get<T>()), "", exact, out);
  return out;
}

// Files of today's layout (schema version 2) as the compile, profile, scale and pilot rungs wrote
// them (tests/report/fixtures: real CPU runs; the compile file with a probe entry and a DDP part
// added as the rung writes them under torchrun): each read through its struct and written back
// exactly. The rungs write through these structs' to_json, so a key renamed in a struct's field
// list (src/report/results*.cpp) is a key renamed in the rung's file: reading the fixture fails
// on it, and a key added without the fixture fails the other way.
TEST(Results, TodaysRungFilesReadAndWriteBackExactly) {
  const auto fixtures = testing::source_dir() / "tests" / "report" / "fixtures";
  auto fixture = [&](const char* name) { return json::parse(testing::slurp(fixtures / name)); };
  const json compile = fixture("compile-v2.json"), profile = fixture("profile-v2.json"),
             scale = fixture("scale-v2.json"), pilot = fixture("pilot-v2.json");
  EXPECT_EQ(round_trip_differences<CompileResult>(compile, true), std::vector<std::string>{});
  EXPECT_EQ(round_trip_differences<ProfileResult>(profile, true), std::vector<std::string>{});
  EXPECT_EQ(round_trip_differences<ScaleResult>(scale, true), std::vector<std::string>{});
  EXPECT_EQ(round_trip_differences<PilotResult>(pilot, true), std::vector<std::string>{});

  // Typed where kiln reads them: the values under their names.
  const auto c = compile.get<CompileResult>();
  EXPECT_TRUE(c.built && c.timed);
  ASSERT_EQ(c.probe.size(), 1u);
  EXPECT_EQ(c.probe[0].seq_len, 16);
  ASSERT_TRUE(c.probe[0].eval.has_value());
  EXPECT_TRUE(c.probe[0].eval->eager && !c.probe[0].train.eager);
  ASSERT_TRUE(c.ddp.has_value());
  EXPECT_EQ(c.ddp->bucket_bytes, (std::vector<int64_t>{1048576, 26214400}));
  EXPECT_FALSE(c.ddp->compiled.has_value());  // null: a captured step
  EXPECT_EQ(c.worst_loss_step, compile["numerics"]["worst_loss_step"].get<int64_t>());
  EXPECT_EQ(c.compiled_losses, compile["numerics"]["compiled_losses"].get<std::vector<double>>());
  const auto s = scale.get<ScaleResult>();
  ASSERT_EQ(s.per_rank.size(), 2u);
  ASSERT_TRUE(s.per_rank[1].memory.has_value());
  EXPECT_EQ(s.per_rank[1].memory->model_state_ddp,
            scale["per_rank"][1]["memory"]["model_state_by_strategy"]["ddp"].get<int64_t>());
  EXPECT_EQ(s.per_rank[0].comm_collectives, scale["per_rank"][0]["comm"]["collectives"]);
  ASSERT_TRUE(s.baseline.has_value());
  EXPECT_EQ(s.baseline_samples_per_second(), scale["baseline"]["samples_per_second"]);
  EXPECT_EQ(s.table.size(), scale["table"].size());
  EXPECT_EQ(s.table.at(0).first, scale["table"][0][0]);
  const auto p = pilot.get<PilotResult>();
  EXPECT_EQ(p.matmul_peak.flops_per_second, pilot["matmul_peak"]["flops_per_second"]);
  EXPECT_EQ(p.mfu_of_matmul_peak, pilot["mfu_of_matmul_peak"]);
  EXPECT_EQ(p.restore.recovery_seconds, pilot["restore"]["recovery_seconds"]);
  // The parts src/profile lays out, carried whole: the top operators' input shapes too.
  const auto f = profile.get<ProfileResult>();
  ASSERT_FALSE(f.top_operators.empty());
  EXPECT_EQ(json(f)["analysis"]["top_operators"][0], profile["analysis"]["top_operators"][0]);
  EXPECT_EQ(f.schedule.active, profile["schedule"]["active"]);

  // The rank entries the scale rung's ranks exchange, and the restore the pilot's ranks share.
  EXPECT_EQ(json(scale["per_rank"][1].get<ScaleRank>()), scale["per_rank"][1]);
  EXPECT_EQ(json(pilot["restore"].get<PilotRestore>()), pilot["restore"]);
}

// The rung files of the demo ladder that report.ladder runs (KILN_REPORT_LADDER; CTest runs this
// suite as report.ladder_results after that fixture, tests/report/CMakeLists.txt): each read
// through its struct and written back. Every rung but the plan writes through to_json alone, so
// its file comes back exactly (a key the rung wrote and the reader did not read fails); the plan's
// file (the planner's document) holds each value its struct writes, under the same key.
TEST(LadderFiles, EveryRungFileReadsBackThroughItsStruct) {
  const char* ladder = std::getenv("KILN_REPORT_LADDER");
  ASSERT_NE(ladder, nullptr) << "run through CTest (report.ladder_results)";
  const auto run = std::filesystem::path(ladder) / "runs" / "demo";
  auto file = [&](const char* name) { return json::parse(testing::slurp(run / name)); };
  int checked = 0;
  auto check = [&](const char* name, const std::vector<std::string>& problems) {
    EXPECT_EQ(problems, std::vector<std::string>{}) << name;
    ++checked;
  };
  const json baseline = file("baseline.json"), checkpoint = file("checkpoint.json");
  EXPECT_EQ(baseline["schema_version"], kResultSchemaVersion);
  EXPECT_GT(baseline["losses"].size(), 0u);
  check("baseline.json", round_trip_differences<BaselineResult>(baseline, /*exact=*/true));
  check("checkpoint.json", round_trip_differences<CheckpointResult>(checkpoint, /*exact=*/true));
  check("profile.json", round_trip_differences<ProfileResult>(file("profile.json"), true));
  check("scale.json", round_trip_differences<ScaleResult>(file("scale.json"), true));
  check("pilot.json", round_trip_differences<PilotResult>(file("pilot.json"), true));
  check("plan.json", round_trip_differences<PlanResult>(file("plan.json"), true));
  if (std::filesystem::exists(run / "compile.json"))
    check("compile.json", round_trip_differences<CompileResult>(file("compile.json"), true));
  EXPECT_GE(checked, 6);

  // The baseline's MFU against the matmul it timed: the achieved rate over the measured peak,
  // both from the same file; the peak is 2 m n k over the median time of one matmul.
  const auto b = baseline.get<BaselineResult>();
  ASSERT_TRUE(b.matmul_peak.has_value() && b.mfu_of_matmul_peak.has_value());
  const json& peak = baseline["matmul_peak"];
  const double flops = 2.0 * peak["m"].get<double>() * peak["n"].get<double>() *
                       peak["k"].get<double>() / peak["median_seconds"].get<double>();
  EXPECT_NEAR(peak["flops_per_second"].get<double>(), flops, 1e-9 * flops);
  const double mfu = baseline["achieved_flops_per_second"].get<double>() / flops;
  EXPECT_NEAR(baseline["mfu_of_matmul_peak"].get<double>(), mfu, 1e-9 * mfu);
  EXPECT_EQ(*b.mfu_of_matmul_peak, baseline["mfu_of_matmul_peak"].get<double>());
  EXPECT_EQ(peak["dtype"], "float32");  // the demo trains in fp32 on the CPU

  // The control: a key the rung wrote under another name than the reader reads fails both ways
  // (the reader misses it, the file keeps a key nobody reads); so does a value changed in transit.
  json renamed = baseline;
  renamed["skipped_steps_total"] = renamed["skipped_steps"];
  renamed.erase("skipped_steps");
  EXPECT_NE(error_of([&] { renamed.get<BaselineResult>(); }).find("skipped_steps is missing"),
            std::string::npos);
  json extra = checkpoint;
  extra["resume_step"] = 2;
  EXPECT_EQ(round_trip_differences<CheckpointResult>(extra, true),
            std::vector<std::string>{"/resume_step in the file, not read back"});
}

// Under torchrun only rank 0 reads a rung's file back; after each rung the ranks agree on one
// outcome (ranks as threads): every rank takes the same branch, a failure anywhere fails the rung
// everywhere under its rank's name, and rank 0's word (its file's) is the verdict otherwise.
TEST(Results, LadderRanksAgreeOnEachRungsOutcome) {
  auto outcomes = [](std::vector<std::pair<bool, std::string>> mine) {
    std::vector<RungResult> out(mine.size());
    testing::run_ranks(static_cast<int>(mine.size()), [&](Communicator& comm) {
      RungResult& r = out[static_cast<size_t>(comm.rank())];
      r.rung = "baseline";
      std::tie(r.passed, r.verdict) = mine[static_cast<size_t>(comm.rank())];
      agree_on_rung_outcome(comm, r);
    });
    return out;
  };
  for (const RungResult& r : outcomes({{true, "file: passed"}, {true, "mine"}, {true, "also"}})) {
    EXPECT_TRUE(r.passed);
    EXPECT_EQ(r.verdict, "file: passed");  // rank 0's, which read the file back
  }
  // Rank 0's file said failed (its read-back turned it), the others measured a pass.
  for (const RungResult& r :
       outcomes({{false, "baseline.json says the rung failed"}, {true, "ok"}})) {
    EXPECT_FALSE(r.passed);
    EXPECT_EQ(r.verdict, "baseline.json says the rung failed");
  }
  for (const RungResult& r :
       outcomes({{true, "ok"}, {false, "non-finite loss"}, {false, "error: timeout"}})) {
    EXPECT_FALSE(r.passed);
    EXPECT_EQ(r.verdict, "rank 1: non-finite loss");
  }
}

TEST(Results, KeysOfVersionTwoRequiredFromVersionTwo) {
  BaselineResult b;
  b.status = {kResultSchemaVersion, true, "correct eager baseline", true};
  b.device = "cpu";
  b.losses = {5.0, std::nan(""), 4.0};
  b.val_loss_final = std::nan("");
  json v2 = b;
  EXPECT_EQ(v2["schema_version"], 2);
  // Written as text (a NaN is null in JSON) and read back: NaN again.
  const BaselineResult back = json::parse(v2.dump()).get<BaselineResult>();
  EXPECT_TRUE(std::isnan(back.losses[1]) && std::isnan(back.val_loss_final));
  EXPECT_EQ(back.losses[2], 4.0);
  // A version-1 file (today's runs before versions) lacks the keys version 2 added: defaults.
  json v1 = v2;
  v1.erase("schema_version");
  for (const char* key : {"grad_accum_steps", "losses", "skipped_steps", "peak_flops_source"})
    v1.erase(key);
  v1["peak_memory"].erase("reserved_bytes");
  const BaselineResult old = v1.get<BaselineResult>();
  EXPECT_EQ(old.status.schema_version, 1);
  EXPECT_TRUE(old.losses.empty());
  EXPECT_EQ(old.peak_reserved_bytes, -1);
  // The same file claiming version 2 is refused, naming the key.
  v1["schema_version"] = 2;
  EXPECT_NE(error_of([&] { v1.get<BaselineResult>(); }).find("grad_accum_steps is missing"),
            std::string::npos);
}

}  // namespace
}  // namespace kiln
