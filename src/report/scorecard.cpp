// The report's first screen: the ladder's scorecard (one row per rung: status, the number that
// matters, the decision and its config key) and the run's identity; and the training curves.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <regex>

#include "core/strings.h"
#include "report/sections.h"

namespace kiln::report {

std::string bytes_text(double bytes) {
  return std::isfinite(bytes) ? format_bytes(bytes) : "-";
}
std::string seconds_text(double seconds) {
  return std::isfinite(seconds) ? format_duration(seconds) : "-";
}
std::string percent_text(double fraction) {
  return std::isfinite(fraction) ? fmt::format("{:.1f}%", 100 * fraction) : "-";
}
std::string yes_no(bool value) {
  return value ? "yes" : "no";
}
std::string throughput_text(double per_second, bool tokens) {
  return fmt::format("{} {}/s", short_number(per_second), tokens ? "tokens" : "samples");
}

std::string config_key_in(const std::string& text) {
  static const std::regex key(
      R"(\b(?:run|model|data|train|optim|compile|dist|checkpoint|profile|baseline|pilot|plan)\.[a-z_0-9]+(?: = (?:"[^"]*"|[A-Za-z0-9_.+-]+))?)");
  std::smatch match;
  return std::regex_search(text, match, key) ? match.str() : "";
}

