// report/ and models/hf: CRC-32C against published vectors, TensorBoard record framing, the
// Hugging Face config check and round trip, report.html on partial and broken run directories,
// and the CLI's refusals. (The tools kiln did not write read the same files in interop_test.py.)
#include "kiln/report.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/pilot.h"
#include "kiln/safetensors.h"
#include "support/helpers.h"

namespace kiln {
namespace {

using testing::TempDir;

TEST(Crc32c, PublishedVectors) {
  const char* digits = "123456789";
  EXPECT_EQ(crc32c(digits, 9), 0xE3069283u);
  // RFC 3720 (iSCSI) B.4: 32 zero bytes, 32 0xFF bytes, 32 ascending bytes.
  unsigned char bytes[32];
  std::memset(bytes, 0, sizeof(bytes));
  EXPECT_EQ(crc32c(bytes, 32), 0x8A9136AAu);
  std::memset(bytes, 0xFF, sizeof(bytes));
  EXPECT_EQ(crc32c(bytes, 32), 0x62A8AB43u);
  for (int k = 0; k < 32; ++k) bytes[k] = static_cast<unsigned char>(k);
  EXPECT_EQ(crc32c(bytes, 32), 0x46DD794Eu);
  // Continuing a CRC over a split buffer gives the whole buffer's.
  EXPECT_EQ(crc32c(bytes + 10, 22, crc32c(bytes, 10)), 0x46DD794Eu);
  // TFRecord's mask: rotate right 15, add 0xa282ead8.
  const uint32_t crc = crc32c(digits, 9);
  EXPECT_EQ(masked_crc32c(digits, 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

uint64_t read_u64(const std::string& s, size_t at) {
  uint64_t v;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}
uint32_t read_u32(const std::string& s, size_t at) {
  uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

TEST(TensorBoardWriter, FramesEachRecordWithMaskedCrcs) {
  TempDir dir;
  std::filesystem::path path;
  {
    TensorBoardWriter writer(dir / "tb");
    path = writer.path();
    writer.add_scalar("train/loss", 3, 1.5);
    writer.add_scalar("val/loss", 4, 0.25);
    TensorBoardWriter second(dir / "tb");  // the same second: another name
    EXPECT_NE(second.path(), path);
  }
  EXPECT_TRUE(path.filename().string().starts_with("events.out.tfevents."));
  const std::string bytes = testing::slurp(path);
  size_t at = 0;
  std::vector<std::string> records;
  while (at < bytes.size()) {
    ASSERT_LE(at + 12, bytes.size());
    const uint64_t length = read_u64(bytes, at);
    EXPECT_EQ(read_u32(bytes, at + 8), masked_crc32c(bytes.data() + at, 8));
    ASSERT_LE(at + 16 + length, bytes.size());
    records.push_back(bytes.substr(at + 12, length));
    EXPECT_EQ(read_u32(bytes, at + 12 + length), masked_crc32c(records.back().data(), length));
    at += 16 + length;
  }
  ASSERT_EQ(records.size(), 3u);
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  EXPECT_NE(records[1].find("train/loss"), std::string::npos);
  const float value = 1.5f;  // simple_value: field 2, wire type 5, then the float
  std::string tail("\x15", 1);
  tail.append(reinterpret_cast<const char*>(&value), 4);
  EXPECT_TRUE(records[1].ends_with(tail));
  EXPECT_NE(records[2].find("val/loss"), std::string::npos);
}

std::shared_ptr<Model> tiny_gpt(const std::filesystem::path& dir, int64_t seed,
                                const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"model.n_layer=1", "model.n_embd=16", "model.n_head=2",
                                   "model.block_size=32", "run.seed=" + std::to_string(seed)};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return make_model(testing::gpt_config(dir, sets));
}

TEST(HuggingFace, ConfigMismatchNamesTheFieldAndTheKey) {
  GptConfig gpt{2, 2, 32, 64, 256};
  const nlohmann::json config = hf_gpt2_config(gpt);
  EXPECT_EQ(hf_gpt2_config_mismatch(config, gpt), "");
  auto changed = config;
  changed["n_embd"] = 48;
  EXPECT_EQ(hf_gpt2_config_mismatch(changed, gpt),
            "config.json has n_embd = 48 but the model has model.n_embd = 32: set model.n_embd "
            "= 48");
  changed = config;
  changed["n_positions"] = 1024;
  EXPECT_NE(hf_gpt2_config_mismatch(changed, gpt).find("model.block_size = 1024"),
            std::string::npos);
  changed = config;
  changed["tie_word_embeddings"] = false;
  EXPECT_NE(hf_gpt2_config_mismatch(changed, gpt).find("tie_word_embeddings"), std::string::npos);
  changed = config;
  changed["activation_function"] = "relu";
  EXPECT_NE(hf_gpt2_config_mismatch(changed, gpt).find("relu"), std::string::npos);
}

TEST(HuggingFace, ExportThenInitFromGivesTheSameWeights) {
  TempDir dir;
  auto source = tiny_gpt(dir / "runs", 1);
  save_hf_gpt2(*source, dir / "hf", /*force=*/false);
  // HF's Conv1D layout: c_fc's weight is [in, out] on disk.
  for (const auto& entry : read_safetensors_header(dir / "hf" / "model.safetensors").tensors) {
    if (entry.name == "transformer.h.0.mlp.c_fc.weight") {
      EXPECT_EQ(entry.shape, (std::vector<int64_t>{16, 64}));
    }
  }
  auto loaded = tiny_gpt(dir / "runs", 2, {"model.init_from=" + (dir / "hf").string()});
  EXPECT_EQ(weights_hash(*loaded), weights_hash(*source));
  ASSERT_TRUE(loaded->init_from.is_object());
  EXPECT_EQ(loaded->init_from["files"].size(), 1u);
  EXPECT_EQ(loaded->init_from["files"][0]["sha256"], sha256_file(dir / "hf" / "model.safetensors"));
  EXPECT_EQ(model_identity(*loaded)["init_from"], loaded->init_from);
  EXPECT_FALSE(model_identity(*source).contains("init_from"));

  // A non-empty directory: refused, unless force.
  try {
    save_hf_gpt2(*source, dir / "hf", false);
    FAIL() << "a non-empty directory was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--force"), std::string::npos);
  }
  save_hf_gpt2(*source, dir / "hf", true);
}

TEST(HuggingFace, InitFromNamesTheFirstWrongTensor) {
  TempDir dir;
  auto source = tiny_gpt(dir / "runs", 1);
  save_hf_gpt2(*source, dir / "hf", false);
  auto tensors = read_safetensors(dir / "hf" / "model.safetensors");
  for (auto& [name, tensor] : tensors) {
    if (name == "transformer.h.0.attn.c_proj.weight") tensor = torch::zeros({16, 8});
  }
  write_safetensors(dir / "hf" / "model.safetensors", tensors, {{"format", "pt"}});
  auto target = tiny_gpt(dir / "runs", 2);
  const std::string before = weights_hash(*target);
  try {
    load_hf_gpt2(*target, dir / "hf", "model.init_from");
    FAIL() << "a wrong shape was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("transformer.h.0.attn.c_proj.weight"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("[16, 8]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(weights_hash(*target), before);  // nothing copied
  // A missing tensor and an unexpected one are named too.
  tensors.erase(tensors.begin());
  tensors.emplace_back("transformer.h.7.extra", torch::zeros({2}));
  write_safetensors(dir / "hf" / "model.safetensors", tensors, {{"format", "pt"}});
  EXPECT_THROW(load_hf_gpt2(*target, dir / "hf", "model.init_from"), UserError);
  // No config.json: the key and the directory are named.
  std::filesystem::remove(dir / "hf" / "config.json");
  try {
    load_hf_gpt2(*target, dir / "hf", "model.init_from");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.init_from"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("no config.json"), std::string::npos);
  }
}

TEST(ReportHtml, PartialAndBrokenRunDirectories) {
  TempDir dir;
  const auto run = dir / "run";
  std::filesystem::create_directories(run);
  // Two step records, an eval, a torn line; a rung file that is not JSON.
  testing::write_text(run / "metrics.jsonl",
                      "{\"step\":1,\"loss\":2.5,\"lr\":0.001,\"step_seconds\":0.1,"
                      "\"data_wait_seconds\":0.01}\n"
                      "{\"step\":2,\"loss\":2.0,\"lr\":0.002,\"step_seconds\":0.1,"
                      "\"data_wait_seconds\":0.02}\n"
                      "{\"step\":2,\"val_loss\":2.2}\n{\"step\":3,\"lo");
  testing::write_text(run / "baseline.json", "{\"verdict\": ");
  const ReportHtml with_svg = make_report_html(run, dir / "no-such-chart.js");
  EXPECT_FALSE(with_svg.chart_library);
  EXPECT_NE(with_svg.html.find("plain SVG"), std::string::npos);
  EXPECT_NE(with_svg.html.find("<svg"), std::string::npos);
  EXPECT_EQ(with_svg.charts, (std::vector<std::string>{"chart-metrics-jsonl-loss",
                                                       "chart-metrics-jsonl-step-time"}));
  for (const char* missing :
       {"manifest.json", "baseline.json (unreadable)", "compile.json", "profile.json", "scale.json",
        "checkpoint.json", "pilot.json", "plan.json"}) {
    EXPECT_NE(std::find(with_svg.missing.begin(), with_svg.missing.end(), missing),
              with_svg.missing.end())
        << missing;
  }
  EXPECT_NE(with_svg.html.find("Not in this run: "), std::string::npos);

  // With a chart library: inlined verbatim, one Chart per chart, no SVG.
  testing::write_text(dir / "chart.js", "/* a stand-in library */ window.Chart = function() {};");
  const ReportHtml with_js = make_report_html(run, dir / "chart.js");
  EXPECT_TRUE(with_js.chart_library);
  EXPECT_NE(with_js.html.find("/* a stand-in library */"), std::string::npos);
  EXPECT_EQ(with_js.html.find("<svg"), std::string::npos);
  size_t charts = 0;
  for (size_t at = 0; (at = with_js.html.find("new Chart(", at)) != std::string::npos; ++at) {
    ++charts;
  }
  EXPECT_EQ(charts, 2u);

  // The checkpoint drill's times (the browser test's ladder runs no drill).
  testing::write_text(run / "checkpoint.json",
                      "{\"save_seconds\": 1.5, \"resume_seconds\": 2, \"reference_seconds\": 3, "
                      "\"verdict\": \"restored\"}");
  const ReportHtml drill = make_report_html(run, dir / "chart.js");
  EXPECT_EQ(drill.charts.back(), "chart-checkpoint-times");
  EXPECT_NE(
      drill.html.find("\"labels\":[\"save_seconds\",\"resume_seconds\",\"reference_seconds\"]"),
      std::string::npos);

  // An empty directory still gets a page; a missing one is a user error.
  std::filesystem::create_directories(dir / "empty");
  const ReportHtml empty = write_report_html(dir / "empty", dir / "chart.js");
  EXPECT_TRUE(empty.charts.empty());
  EXPECT_TRUE(std::filesystem::exists(dir / "empty" / "report.html"));
  EXPECT_THROW(make_report_html(dir / "absent"), UserError);
}

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

// The <svg> element of one chart (plain-SVG page).
std::string svg_of(const std::string& html, const std::string& id) {
  const size_t begin = html.find("<svg class=\"svg-chart\" id=\"" + id + "\"");
  if (begin == std::string::npos) return "";
  return html.substr(begin, html.find("</svg>", begin) - begin);
}

TEST(ReportHtml, PilotAndPlanSections) {
  TempDir dir;
  // plan.json as `kiln plan` writes it (no model is built: milliseconds), prices for two rows.
  const Config config = testing::gpt_config(
      dir / "runs", {"plan.hardware=h100-sxm,mi300x,b200",
                     "plan.price_7d_per_gpu_hour={ h100-sxm = 2.99, mi300x = 2.5 }"});
  run_plan(config);
  const auto run = dir / "runs" / "t";
  testing::write_text(run / "pilot.json", kPilotJson);
  nlohmann::json plan = nlohmann::json::parse(testing::slurp(run / "plan.json"));
  ASSERT_EQ(plan["rows"].size(), 3u);
  const std::string chosen = plan["recommendation"]["hardware"];
  EXPECT_EQ(chosen, "mi300x");  // the cheaper of the two priced rows

  testing::write_text(dir / "chart.js", "/* a stand-in library */ window.Chart = function() {};");
  const ReportHtml js = make_report_html(run, dir / "chart.js");
  ASSERT_GE(js.charts.size(), 4u);
  EXPECT_EQ(std::vector<std::string>(js.charts.end() - 4, js.charts.end()),
            (std::vector<std::string>{"chart-pilot-memory", "chart-pilot-cycle", "chart-plan-time",
                                      "chart-plan-memory"}));
  const std::string& page = js.html;
  // Estimated vs measured by part, as pilot.json holds them (activations + logits summed).
  EXPECT_NE(page.find("\"labels\":[\"parameters\",\"gradients\",\"optimizer state\","
                      "\"activations + logits\",\"step peak\"]"),
            std::string::npos);
  EXPECT_NE(page.find("\"data\":[142848.0,142848.0,285696.0,959488.0,1388032.0]"),
            std::string::npos);
  EXPECT_NE(page.find("\"data\":[142848.0,142848.0,285696.0,959756.0,1388300.0]"),
            std::string::npos);
  // The cycle's times; the restore's equality and the hashes in the tables.
  EXPECT_NE(page.find("\"data\":[0.467323103,0.000758408,0.025551781,2.486412572]"),
            std::string::npos);
  EXPECT_NE(page.find("bitwise equal (5.4388"), std::string::npos);
  EXPECT_NE(page.find("d5079afb9c129453"), std::string::npos);
  // The plan: a row per candidate, the chosen one marked, in the table and in the charts.
  EXPECT_EQ(occurrences(page, "<tr class=\"row"), 3u);
  EXPECT_EQ(occurrences(page, "<tr class=\"row chosen\">"), 1u);
  EXPECT_NE(page.find("<tr class=\"row chosen\"><td>mi300x (chosen)"), std::string::npos);
  EXPECT_NE(page.find("chosen: 7 days"), std::string::npos);
  EXPECT_EQ(occurrences(page, "\"labels\":[\"h100-sxm\",\"mi300x (chosen)\",\"b200\"]"), 2u);
  // Costs on the right axis: 7 days for the two priced rows, none for 30 days.
  EXPECT_NE(page.find(fmt::format("\"data\":[{},{},null]",
                                  plan["rows"][0]["reservation_7d"]["cost"].dump(),
                                  plan["rows"][1]["reservation_7d"]["cost"].dump())),
            std::string::npos);
  EXPECT_NE(page.find("\"label\":\"30-day cost\""), std::string::npos);
  for (const auto& m : js.missing) {
    EXPECT_FALSE(m.starts_with("pilot.json") || m.starts_with("plan.json")) << m;
  }
  // No manifest in this directory: the pins are named as missing.
  EXPECT_NE(std::find(js.missing.begin(), js.missing.end(), "manifest.json pins"),
            js.missing.end());

  // Plain SVG: the same charts, each bar drawn (plus the frame).
  const ReportHtml svg = make_report_html(run, dir / "no-such-chart.js");
  EXPECT_EQ(svg.charts, js.charts);
  EXPECT_EQ(occurrences(svg_of(svg.html, "chart-pilot-memory"), "<rect"), 1u + 10u);
  EXPECT_EQ(occurrences(svg_of(svg.html, "chart-pilot-cycle"), "<rect"), 1u + 4u);
  EXPECT_EQ(occurrences(svg_of(svg.html, "chart-plan-time"), "<rect"), 1u + 3u + 2u);
  EXPECT_EQ(occurrences(svg_of(svg.html, "chart-plan-memory"), "<rect"), 1u + 6u);

  // A row that does not fit: no days (null), "no" in the table.
  plan["rows"][2]["fits_memory"] = false;
  plan["rows"][2]["strategy"]["strategy"] = "does-not-fit";
  testing::write_text(run / "plan.json", plan.dump());
  const ReportHtml unfit = make_report_html(run, dir / "chart.js");
  EXPECT_NE(
      unfit.html.find(fmt::format("\"data\":[{},{},null]", plan["rows"][0]["wall_days"].dump(),
                                  plan["rows"][1]["wall_days"].dump())),
      std::string::npos);
  EXPECT_NE(unfit.html.find("<td>does-not-fit</td>"), std::string::npos);

  // Partial files: the sections show what is there and name what is not.
  testing::write_text(run / "pilot.json",
                      "{\"verdict\": \"cut short\", \"step_seconds\": 0.5, "
                      "\"memory\": {\"measured\": {\"peak_bytes\": 100}}}");
  testing::write_text(run / "plan.json",
                      "{\"verdict\": \"odd\", \"rows\": [{\"hardware\": \"x\"}, 5]}");
  const ReportHtml partial = make_report_html(run, dir / "chart.js");
  EXPECT_NE(std::find(partial.missing.begin(), partial.missing.end(),
                      "pilot.json without memory.estimate, checkpoint, restore"),
            partial.missing.end());
  EXPECT_NE(partial.html.find("pilot.json lacks memory.estimate, checkpoint, restore"),
            std::string::npos);
  EXPECT_NE(partial.html.find("\"data\":[null,null,null,null,100.0]"), std::string::npos);
  EXPECT_EQ(std::vector<std::string>(partial.charts.end() - 4, partial.charts.end()),
            (std::vector<std::string>{"chart-pilot-memory", "chart-pilot-cycle", "chart-plan-time",
                                      "chart-plan-memory"}));
  EXPECT_EQ(occurrences(partial.html, "<tr class=\"row"), 2u);
  testing::write_text(run / "plan.json", "{\"verdict\": \"odd\", \"rows\": 3}");
  testing::write_text(run / "pilot.json", "{\"verdict\": ");
  const ReportHtml broken = make_report_html(run, dir / "chart.js");
  for (const char* missing : {"plan.json without rows", "pilot.json (unreadable)"}) {
    EXPECT_NE(std::find(broken.missing.begin(), broken.missing.end(), missing),
              broken.missing.end())
        << missing;
  }
  EXPECT_NE(broken.html.find("<h2>Plan</h2>"), std::string::npos);
  EXPECT_EQ(broken.html.find("<h2>Pilot</h2>"), std::string::npos);
  for (const auto& id : broken.charts) {
    EXPECT_FALSE(id.starts_with("chart-pilot") || id.starts_with("chart-plan")) << id;
  }
}

TEST(ReportCli, ReportAndExportRefuseBadInputInOneLine) {
  TempDir dir;
  auto result = testing::run_kiln("report " + (dir / "absent").string());
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("not a directory"), std::string::npos) << result.err;
  std::filesystem::create_directories(dir / "run");
  testing::write_text(dir / "run" / "config.toml",
                      "[model]\nname = \"gpt\"\n[data]\nname = \"text\"\n");
  result = testing::run_kiln("export " + (dir / "run").string() + " --format hf " +
                             (dir / "out").string());
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("no checkpoint"), std::string::npos) << result.err;
  result = testing::run_kiln("export " + (dir / "run").string() + " --format onnx " +
                             (dir / "out").string());
  EXPECT_NE(result.exit_code, 0);
}

}  // namespace
}  // namespace kiln