namespace {

constexpr double kNone = NAN;

template <class T>
ScoreRow start_row(const std::string& rung, const Loaded<T>& loaded) {
  ScoreRow row{rung, "not run", "absent", {}, "", "", ""};
  if (!loaded.present) return row;
  row.link = rung;
  if (!loaded.value) {
    row.status = "unreadable";
    row.status_class = "unreadable";
    row.decision = loaded.error;
    return row;
  }
  const RungStatus& s = loaded.value->status;
  row.status = s.passed ? "passed" : "FAILED";
  row.status_class = s.passed ? "passed" : "failed";
  if (!s.passed) {
    row.decision = s.verdict;
    row.key = config_key_in(s.verdict);
  }
  return row;
}

// The rung's result when it measured something (else its row stops at its status).
template <class T>
const T* measured(const Loaded<T>& loaded) {
  return loaded.value && loaded.value->status.measured ? &*loaded.value : nullptr;
}

// Throughput in tokens/s when the model has a sequence length, else samples/s: the figure
// `<prefix>tokens_per_second` (or samples), its text followed by `suffix`.
Figure throughput_figure(const std::optional<double>& tokens_per_second, double samples_per_second,
                         const std::string& prefix, const std::string& suffix) {
  const double value = tokens_per_second.value_or(samples_per_second);
  const bool tokens = tokens_per_second.has_value();
  return {prefix + (tokens ? "tokens_per_second" : "samples_per_second"),
          throughput_text(value, tokens) + suffix, value};
}

ScoreRow baseline_row(const RunData& run) {
  ScoreRow row = start_row("baseline", run.baseline);
  const BaselineResult* found = measured(run.baseline);
  if (!found) return row;
  const BaselineResult& b = *found;
  row.figures.push_back(throughput_figure(b.tokens_per_second, b.samples_per_second, "", ""));
  row.figures.push_back(b.mfu ? Figure{"mfu", "MFU " + percent_text(*b.mfu), *b.mfu}
                              : Figure{"mfu", "MFU n/a (no catalog peak for the device)", kNone});
  if (b.mfu_of_matmul_peak) {  // against the job's GEMM timed on the device (no catalog needed)
    row.figures.push_back({"mfu_of_matmul_peak",
                           percent_text(*b.mfu_of_matmul_peak) + " of the measured matmul peak",
                           *b.mfu_of_matmul_peak});
  }
  if (b.status.passed)
    row.decision = "correct eager training: the reference the rungs above measure against";
  return row;
}

ScoreRow compile_row(const RunData& run) {
  ScoreRow row = start_row("compile", run.compile);
  if (!run.compile.value || !run.compile.value->timed) return row;
  const CompileResult& c = *run.compile.value;
  if (c.speedup) {
    row.figures.push_back({"speedup", fmt::format("{:.2f}x speedup", *c.speedup), *c.speedup});
  }
  row.figures.push_back(
      {"compiled_median_seconds",
       fmt::format("{} / step compiled, {} eager", seconds_text(c.compiled.median_seconds),
                   seconds_text(c.eager.median_seconds)),
       c.compiled.median_seconds});
  if (!c.status.passed) return row;
  if (c.speedup && *c.speedup >= c.min_speedup) {
    row.decision = "keep the compiled step (equal numerics, faster)";
    row.key = fmt::format("compile.backend = \"{}\"", c.backend);
  } else {
    row.decision = fmt::format("stay eager: under compile.min_speedup = {}", number(c.min_speedup));
    row.key = "compile.backend = \"eager\"";
  }
  return row;
}

ScoreRow profile_row(const RunData& run) {
  ScoreRow row = start_row("profile", run.profile);
  const ProfileResult* found = measured(run.profile);
  if (!found) return row;
  const ProfileResult& p = *found;
  row.figures.push_back({"bottleneck", p.bottleneck, kNone});
  row.figures.push_back({"step_seconds_mean",
                         fmt::format("{} / profiled step", seconds_text(p.step_seconds_mean)),
                         p.step_seconds_mean});
  if (p.status.passed && !p.actions.empty()) {
    row.decision = p.actions.front();
    row.key = config_key_in(p.actions.front());
  }
  return row;
}

ScoreRow scale_row(const RunData& run) {
  ScoreRow row = start_row("scale", run.scale);
  const ScaleResult* found = measured(run.scale);
  if (!found) return row;
  const ScaleResult& s = *found;
  if (s.scaling_efficiency) {
    row.figures.push_back(
        {"scaling_efficiency",
         fmt::format("{} scaling efficiency", percent_text(*s.scaling_efficiency)),
         *s.scaling_efficiency});
  }
  row.figures.push_back(throughput_figure(s.global_tokens_per_second, s.global_samples_per_second,
                                          "global_",
                                          fmt::format(" over {} processes", s.world_size)));
  if (s.status.passed) {
    row.decision = fmt::format("scale out with {} ({})", s.strategy,
                               s.strategy_reason.empty() ? "dist.strategy" : s.strategy_reason);
    row.key = fmt::format("dist.strategy = \"{}\"", s.strategy);
  }
  return row;
}

ScoreRow checkpoint_row(const RunData& run) {
  ScoreRow row = start_row("checkpoint", run.checkpoint);
  const CheckpointResult* found = measured(run.checkpoint);
  if (!found) return row;
  const CheckpointResult& c = *found;
  const bool bitwise = c.losses_bitwise_equal.value_or(false) &&
                       c.parameters_bitwise_equal.value_or(false) &&
                       c.optimizer_state_bitwise_equal.value_or(false);
  row.figures.push_back({"restore", bitwise ? "restore bitwise equal" : "restore differs", kNone});
  if (c.save_seconds) {
    // The saving run's whole time (it trains to the checkpoint, saves, is killed), not a save.
    row.figures.push_back(
        {"save_seconds", "saving run " + seconds_text(*c.save_seconds), *c.save_seconds});
  }
  if (c.status.passed) {
    row.decision = "checkpoints restore exactly: save periodically in long runs";
    row.key = "checkpoint.every_steps";
  }
  return row;
}

ScoreRow pilot_row(const RunData& run) {
  ScoreRow row = start_row("pilot", run.pilot);
  const PilotResult* found = measured(run.pilot);
  if (!found) return row;
  const PilotResult& p = *found;
  row.figures.push_back({"measured_peak_bytes",
                         "peak " + bytes_text(p.measured.step_peak) + " measured",
                         p.measured.step_peak});
  row.figures.push_back({"estimated_peak_bytes",
                         "vs " + bytes_text(p.estimated.step_peak) + " estimated",
                         p.estimated.step_peak});
  if (p.status.passed) {
    row.decision = p.within_allowed_error
                       ? "the job is proven at its production shape: plan it with this pilot"
                       : "the memory estimate is off: the plan calibrates with the measured peak";
    row.key = p.within_allowed_error ? "" : "pilot.max_estimate_error";
  }
  return row;
}

ScoreRow plan_row(const RunData& run) {
  ScoreRow row = start_row("plan", run.plan);
  if (!run.plan.value) return row;
  const PlanResult& p = *run.plan.value;
  const int chosen = p.recommended_row();
  if (chosen >= 0) {
    const PlanRow& r = p.rows[static_cast<size_t>(chosen)];
    row.figures.push_back({"recommended",
                           fmt::format("{} x {}, {}, {} days", r.gpus, r.hardware,
                                       r.strategy_text(), p.recommendation->reservation_days),
                           kNone});
    if (r.wall_days) {
      row.figures.push_back({"wall_days",
                             fmt::format("{} days of wall time", short_number(*r.wall_days)),
                             *r.wall_days});
    }
  }
  row.decision = p.recommendation_text;
  row.key = "plan.hardware";
  return row;
}

}  // namespace

std::vector<ScoreRow> score_rows(const RunData& run) {
  return {baseline_row(run),   compile_row(run), profile_row(run), scale_row(run),
          checkpoint_row(run), pilot_row(run),   plan_row(run)};
}

std::string next_step(const RunData& run, const std::vector<ScoreRow>& rows) {
  for (const auto& row : rows) {
    if (row.status_class == "failed" || row.status_class == "unreadable") {
      return fmt::format("the {} rung {}: {}", row.rung,
                         row.status_class == "failed" ? "failed" : "file is unreadable",
                         row.decision);
    }
  }
  if (run.plan.value) return "reserve " + run.plan.value->recommendation_text;
  bool any = false;
  for (const auto& row : rows) any = any || row.status_class != "absent";
  return any ? "every rung that ran passed; run the pilot and the plan (`kiln pilot`, "
               "`kiln plan --pilot RUN_DIR`) before a long run"
             : "no rung has run here: `kiln ladder CONFIG` runs them in order";
}

Data scorecard_data(const RunData& run) {
  const std::vector<ScoreRow> rows = score_rows(run);
  Data list{Data::type::list};
  for (const auto& r : rows) {
    Data row;
    row.set("rung", r.rung);
    row.set("status", r.status);
    row.set("status_class", r.status_class);
    Data figures{Data::type::list};
    for (const auto& f : r.figures) {
      Data figure;
      figure.set("name", f.name);
      figure.set("text", f.text);
      figure.set("exact", std::isfinite(f.exact) ? fmt::format("{}", f.exact) : std::string());
      figures.push_back(figure);
    }
    row.set("figures", figures);
    row.set("decision", r.decision.empty() ? std::string("-") : r.decision);
    if (r.key.empty())
      row.set("key", false);
    else
      row.set("key", r.key);
    if (r.link.empty())
      row.set("link", false);
    else
      row.set("link", r.link);
    list.push_back(row);
  }
  Data out;
  out.set("rows", list);
  out.set("next", next_step(run, rows));
  return out;
}

Data identity_data(const RunData& run) {
  if (!run.identity.value) return Data(false);
  const RunIdentity& m = *run.identity.value;
  std::vector<std::tuple<std::string, std::string, std::string>> rows = {
      {"commit", "commit", m.git_commit + (m.git_dirty ? " (with local changes)" : "")},
      {"config_hash", "config hash (xxh64)",
       m.config_hash + (m.config_file.empty() ? "" : " (" + m.config_file + ")")},
      {"data", "data revision",
       m.data_revision.value_or(m.data_content_hash.empty()
                                    ? m.data_kind
                                    : m.data_kind + ", content xxh3 " + m.data_content_hash)},
      {"device", "device", fmt::format("{} x {}", m.world_size, m.device)},
      {"model", "model",
       fmt::format("{}, {} parameters", m.model_architecture, number(m.model_parameters))},
      {"versions", "kiln, libtorch", m.kiln_version + ", " + m.libtorch_version},
      {"started", "started (UTC)", m.start_time_utc},
      {"command", "command", m.command_line},
  };
  Data list{Data::type::list};
  for (const auto& [name, key, value] : rows) {
    Data row;
    row.set("name", name);
    row.set("key", key);
    Data values{Data::type::list};
    values.push_back(Data(value));
    row.set("values", values);
    list.push_back(row);
  }
  Data out;
  out.set("rows", list);
  return out;
}

// ---- training curves ---------------------------------------------------------------------------

bool records_tokens(const MetricsFile& metrics) {
  for (const auto& r : metrics.records) {
    if (r.tokens_per_second) return true;
  }
  return false;
}

MetricsCurves metrics_curves(const MetricsFile& metrics, bool tokens, const std::string& prefix) {
  MetricsCurves c{{prefix + "train loss", {}, {}},
                  {prefix + "validation loss", {}, {}},
                  {prefix + (tokens ? "tokens/s" : "samples/s"), {}, {}},
                  {prefix + "learning rate", {}, {}},
                  {prefix + "gradient norm (before clipping)", {}, {}, true}};
  for (const auto& r : metrics.records) {
    const double step = static_cast<double>(r.step);
    if (r.loss) c.loss.x.push_back(step), c.loss.y.push_back(*r.loss);
    if (r.lr) c.lr.x.push_back(step), c.lr.y.push_back(*r.lr);
    if (r.grad_norm) c.grad_norm.x.push_back(step), c.grad_norm.y.push_back(*r.grad_norm);
    if (r.val_loss) c.val.x.push_back(step), c.val.y.push_back(*r.val_loss);
    const auto& per_second = tokens ? r.tokens_per_second : r.samples_per_second;
    if (per_second) c.rate.x.push_back(step), c.rate.y.push_back(*per_second);
  }
  return c;
}

void training_section(const RunData& run, SectionSink& sink) {
  const MetricsFile* metrics = run.main_metrics();
  if (metrics == nullptr) return;
  Section& section = sink.add("training", "Training: " + metrics->name);
  auto [loss, val, rate, lr, grad_norm] = metrics_curves(*metrics, records_tokens(*metrics), "");
  // The ladder's baseline records no evaluations in its metrics file: its validation loss before
  // and after training comes from baseline.json.
  const auto& baseline = run.baseline.value;
  if (val.x.empty() && metrics->name == "metrics-baseline.jsonl" && baseline &&
      baseline->status.measured && !loss.x.empty()) {
    val.label = "validation loss (baseline.json: before, after)";
    val.x = {0.0, loss.x.back()};
    val.y = {baseline->val_loss_initial, baseline->val_loss_final};
  }
  // kiln train's plan records (no loss: the curves skip them) have a section of their own.
  const auto plans = std::count_if(metrics->records.begin(), metrics->records.end(),
                                   [](const MetricsRecord& r) { return r.plan.has_value(); });
  section.intro(fmt::format("{} records: {} training steps, {} evaluations{}",
                            metrics->records.size(), loss.x.size(), val.x.size(),
                            plans > 0 ? fmt::format(", {} against the plan", plans) : ""));
  Chart losses{
      "training-loss", "Train and validation loss", false, false, true, "step", "loss", "", {}, {}};
  for (const Series* s : {&loss, &val}) {
    if (!s->x.empty()) losses.series.push_back(*s);
  }
  if (!losses.series.empty()) section.chart(losses);
  if (!rate.x.empty()) {
    section.chart(Chart{"training-throughput",
                        "Throughput by step",
                        false,
                        false,
                        false,
                        "step",
                        rate.label,
                        "",
                        {},
                        {rate}});
  }
  if (!lr.x.empty() || !grad_norm.x.empty()) {
    Chart optimizer{"training-optimizer",
                    "Learning rate and gradient norm by step",
                    false,
                    false,
                    false,
                    "step",
                    "learning rate",
                    "gradient norm",
                    {},
                    {}};
    for (const Series* s : {&lr, &grad_norm}) {
      if (!s->x.empty()) optimizer.series.push_back(*s);
    }
    section.chart(optimizer);
  }
  Rows others;
  for (const auto& m : run.metrics) {
    if (&m == metrics) continue;
    std::optional<double> first, last;
    for (const auto& r : m.records) {
      if (!r.loss) continue;
      if (!first) first = r.loss;
      last = r.loss;
    }
    others.emplace_back(
        m.name,
        fmt::format("{} records{}", m.records.size(),
                    first ? fmt::format(", loss {} -> {}", number(*first), number(*last)) : ""));
  }
  section.details("Other metrics files in this run", others);
}

}  // namespace kiln::report
